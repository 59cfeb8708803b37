package main

import (
	"bytes"
	"context"
	"fmt"
	"sync/atomic"
	"time"

	cpv1 "github.com/consumer-proxy/consumer-proxy/examples/go/gen/consumerproxy/v1"
)

// handler implements consumerproxy.v1.MessageHandler. The proxy calls it once per Kafka
// message, in parallel, so it keeps no per-call state; delivery is at-least-once, so a real
// handler must be idempotent (key its side effects on topic, partition and offset).
type handler struct {
	cpv1.UnimplementedMessageHandlerServer

	poison []byte // a value containing this is a poison pill: dead-letter it
	flaky  []byte // a value containing this fails its first attempt: retry it

	long    []byte        // HandleMessageStream: a value containing this takes longFor
	longFor time.Duration //
	stuck   []byte        // HandleMessageStream: a value containing this runs until cancelled

	acked, retried, deadLettered, cancelled atomic.Int64
}

// decide is the whole business logic of the example: one message in, one outcome out.
func (h *handler) decide(msg *cpv1.Message) *cpv1.HandleMessageResponse {
	value := msg.GetValue()
	switch {
	case len(h.poison) > 0 && bytes.Contains(value, h.poison):
		// No retry can fix it: the proxy writes it to the group's DLQ with this reason.
		h.deadLettered.Add(1)
		return &cpv1.HandleMessageResponse{
			Action: cpv1.HandleMessageResponse_DEAD_LETTER,
			Reason: fmt.Sprintf("value contains %q", h.poison),
		}
	case len(h.flaky) > 0 && bytes.Contains(value, h.flaky) && msg.GetAttempt() < 2:
		// A transient failure: the proxy delivers it again (attempt 2) after retry_after_ms.
		h.retried.Add(1)
		return &cpv1.HandleMessageResponse{
			Action:       cpv1.HandleMessageResponse_RETRY,
			RetryAfterMs: 10,
			Reason:       "transient failure, try again",
		}
	default:
		// The work would happen here. An empty response acks the message.
		h.acked.Add(1)
		return &cpv1.HandleMessageResponse{}
	}
}

// HandleMessage handles one message. Returning a gRPC status error instead of a response is
// the other way to answer: INVALID_ARGUMENT dead-letters, UNAVAILABLE means "I am down" (the
// proxy pauses without counting an attempt), ALREADY_EXISTS acks; see handler.proto.
func (h *handler) HandleMessage(
	_ context.Context, req *cpv1.HandleMessageRequest,
) (*cpv1.HandleMessageResponse, error) {
	return h.decide(req.GetMessage()), nil
}

// HandleMessageBatch handles several messages: one result per message, in the same order.
// Each message runs in a span of its own, the child of the proxy's span for it (tracing.go).
func (h *handler) HandleMessageBatch(
	ctx context.Context, req *cpv1.HandleMessageBatchRequest,
) (*cpv1.HandleMessageBatchResponse, error) {
	results := make([]*cpv1.HandleMessageResponse, 0, len(req.GetMessages()))
	for _, msg := range req.GetMessages() {
		_, span := messageContext(ctx, msg)
		results = append(results, h.decide(msg))
		span.End()
	}
	return &cpv1.HandleMessageBatchResponse{Results: results}, nil
}
