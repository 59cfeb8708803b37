"""The package's exceptions: one base class, and whether a failure is worth retrying."""

from __future__ import annotations


class ConsumerProxyError(Exception):
    """Base of every error raised by consumer-proxy."""

    retriable: bool = False


class ConfigError(ConsumerProxyError):
    """The onboarding configuration is invalid; ``problems`` holds one line per problem.

    Each line names the file, the field path and what is wrong, so the CLI can print them and
    exit 2 before anything connects.
    """

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


class KafkaUnavailableError(ConsumerProxyError):
    """Kafka could not be reached or refused an operation that may succeed later."""

    retriable = True


class TopicSetupError(ConsumerProxyError):
    """A DLQ or redrive topic is missing and could not be created."""


class DeadLetterWriteError(ConsumerProxyError):
    """A DLQ write was not confirmed; the message stays pending and the write is retried.

    ``reason`` is a short category (``record_too_large``, ``topic_authorization``,
    ``unknown_topic``, ``timed_out``, ``queue_full``, ``fatal``, ``other``).
    """

    retriable = True

    def __init__(self, message: str, *, reason: str = "other") -> None:
        super().__init__(message)
        self.reason = reason
