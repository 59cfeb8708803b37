package main

// The billing handler of docs/operating.md, kept here so that it compiles and is tested
// (tests/test_go_example.py checks the docs quote this file as it is).

import (
	"context"
	"encoding/json"
	"errors"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/consumer-proxy/consumer-proxy/examples/go/gen/consumerproxy/v1"
)

// Trip is one completed trip to charge, the value of a Kafka message.
type Trip struct {
	ID          string `json:"id"`
	AmountCents int64  `json:"amount_cents"`
}

// Store charges trips, idempotently: done is true when this message was charged before.
type Store interface {
	Charge(ctx context.Context, topic string, partition int32, offset int64, trip Trip) (done bool, err error)
}

var (
	ErrDatabaseDown = errors.New("database down")
	ErrRateLimited  = errors.New("rate limited")
)

type billing struct {
	pb.UnimplementedMessageHandlerServer
	db Store
}

func (b *billing) HandleMessage(ctx context.Context, req *pb.HandleMessageRequest) (*pb.HandleMessageResponse, error) {
	m := req.GetMessage()
	var trip Trip
	if err := json.Unmarshal(m.GetValue(), &trip); err != nil {
		// A poison pill: straight to the DLQ with this reason, no retry.
		return nil, status.Errorf(codes.InvalidArgument, "not a trip: %v", err)
	}
	done, err := b.db.Charge(ctx, m.GetTopic(), m.GetPartition(), m.GetOffset(), trip)
	switch {
	case errors.Is(err, ErrDatabaseDown):
		return nil, status.Error(codes.Unavailable, "database down") // outage: the breaker opens, nothing is dead-lettered
	case errors.Is(err, ErrRateLimited):
		return &pb.HandleMessageResponse{Action: pb.HandleMessageResponse_RETRY, RetryAfterMs: 2000}, nil
	case err != nil:
		return nil, status.Error(codes.Internal, err.Error()) // transient: retried, counted
	case done:
		return nil, status.Error(codes.AlreadyExists, "charged before") // a redelivery: ack
	}
	return &pb.HandleMessageResponse{}, nil // ack
}

// HandleMessageBatch charges several trips, one result per message in order: the proxy sends
// batches to a service that serves this (delivery.batch: auto, the default). A message's error
// becomes its result's status_code, which the proxy reads like a unary call's status.
func (b *billing) HandleMessageBatch(ctx context.Context, req *pb.HandleMessageBatchRequest) (*pb.HandleMessageBatchResponse, error) {
	results := make([]*pb.HandleMessageResponse, 0, len(req.GetMessages()))
	for _, m := range req.GetMessages() {
		res, err := b.HandleMessage(ctx, &pb.HandleMessageRequest{Message: m})
		if err != nil {
			st := status.Convert(err)
			res = &pb.HandleMessageResponse{StatusCode: int32(st.Code()), Reason: st.Message()}
		}
		results = append(results, res)
	}
	return &pb.HandleMessageBatchResponse{Results: results}, nil
}
