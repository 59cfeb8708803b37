"""Generated from protos/consumerproxy/v1 (do not edit)."""
