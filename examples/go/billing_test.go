package main

import (
	"context"
	"errors"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/consumer-proxy/consumer-proxy/examples/go/gen/consumerproxy/v1"
)

type fakeStore struct {
	err     error
	charged map[int64]bool
}

func (s *fakeStore) Charge(_ context.Context, _ string, _ int32, offset int64, _ Trip) (bool, error) {
	if s.err != nil {
		return false, s.err
	}
	done := s.charged[offset]
	s.charged[offset] = true
	return done, nil
}

func TestBillingAnswersInTheContractsTerms(t *testing.T) {
	trip := []byte(`{"id": "t1", "amount_cents": 1250}`)
	cases := []struct {
		name  string
		value []byte
		err   error
		again bool
		code  codes.Code
		retry bool
	}{
		{"ack", trip, nil, false, codes.OK, false},
		{"redelivery", trip, nil, true, codes.AlreadyExists, false},
		{"poison", []byte("not json"), nil, false, codes.InvalidArgument, false},
		{"outage", trip, ErrDatabaseDown, false, codes.Unavailable, false},
		{"slow down", trip, ErrRateLimited, false, codes.OK, true},
		{"transient", trip, errors.New("deadlock"), false, codes.Internal, false},
	}
	for _, c := range cases {
		store := &fakeStore{err: c.err, charged: map[int64]bool{7: c.again}}
		b := &billing{db: store}
		req := &pb.HandleMessageRequest{Message: &pb.Message{Topic: "trips", Offset: 7, Value: c.value}}
		got, err := b.HandleMessage(context.Background(), req)
		if status.Code(err) != c.code {
			t.Errorf("%s: status %v, want %v", c.name, status.Code(err), c.code)
		}
		if c.retry != (got.GetAction() == pb.HandleMessageResponse_RETRY) {
			t.Errorf("%s: response %v", c.name, got)
		}
	}
}

func TestBillingBatchAnswersEachMessageAsItsUnaryCallWould(t *testing.T) {
	trip := []byte(`{"id": "t1", "amount_cents": 1250}`)
	store := &fakeStore{charged: map[int64]bool{2: true}}
	b := &billing{db: store}
	req := &pb.HandleMessageBatchRequest{Messages: []*pb.Message{
		{Topic: "trips", Offset: 1, Value: trip},
		{Topic: "trips", Offset: 2, Value: trip},
		{Topic: "trips", Offset: 3, Value: []byte("not json")},
	}}
	got, err := b.HandleMessageBatch(context.Background(), req)
	if err != nil {
		t.Fatalf("batch failed: %v", err)
	}
	want := []codes.Code{codes.OK, codes.AlreadyExists, codes.InvalidArgument}
	if len(got.GetResults()) != len(want) {
		t.Fatalf("%d results for %d messages", len(got.GetResults()), len(want))
	}
	for i, res := range got.GetResults() {
		if codes.Code(res.GetStatusCode()) != want[i] {
			t.Errorf("message %d: status_code %v, want %v", i, codes.Code(res.GetStatusCode()), want[i])
		}
	}
}
