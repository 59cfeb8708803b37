package main

// HandleMessageStream: the long-running call of a group with delivery.long_running. The work
// runs in a goroutine; this method sends a heartbeat every heartbeat_interval_ms while it runs
// (from here, not from the work: a heartbeat says "the process holds the call", and a ticker
// keeps ticking however the work is written), then the result. When the proxy cancels the
// call (no heartbeat in time, max_processing_ms, a revoked partition, its shutdown) the
// stream's context is done: the work sees ctx.Done() and stops.

import (
	"bytes"
	"context"
	"log"
	"time"

	"google.golang.org/grpc/status"

	cpv1 "github.com/consumer-proxy/consumer-proxy/examples/go/gen/consumerproxy/v1"
)

func (h *handler) HandleMessageStream(
	req *cpv1.HandleMessageStreamRequest, stream cpv1.MessageHandler_HandleMessageStreamServer,
) error {
	ctx := stream.Context()
	interval := time.Duration(req.GetHeartbeatIntervalMs()) * time.Millisecond
	if interval <= 0 {
		interval = time.Second
	}
	done := make(chan *cpv1.HandleMessageResponse, 1) // buffered: the work never blocks on it
	go func() { done <- h.work(ctx, req.GetMessage()) }()
	ticker := time.NewTicker(interval)
	defer ticker.Stop()
	for {
		select {
		case result := <-done:
			if result == nil { // cancelled
				return status.FromContextError(ctx.Err()).Err()
			}
			return stream.Send(&cpv1.HandleMessageStreamEvent{
				Event: &cpv1.HandleMessageStreamEvent_Result{Result: result},
			})
		case <-ticker.C:
			beat := &cpv1.HandleMessageStreamEvent{
				Event: &cpv1.HandleMessageStreamEvent_Heartbeat{Heartbeat: &cpv1.Heartbeat{}},
			}
			if err := stream.Send(beat); err != nil {
				return err // the call is gone; ctx is done, so is the work
			}
		}
	}
}

// work is the long job: a value containing h.long takes h.longFor, one containing h.stuck
// never ends by itself; both stop when ctx is done (nil: cancelled). Then decide answers.
func (h *handler) work(ctx context.Context, msg *cpv1.Message) *cpv1.HandleMessageResponse {
	value := msg.GetValue()
	var wait <-chan time.Time
	switch {
	case len(h.stuck) > 0 && bytes.Contains(value, h.stuck):
		wait = nil // forever
	case len(h.long) > 0 && bytes.Contains(value, h.long):
		wait = time.After(h.longFor)
	default:
		return h.decide(msg)
	}
	select {
	case <-wait:
		return h.decide(msg)
	case <-ctx.Done():
		h.cancelled.Add(1)
		log.Printf("cancelled %s[%d]@%d: %v",
			msg.GetTopic(), msg.GetPartition(), msg.GetOffset(), context.Cause(ctx))
		return nil
	}
}
