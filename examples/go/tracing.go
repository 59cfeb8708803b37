package main

import (
	"context"
	"os"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"

	cpv1 "github.com/consumer-proxy/consumer-proxy/examples/go/gen/consumerproxy/v1"
)

// tracerName names the spans this example starts itself (the batch messages' spans).
const tracerName = "github.com/consumer-proxy/consumer-proxy/examples/go"

// setupTracing exports spans over OTLP/gRPC when OTEL_EXPORTER_OTLP_ENDPOINT (or
// OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) is set; the standard OTEL_* variables configure the
// rest (OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES, OTEL_TRACES_SAMPLER). It always installs
// the W3C propagator, so the gRPC instrumentation (otelgrpc, main.go) continues the proxy's
// trace. The returned function flushes and stops the exporter.
func setupTracing(ctx context.Context) (func(context.Context) error, error) {
	otel.SetTextMapPropagator(propagation.NewCompositeTextMapPropagator(
		propagation.TraceContext{}, propagation.Baggage{}))
	if os.Getenv("OTEL_EXPORTER_OTLP_ENDPOINT") == "" &&
		os.Getenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") == "" {
		return func(context.Context) error { return nil }, nil
	}
	exporter, err := otlptracegrpc.New(ctx)
	if err != nil {
		return nil, err
	}
	provider := sdktrace.NewTracerProvider(
		sdktrace.WithBatcher(exporter),
		sdktrace.WithResource(resource.Default()),
	)
	otel.SetTracerProvider(provider)
	return provider.Shutdown, nil
}

// messageContext is the context of one message of a batch: a span whose parent is the
// proxy's span for that message (Message.traceparent), linked to the batch call's span
// (the call's context, from otelgrpc). Spans the handler starts from it nest under it.
func messageContext(call context.Context, msg *cpv1.Message) (context.Context, trace.Span) {
	carrier := propagation.MapCarrier{}
	if msg.GetTraceparent() != "" {
		carrier["traceparent"] = msg.GetTraceparent()
		if msg.GetTracestate() != "" {
			carrier["tracestate"] = msg.GetTracestate()
		}
	}
	parent := otel.GetTextMapPropagator().Extract(context.Background(), carrier)
	options := []trace.SpanStartOption{
		trace.WithSpanKind(trace.SpanKindServer),
		trace.WithAttributes(
			attribute.String("rpc.system", "grpc"),
			attribute.String("rpc.service", cpv1.MessageHandler_ServiceDesc.ServiceName),
			attribute.String("rpc.method", "HandleMessageBatch"),
			attribute.String("messaging.system", "kafka"),
			attribute.String("messaging.destination.name", msg.GetTopic()),
			attribute.Int64("messaging.kafka.offset", msg.GetOffset()),
			attribute.Int("messaging.message.delivery_attempt", int(msg.GetAttempt())),
		),
	}
	if callSpan := trace.SpanContextFromContext(call); callSpan.IsValid() {
		options = append(options, trace.WithLinks(trace.Link{SpanContext: callSpan}))
	}
	return otel.Tracer(tracerName).Start(parent,
		cpv1.MessageHandler_ServiceDesc.ServiceName+"/HandleMessageBatch", options...)
}
