// Command gohandler is the benches' handler service in Go: the same books as the Python
// handler in bench/handlers.py (both kinds of books), at a small fraction of its CPU, so a
// bench on a two-core machine measures the proxy rather than its service.
//
//	gohandler [-delay-ms 20] [-slow-ms 2000] [-latency]
//
// It serves consumerproxy.v1.MessageHandler on 127.0.0.1 (a free port, printed as the first
// line on stdout) and answers every message with an ack after sleeping -delay-ms (-slow-ms for
// a value starting with "slow"); a batch's messages are worked on concurrently, one sleep per
// call. Commands on stdin, one per line, each answered with one JSON line on stdout: reset,
// progress, stats, stop (EOF stops too).
package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"log"
	"net"
	"os"
	"strconv"
	"sync"
	"syscall"
	"time"
	"unsafe"

	"google.golang.org/grpc"

	cpv1 "github.com/consumer-proxy/consumer-proxy/examples/go/gen/consumerproxy/v1"
)

var slowMarker = []byte("slow")

// monotonic is CLOCK_MONOTONIC in seconds: the clock of Python's time.monotonic(), so the
// bench can compare the handler's arrival times with its own.
func monotonic() float64 {
	var ts syscall.Timespec
	const clockMonotonic = 1
	syscall.Syscall(syscall.SYS_CLOCK_GETTIME, clockMonotonic, uintptr(unsafe.Pointer(&ts)), 0)
	return float64(ts.Sec) + float64(ts.Nsec)/1e9
}

func cpuSeconds() float64 {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	tv := func(t syscall.Timeval) float64 { return float64(t.Sec) + float64(t.Usec)/1e6 }
	return tv(ru.Utime) + tv(ru.Stime)
}

type msgID struct {
	topic     string
	partition int32
	offset    int64
}

// books is what the handler recorded since the last reset.
type books struct {
	calls, deliveries   int
	seen                map[msgID]struct{}
	firstSeen           []float64 // monotonic time of each distinct message's first arrival
	first, last         *float64  // monotonic time of the first and the latest call
	latencyFast         []float64 // unary first deliveries: wall ms - record timestamp
	latencySlow         []float64
	latencyFirst        []float64 // -latency only: first attempts (unary and batch)
	latencyOffsets      []int64   // ... and their offsets, in the same order
	partitions          map[int32]int
	sizes               map[int]int
	inFlight, peakCalls int
}

func newBooks() *books {
	return &books{seen: map[msgID]struct{}{}, partitions: map[int32]int{}, sizes: map[int]int{}}
}

type handler struct {
	cpv1.UnimplementedMessageHandlerServer
	delay, slow time.Duration
	latency     bool

	mu sync.Mutex
	b  *books
}

// arrived books one call of msgs; the caller holds h.mu.
func (h *handler) arrived(msgs []*cpv1.Message, batch bool) time.Duration {
	b, now := h.b, monotonic()
	if b.first == nil {
		b.first = &now
	}
	b.last = &now
	b.calls++
	b.deliveries += len(msgs)
	if batch {
		b.sizes[len(msgs)]++
	}
	wallMs := float64(time.Now().UnixNano()) / 1e6
	var delay time.Duration
	for _, m := range msgs {
		slow := bytes.HasPrefix(m.GetValue(), slowMarker)
		if slow && h.slow > delay {
			delay = h.slow
		} else if !slow && h.delay > delay {
			delay = h.delay
		}
		id := msgID{m.GetTopic(), m.GetPartition(), m.GetOffset()}
		if _, ok := b.seen[id]; ok {
			continue
		}
		b.seen[id] = struct{}{}
		b.firstSeen = append(b.firstSeen, now)
		b.partitions[m.GetPartition()]++
		if h.latency && m.GetAttempt() == 1 {
			b.latencyFirst = append(b.latencyFirst, wallMs-float64(m.GetTimestampMs()))
			b.latencyOffsets = append(b.latencyOffsets, m.GetOffset())
		}
		if !batch && m.GetTimestampMs() > 0 {
			if slow {
				b.latencySlow = append(b.latencySlow, wallMs-float64(m.GetTimestampMs()))
			} else {
				b.latencyFast = append(b.latencyFast, wallMs-float64(m.GetTimestampMs()))
			}
		}
	}
	return delay
}

