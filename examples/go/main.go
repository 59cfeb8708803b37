// Command example is a consumer-proxy service in Go: it implements
// consumerproxy.v1.MessageHandler from the generated stubs in gen/consumerproxy/v1, acks
// messages, retries a "flaky" one once, dead-letters a "poison" one, and serves
// grpc.health.v1 so the proxy can take an instance out of rotation.
//
//	go run . -port 50051 [-host 127.0.0.1] [-poison poison] [-flaky flaky] [-max-request-bytes N]
//	         [-long long] [-long-ms 60000] [-stuck stuck]
//
// HandleMessageStream (groups with delivery.long_running, longrun.go) heartbeats while a
// message works: one containing -long takes -long-ms, one containing -stuck runs until the
// proxy cancels the call.
//
// gRPC's default receive limit is 4 MiB; the server takes calls up to -max-request-bytes
// (128 MiB by default, like the Python SDK), so that a large record, or a batch up to the
// group's batch.max_bytes, reaches the handler instead of being refused as
// RESOURCE_EXHAUSTED (which the proxy retries as "message too large for the service" and
// dead-letters after max_attempts).
//
// The port may also come from the PORT environment variable; -port 0 picks a free port. The
// address is logged as "serving on HOST:PORT". SIGINT or SIGTERM stops it gracefully: health
// turns NOT_SERVING, in-flight calls finish, and the counts are logged.
//
// Tracing (tracing.go): with OTEL_EXPORTER_OTLP_ENDPOINT set, each call's server span
// (otelgrpc) continues the proxy's trace, and each message of a batch gets a span whose parent
// is the proxy's span for it; the standard OTEL_* variables configure the exporter.
package main

import (
	"context"
	"flag"
	"log"
	"net"
	"os"
	"os/signal"
	"strconv"
	"syscall"
	"time"

	"go.opentelemetry.io/contrib/instrumentation/google.golang.org/grpc/otelgrpc"
	"google.golang.org/grpc"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	cpv1 "github.com/consumer-proxy/consumer-proxy/examples/go/gen/consumerproxy/v1"
)

// defaultMaxRequestBytes covers the proxy's largest batch (batch.max_bytes up to 64 MiB of
// message bytes, plus each message's coordinates) and any record a broker with the default
// socket.request.max.bytes (100 MiB) can store.
const defaultMaxRequestBytes = 128 << 20

func main() {
	log.SetFlags(log.LstdFlags | log.Lmicroseconds)
	defaultPort := 50051
	if env, err := strconv.Atoi(os.Getenv("PORT")); err == nil {
		defaultPort = env
	}
	host := flag.String("host", "127.0.0.1", "address to bind")
	port := flag.Int("port", defaultPort, "port to bind (0: any free port; default $PORT or 50051)")
	poison := flag.String("poison", "poison", "dead-letter a message whose value contains this")
	flaky := flag.String("flaky", "flaky", "retry once a message whose value contains this")
	long := flag.String("long", "long", "HandleMessageStream: a value containing this takes -long-ms")
	longMs := flag.Int("long-ms", 60000, "how long a -long message takes, in milliseconds")
	stuck := flag.String("stuck", "stuck", "HandleMessageStream: a value containing this runs until cancelled")
	maxRequestBytes := flag.Int("max-request-bytes", defaultMaxRequestBytes,
		"largest call accepted (one message or one batch), in bytes")
	flag.Parse()

	listener, err := net.Listen("tcp", net.JoinHostPort(*host, strconv.Itoa(*port)))
	if err != nil {
		log.Fatalf("listen: %v", err)
	}
	h := &handler{
		poison: []byte(*poison), flaky: []byte(*flaky),
		long: []byte(*long), longFor: time.Duration(*longMs) * time.Millisecond, stuck: []byte(*stuck),
	}
	shutdownTracing, err := setupTracing(context.Background())
	if err != nil {
		log.Fatalf("tracing: %v", err)
	}
	// otelgrpc: a server span per call, the child of the proxy's attempt (W3C metadata).
	server := grpc.NewServer(grpc.MaxRecvMsgSize(*maxRequestBytes),
		grpc.StatsHandler(otelgrpc.NewServerHandler()))
	cpv1.RegisterMessageHandlerServer(server, h)
	healthServer := health.NewServer()
	healthpb.RegisterHealthServer(server, healthServer)
	// "" is the whole server; the service name is what a per-service check asks for.
	for _, service := range []string{"", cpv1.MessageHandler_ServiceDesc.ServiceName} {
		healthServer.SetServingStatus(service, healthpb.HealthCheckResponse_SERVING)
	}

	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGINT, syscall.SIGTERM)
	go func() {
		sig := <-stop
		log.Printf("%v: stopping", sig)
		healthServer.Shutdown() // NOT_SERVING first, so the proxy stops choosing this instance
		server.GracefulStop()
	}()

	log.Printf("serving on %s", listener.Addr())
	if err := server.Serve(listener); err != nil {
		log.Fatalf("serve: %v", err)
	}
	flush, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := shutdownTracing(flush); err != nil {
		log.Printf("tracing: %v", err)
	}
	log.Printf("stopped: acked=%d retried=%d dead_lettered=%d cancelled=%d",
		h.acked.Load(), h.retried.Load(), h.deadLettered.Load(), h.cancelled.Load())
}
