package main

import (
	"context"
	"testing"

	cpv1 "github.com/consumer-proxy/consumer-proxy/examples/go/gen/consumerproxy/v1"
)

func request(value string, attempt int32) *cpv1.HandleMessageRequest {
	return &cpv1.HandleMessageRequest{Message: &cpv1.Message{
		Topic: "orders", Value: []byte(value), HasValue: true, Attempt: attempt,
	}}
}

func TestHandlerAcksRetriesOnceAndDeadLetters(t *testing.T) {
	h := &handler{poison: []byte("poison"), flaky: []byte("flaky")}
	cases := []struct {
		value   string
		attempt int32
		want    cpv1.HandleMessageResponse_Action
	}{
		{"an order", 1, cpv1.HandleMessageResponse_ACTION_UNSPECIFIED}, // an empty response: ack
		{"a flaky order", 1, cpv1.HandleMessageResponse_RETRY},
		{"a flaky order", 2, cpv1.HandleMessageResponse_ACTION_UNSPECIFIED},
		{"a poison order", 1, cpv1.HandleMessageResponse_DEAD_LETTER},
	}
	for _, c := range cases {
		got, err := h.HandleMessage(context.Background(), request(c.value, c.attempt))
		if err != nil || got.GetAction() != c.want {
			t.Errorf("%q attempt %d: got %v, %v; want %v", c.value, c.attempt, got, err, c.want)
		}
	}
	if h.acked.Load() != 2 || h.retried.Load() != 1 || h.deadLettered.Load() != 1 {
		t.Errorf("counts: acked=%d retried=%d dead_lettered=%d",
			h.acked.Load(), h.retried.Load(), h.deadLettered.Load())
	}
}

func TestBatchAnswersInOrder(t *testing.T) {
	h := &handler{poison: []byte("poison")}
	req := &cpv1.HandleMessageBatchRequest{Messages: []*cpv1.Message{
		request("ok", 1).GetMessage(), request("poison", 1).GetMessage(), request("ok", 1).GetMessage(),
	}}
	got, err := h.HandleMessageBatch(context.Background(), req)
	if err != nil || len(got.GetResults()) != 3 || got.GetResults()[1].GetAction() != cpv1.HandleMessageResponse_DEAD_LETTER {
		t.Fatalf("got %v, %v", got, err)
	}
}