func (h *handler) HandleMessage(
	_ context.Context, req *cpv1.HandleMessageRequest,
) (*cpv1.HandleMessageResponse, error) {
	h.mu.Lock()
	delay := h.arrived([]*cpv1.Message{req.GetMessage()}, false)
	h.mu.Unlock()
	if delay > 0 {
		time.Sleep(delay)
	}
	return &cpv1.HandleMessageResponse{}, nil
}

func (h *handler) HandleMessageBatch(
	_ context.Context, req *cpv1.HandleMessageBatchRequest,
) (*cpv1.HandleMessageBatchResponse, error) {
	msgs := req.GetMessages()
	h.mu.Lock()
	delay := h.arrived(msgs, true)
	b := h.b
	if delay > 0 {
		b.inFlight++
		b.peakCalls = max(b.peakCalls, b.inFlight)
	}
	h.mu.Unlock()
	if delay > 0 {
		time.Sleep(delay)
		h.mu.Lock()
		b.inFlight-- // the books it started in, even if reset meanwhile
		h.mu.Unlock()
	}
	results := make([]*cpv1.HandleMessageResponse, len(msgs))
	for i := range results {
		results[i] = &cpv1.HandleMessageResponse{}
	}
	return &cpv1.HandleMessageBatchResponse{Results: results}, nil
}

func orNull[T any](f []T) []T {
	if f == nil {
		return []T{}
	}
	return f
}

// answer is one command's JSON answer.
func (h *handler) answer(command string) any {
	h.mu.Lock()
	defer h.mu.Unlock()
	b := h.b
	switch command {
	case "reset":
		h.b = newBooks()
		return true
	case "progress":
		var firstSeen, lastSeen *float64
		if n := len(b.firstSeen); n > 0 {
			firstSeen, lastSeen = &b.firstSeen[0], &b.firstSeen[n-1]
		}
		return map[string]any{
			"distinct": len(b.seen), "calls": b.calls, "deliveries": b.deliveries,
			"first_seen_first": firstSeen, "first_seen_last": lastSeen,
			"first": b.first, "last": b.last, "cpu_s": cpuSeconds(),
		}
	case "stats":
		partitions := map[string]int{}
		for p, n := range b.partitions {
			partitions[strconv.Itoa(int(p))] = n
		}
		sizes := map[string]int{}
		for s, n := range b.sizes {
			sizes[strconv.Itoa(s)] = n
		}
		return map[string]any{
			"calls": b.calls, "deliveries": b.deliveries, "distinct": len(b.seen),
			"first_seen": orNull(b.firstSeen), "latency_fast_ms": orNull(b.latencyFast),
			"latency_slow_ms": orNull(b.latencySlow), "latency_ms": orNull(b.latencyFirst),
			"latency_offsets": orNull(b.latencyOffsets),
			"partitions": partitions, "sizes": sizes, "peak_calls": b.peakCalls,
		}
	}
	return map[string]string{"error": fmt.Sprintf("unknown command %q", command)}
}

func main() {
	delayMs := flag.Float64("delay-ms", 0, "sleep per call (0: answer at once)")
	slowMs := flag.Float64("slow-ms", 0, `sleep instead for a value starting with "slow"`)
	latency := flag.Bool("latency", false, "record the latency of every first attempt")
	flag.Parse()
	ms := func(v float64) time.Duration { return time.Duration(v * float64(time.Millisecond)) }
	h := &handler{delay: ms(*delayMs), slow: ms(*slowMs), latency: *latency, b: newBooks()}

	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		log.Fatalf("listen: %v", err)
	}
	server := grpc.NewServer()
	cpv1.RegisterMessageHandlerServer(server, h)
	go func() {
		if err := server.Serve(lis); err != nil {
			log.Printf("serve: %v", err)
		}
	}()
	out := bufio.NewWriter(os.Stdout)
	enc := json.NewEncoder(out)
	fmt.Fprintln(out, lis.Addr().(*net.TCPAddr).Port)
	out.Flush()

	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		command := in.Text()
		if command == "stop" {
			break
		}
		if err := enc.Encode(h.answer(command)); err != nil {
			log.Fatalf("answer: %v", err)
		}
		out.Flush()
	}
	stopped := make(chan struct{})
	go func() { server.GracefulStop(); close(stopped) }()
	select {
	case <-stopped:
	case <-time.After(time.Second):
		server.Stop()
	}
	fmt.Fprintln(out, `"stopped"`)
	out.Flush()
}
