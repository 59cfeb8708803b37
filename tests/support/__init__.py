"""Test harness: the real local Kafka broker, Kafka helpers and polling waits."""
