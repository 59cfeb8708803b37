"""consumer-proxy: a Kafka consumer push proxy.

Services implement one gRPC handler; the proxy consumes Kafka, pushes every message to a
healthy instance in parallel, tracks acks out of order and commits only the contiguous done
prefix. See README.md and protos/consumerproxy/v1/handler.proto.
"""

__version__ = "0.1.0"
