"""Onboarding configuration: pydantic models, the YAML loader and offline validation.

One YAML file, or a directory of them (one per service, each adding ``groups``), is validated
once at start-up and passed down. Environment variables override the files through
pydantic-settings: ``CONSUMER_PROXY_`` prefix, ``__`` between nested names, e.g.
``CONSUMER_PROXY_KAFKA__BOOTSTRAP_SERVERS=broker:9092``. Every duration name carries its unit.
"""

from __future__ import annotations

import difflib
import importlib.util
import logging
import os
import re
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import grpc
import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict
from pydantic_settings.exceptions import SettingsError

from .core.ordering import Ordering
from .errors import ConfigError

OutcomeName = Literal["ack", "retry", "dead_letter", "drop", "outage"]
STATUS_NAMES = frozenset(code.name for code in grpc.StatusCode)
_TOPIC_RE = re.compile(r"^[A-Za-z0-9._-]{1,249}$")
_HOSTPORT_RE = re.compile(r"^(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(?P<port>\d{1,5})$")
_FROZEN = ConfigDict(frozen=True, extra="forbid")


ENV_PREFIX = "CONSUMER_PROXY_"
# librdkafka properties the proxy sets itself; kafka.client may not override them (the Helm
# chart's render-time check is generated from this set too: scripts/gen_values_schema.py).
PROXY_OWNED_CLIENT_PROPERTIES = frozenset(
    {"group.id", "enable.auto.commit", "bootstrap.servers", "partition.assignment.strategy"}
)


class FieldProblem(ValueError):
    """A problem a model validator found with one field below it.

    Raised instead of a plain ValueError so the error line names the exact field (``path``,
    relative to the model that raised it) rather than the whole enclosing model. ``also`` is
    the index of another group the problem refers to (a duplicate name), so the line can say
    which file that group came from.
    """

    def __init__(
        self, path: tuple[str | int, ...], message: str, *, also: int | None = None
    ) -> None:
        super().__init__(message)
        self.path = path
        self.also = also


def _check_topic(name: str) -> str:
    if not _TOPIC_RE.match(name) or name in {".", ".."}:
        raise ValueError(
            f"{name!r} is not a valid Kafka topic name (1-249 of letters, digits, '.', '_', '-')"
        )
    return name


def check_endpoint(target: str) -> str:
    """Accept ``host:port``, ``dns:///host:port``, ``ipv4:``/``ipv6:`` lists and ``unix:`` paths."""
    if target.startswith(("dns:", "ipv4:", "ipv6:", "unix:", "unix-abstract:")):
        scheme, _, rest = target.partition(":")
        if not rest.strip("/"):
            raise ValueError(f"{target!r} names the {scheme} scheme but no address")
        return target
    match = _HOSTPORT_RE.match(target)
    if not match or not 0 < int(match["port"]) < 65536:
        raise ValueError(
            f"{target!r} is not an endpoint; use host:port (port 1-65535) or dns:///host:port"
        )
    return target


def _check_status_name(name: str) -> str:
    if name == "OK":
        raise ValueError("OK cannot be overridden: it follows the response's action")
    if name not in STATUS_NAMES:
        known = ", ".join(sorted(STATUS_NAMES - {"OK"}))
        hint = f" (did you mean {name.upper()!r}?)" if name.upper() in STATUS_NAMES else ""
        raise ValueError(f"{name!r} is not a gRPC status code{hint}; use one of {known}")
    return name


StatusName = Annotated[str, AfterValidator(_check_status_name)]
"""A gRPC status code name other than OK, e.g. ``UNAVAILABLE``."""


def _check_file(path: Path | None) -> Path | None:
    # The files are read when the channels open; a missing one is better caught offline.
    if path is not None and not path.is_file():
        raise ValueError(
            f"{str(path)!r} is not a readable file (relative paths start from the "
            "working directory)"
        )
    return path


class BackoffConfig(BaseModel):
    """Exponential backoff with jitter between counted retries of one message."""

    model_config = _FROZEN
    initial_ms: int = Field(100, ge=1, le=3_600_000, description="First retry delay.")
    max_ms: int = Field(30_000, ge=1, le=86_400_000, description="Upper bound of a retry delay.")
    multiplier: float = Field(2.0, ge=1.0, le=10.0, description="Growth factor per attempt.")
    jitter: float = Field(
        0.2, ge=0.0, le=1.0, description="Fraction of each delay that is randomised."
    )

    @model_validator(mode="after")
    def _max_not_below_initial(self) -> BackoffConfig:
        if self.max_ms < self.initial_ms:
            raise ValueError(f"max_ms ({self.max_ms}) is below initial_ms ({self.initial_ms})")
        return self


class TlsConfig(BaseModel):
    """TLS to the service instances; a client certificate and key give mTLS."""

    model_config = _FROZEN
    ca_file: Path | None = Field(None, description="PEM CA bundle that signed the servers.")
    cert_file: Path | None = Field(None, description="PEM client certificate for mTLS.")
    key_file: Path | None = Field(None, description="PEM private key of cert_file.")
    server_name: str | None = Field(
        None, description="Name to verify in the server certificate, if not the endpoint host."
    )

    @field_validator("ca_file", "cert_file", "key_file")
    @classmethod
    def _files_exist(cls, value: Path | None) -> Path | None:
        return _check_file(value)

    @model_validator(mode="after")
    def _cert_and_key_together(self) -> TlsConfig:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file go together (both for mTLS, or neither)")
        return self


class ServiceConfig(BaseModel):
    """The service instances the group's messages are pushed to."""

    model_config = _FROZEN
    endpoints: list[Annotated[str, Field(min_length=1)]] = Field(
        ..., min_length=1, description="host:port of each instance, or one dns:/// target."
    )
    timeout_ms: int = Field(5000, ge=1, le=3_600_000, description="Deadline of one push call.")
    tls: TlsConfig | None = Field(None, description="TLS / mTLS settings; plaintext when absent.")

    @field_validator("endpoints")
    @classmethod
    def _endpoints_parse(cls, value: list[str]) -> list[str]:
        for target in value:
            check_endpoint(target)
        if len(set(value)) != len(value):
            raise ValueError("the same endpoint is listed twice")
        return value


class AdaptiveConfig(BaseModel):
    """Bounds of the adaptive concurrency limit (used with ``concurrency: adaptive``)."""

    model_config = _FROZEN
    min: int = Field(1, ge=1, le=100_000, description="Lowest concurrency the limit may reach.")
    max: int = Field(500, ge=1, le=100_000, description="Highest concurrency the limit may reach.")
    initial: int = Field(20, ge=1, le=100_000, description="Concurrency at start.")

    @model_validator(mode="after")
    def _ordered(self) -> AdaptiveConfig:
        if not self.min <= self.initial <= self.max:
            raise ValueError(
                f"need min <= initial <= max, got {self.min}, {self.initial}, {self.max}"
            )
        return self


class BatchConfig(BaseModel):
    """Batch push: several messages per ``HandleMessageBatch`` call (the throughput path)."""

    model_config = _FROZEN
    mode: Literal["always", "auto"] = Field(
        "always",
        description="always: every call is HandleMessageBatch (a service without it is an "
        "outage). auto: each instance is asked with its first call; batches where it serves "
        "HandleMessageBatch, unary calls where it answers UNIMPLEMENTED (asked again after "
        "its connection drops, and every minute).",
    )
    max_messages: int = Field(
        100, ge=1, le=10_000, description="Most messages in one HandleMessageBatch call."
    )
    max_bytes: int = Field(
        1024 * 1024,
        ge=1,
        le=64 * 1024 * 1024,
        description="Most message bytes (key, value, headers) in one call; a larger message "
        "goes alone in a batch of one.",
    )
    linger_ms: int = Field(
        0,
        ge=0,
        le=10_000,
        description="Wait this long for a batch to fill once a call slot is free (0: send "
        "what is ready at once; batches still grow while every call slot is busy).",
    )


class LongRunningConfig(BaseModel):
    """Long-running handlers: a streaming call kept alive by heartbeats, not a fixed deadline."""

    model_config = _FROZEN
    heartbeat_timeout_ms: int = Field(
        ...,
        ge=300,
        le=600_000,
        description="A call that sends no heartbeat (nor its result) for this long has failed, "
        "as a deadline would (charged to the message only while the service answers others). "
        "The service is asked to heartbeat every third of it.",
    )
    max_processing_ms: int = Field(
        ...,
        ge=1000,
        le=86_400_000,
        description="Hard cap on one call: reached, the call is cancelled (the service sees "
        "the cancellation) and counts as a failed attempt.",
    )

    @model_validator(mode="after")
    def _cap_above_timeout(self) -> LongRunningConfig:
        if self.max_processing_ms <= self.heartbeat_timeout_ms:
            raise ValueError(
                f"max_processing_ms ({self.max_processing_ms}) must be above "
                f"heartbeat_timeout_ms ({self.heartbeat_timeout_ms})"
            )
        return self


class RetryTopicConfig(BaseModel):
    """One retry tier: a topic where a failed message waits, durably, for its next attempt."""

    model_config = _FROZEN
    delay_ms: int = Field(
        ...,
        ge=1,
        le=7 * 24 * 3600 * 1000,
        description="How long a message waits in this tier before its next attempt "
        "(at least; longer when the handler's retry_after asks for more).",
    )


class DeliveryConfig(BaseModel):
    """How messages are delivered, retried and committed."""

    model_config = _FROZEN
    max_in_flight: int = Field(
        1000, ge=1, le=100_000, description="Per partition: offsets fetched and not committed."
    )
    max_in_flight_bytes: int = Field(
        64 * 1024 * 1024,
        ge=1024,
        description="Per group: bytes of fetched messages held in memory before intake pauses.",
    )
    concurrency: int | Literal["adaptive"] = Field(
        100, description="In-flight calls for the group (1-10000), or 'adaptive'."
    )
    adaptive: AdaptiveConfig = Field(
        default_factory=AdaptiveConfig, description="Bounds for concurrency: adaptive."
    )
    max_attempts: int = Field(
        5, ge=1, le=1000, description="Counted attempts before a message is dead-lettered."
    )
    backoff: BackoffConfig = Field(
        default_factory=BackoffConfig, description="Delay between counted retries."
    )
    rate_limit_per_s: float | None = Field(
        None,
        gt=0,
        description="Optional cap on messages pushed per second for the group "
        "(in batch mode every message of a call counts, not the call).",
    )
    status_overrides: dict[StatusName, OutcomeName] = Field(
        default_factory=dict,
        description="gRPC status name -> ack|retry|dead_letter|drop|outage (over the defaults).",
    )
    commit_interval_ms: int = Field(
        1000, ge=10, le=600_000, description="How often the done prefix is committed."
    )
    metadata_budget_bytes: int = Field(
        4000,
        ge=64,
        le=1_048_576,
        description="Size limit of the ack state stored in commit metadata "
        "(keep under the broker's offset.metadata.max.bytes, 4096 by default).",
    )
    revoke_grace_ms: int = Field(
        3000,
        ge=0,
        le=600_000,
        description="On partition revoke, wait this long for in-flight calls.",
    )
    fetch_batch: int = Field(
        500, ge=1, le=100_000, description="Messages taken from the consumer in one poll."
    )
    ordering: Ordering = Field(
        "none",
        description="none: any order, all in parallel. key: at most one message per key in "
        "flight, each key's messages in offset order (a retry or a pending DLQ write holds "
        "back only its key; messages without a key are ordered among themselves per "
        "partition). partition: one message per partition in flight, in offset order.",
    )
    batch: BatchConfig | None = Field(
        default_factory=lambda: BatchConfig(mode="auto"),
        description="'auto' (the default: batches to the instances that serve "
        "HandleMessageBatch, unary calls to the others), 'off' (unary calls only), or a "
        "section: written without mode (even {}) it means batches always. Concurrency then "
        "counts calls, max_in_flight still messages.",
    )
    long_running: LongRunningConfig | None = Field(
        None,
        description="Push through the streaming HandleMessageStream call, kept alive by the "
        "service's heartbeats instead of service.timeout_ms (handlers that run for minutes); "
        "absent: unary HandleMessage.",
    )
    retry_topics: list[RetryTopicConfig] = Field(
        default_factory=list,
        max_length=20,
        description="Retry tiers, in order: a message that failed its in-memory attempts is "
        "written to '<group>.retry.<n>' and retried from there after the tier's delay, so "
        "its source offset is done at once (empty: retries wait in memory only).",
    )
    in_memory_attempts: int = Field(
        1,
        ge=1,
        le=1000,
        description="With retry_topics: attempts made from memory (with backoff) before a "
        "message moves to the first retry tier.",
    )
    head_block_ms: int | None = Field(
        None,
        ge=100,
        le=86_400_000,
        description="With retry_topics: when a partition's committable offset has not moved "
        "for this long while offsets above it are done, its blocking message moves to the next "
        "retry tier (its call is abandoned and counts as a failed attempt); absent: off.",
    )
    max_unblock_per_minute: int = Field(
        10,
        ge=1,
        le=100_000,
        description="At most this many head-of-line moves per partition in any minute.",
    )

    @model_serializer(mode="wrap")
    def _batch_off_written(self, handler: SerializerFunctionWrapHandler) -> Any:
        # batch None is "off", and absent is "auto": a dump (even with exclude_none) says off.
        data = handler(self)
        if self.batch is None and isinstance(data, dict):
            data["batch"] = "off"
        return data

    @model_validator(mode="before")
    @classmethod
    def _long_running_streams(cls, data: Any) -> Any:
        # A long-running group pushes one message per streaming call: batch's default (auto)
        # means off for it. A batch section written out is refused (GroupConfig says why).
        if isinstance(data, Mapping) and data.get("long_running") is not None:
            batch = data.get("batch", "auto")
            mode = batch.get("mode") if isinstance(batch, Mapping) else batch
            if mode == "auto" or (isinstance(batch, BatchConfig) and batch.mode == "auto"):
                return {**data, "batch": None}
        return data

    @field_validator("batch", mode="before")
    @classmethod
    def _batch_forms(cls, value: Any) -> Any:
        # "off" is YAML 1.1's false: PyYAML reads `batch: off` as False.
        if value is None or value is False or value == "off":
            return None
        if value == "auto":
            return BatchConfig(mode="auto")
        if value == "always":
            return BatchConfig()
        if isinstance(value, str | bool):
            # ValueError, not TypeError: pydantic reports only the former as a bad value.
            raise ValueError(  # noqa: TRY004
                "must be 'auto', 'off', or a section (mode, max_messages, ...)"
            )
        return value

    @field_validator("concurrency", mode="before")
    @classmethod
    def _concurrency_range(cls, value: Any) -> Any:
        # Checked before the union so a bad value gives one line, not one per union member.
        if value == "adaptive":
            return value
        if isinstance(value, str) and value.strip().isdigit():
            value = int(value)  # environment overrides arrive as text
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 10_000:
            raise ValueError("must be a whole number of calls from 1 to 10000, or 'adaptive'")
        return value


class DlqConfig(BaseModel):
    """The group's dead-letter topic and the redrive topic that merges it back."""

    model_config = _FROZEN
    topic: str | None = Field(None, description="DLQ topic; '<group>.dlq' when absent.")
    redrive_topic: str | None = Field(
        None, description="Topic 'dlq merge' writes to and the proxy consumes; '<group>.redrive'."
    )
    create: bool = Field(True, description="Create missing DLQ and redrive topics at start.")
    partitions: int | None = Field(
        None, ge=1, le=10_000, description="Partitions of a created DLQ topic; the source's count."
    )
    redrive_partitions: int = Field(
        1,
        ge=1,
        le=10_000,
        description="Partitions of a created redrive topic. One by default: the group's "
        "consumers balance partitions across all their topics, so a redrive topic as wide as "
        "the source could leave a worker holding only idle redrive partitions.",
    )
    replication_factor: int | None = Field(
        None, ge=1, le=32, description="Replication of created topics; the broker default."
    )
    write_timeout_ms: int = Field(
        30_000, ge=100, le=3_600_000, description="One DLQ write attempt's limit before a retry."
    )

    @field_validator("topic", "redrive_topic")
    @classmethod
    def _topic_ok(cls, value: str | None) -> str | None:
        return None if value is None else _check_topic(value)


class CircuitBreakerConfig(BaseModel):
    """Stops pushing while the service is down, so an outage never dead-letters."""

    model_config = _FROZEN
    failure_threshold: int = Field(
        20, ge=1, le=100_000, description="Consecutive service-level failures that open it."
    )
    reset_timeout_s: float = Field(
        10.0, gt=0, le=3600, description="Time open before a half-open probe."
    )


class DeadLetterGuardConfig(BaseModel):
    """Holds dead letters instead of writing them when they are most of what finishes: a bad
    deploy that rejects every message must not flood the DLQ."""

    model_config = _FROZEN
    enabled: bool = Field(True, description="Hold dead letters when their ratio trips the guard.")
    max_ratio: float = Field(
        0.5,
        gt=0,
        le=1,
        description="Trips when dead-letter decisions exceed this share of the group's last "
        "min_messages finished messages (acked, dropped, dead-lettered).",
    )
    window_ms: int = Field(
        60_000,
        ge=1000,
        le=86_400_000,
        description="Only messages finished within this long count: a slow trickle of poison "
        "in an idle group never adds up to a trip.",
    )
    min_messages: int = Field(
        100,
        ge=1,
        le=100_000,
        description="How many of the latest finished messages the ratio is taken over; about "
        "this many dead letters are written before a bad deploy trips the guard.",
    )
    probe_interval_ms: int = Field(
        10_000,
        ge=100,
        le=3_600_000,
        description="While held, one held message is retried this often; its ack releases the "
        "guard (the service was fixed or rolled back).",
    )


class GroupConfig(BaseModel):
    """One onboarded service: a Kafka consumer group pushing to one gRPC service."""

    model_config = _FROZEN
    name: str = Field(..., min_length=1, max_length=200, description="Kafka consumer group id.")
    topics: list[str] = Field(..., min_length=1, description="Source topics of the group.")
    service: ServiceConfig = Field(..., description="Where messages are pushed.")
    delivery: DeliveryConfig = Field(default_factory=DeliveryConfig, description="Delivery knobs.")
    dlq: DlqConfig = Field(default_factory=DlqConfig, description="Dead letters and redrive.")
    circuit_breaker: CircuitBreakerConfig = Field(
        default_factory=CircuitBreakerConfig, description="Outage protection."
    )
    dead_letter_guard: DeadLetterGuardConfig = Field(
        default_factory=DeadLetterGuardConfig, description="Protection against DLQ floods."
    )

    @field_validator("name")
    @classmethod
    def _name_chars(cls, value: str) -> str:
        # The group name prefixes the default DLQ and redrive topic names.
        if not _TOPIC_RE.match(value + ".redrive") or value in {".", ".."}:
            raise ValueError(
                "a group name may use letters, digits, '.', '_' and '-' only: it names "
                "the default '<group>.dlq' and '<group>.redrive' topics"
            )
        return value

    @field_validator("topics")
    @classmethod
    def _topics_ok(cls, value: list[str]) -> list[str]:
        for topic in value:
            _check_topic(topic)
        if len(set(value)) != len(value):
            raise ValueError("a topic is listed twice")
        return value

    @model_validator(mode="after")
    def _dlq_not_a_source(self) -> GroupConfig:
        for label, topic in (
            ("dlq.topic", self.dlq_topic),
            ("dlq.redrive_topic", self.redrive_topic),
        ):
            if topic in self.topics:
                field = label.split(".")[1]
                given = getattr(self.dlq, field) is not None
                raise FieldProblem(
                    ("dlq", field),
                    f"{topic!r}{'' if given else ' (the default)'} is also a source topic of "
                    f"the group; the {label} must be a topic of its own",
                )
        if self.delivery.retry_topics and self.delivery.ordering != "none":
            raise FieldProblem(
                ("delivery", "retry_topics"),
                "retry tiers need ordering none: a message waiting in a tier would let the "
                f"later messages of its key go first (ordering is {self.delivery.ordering!r})",
            )
        long_running = self.delivery.long_running
        if long_running is not None and self.delivery.batch is not None:
            raise FieldProblem(
                ("delivery", "long_running"),
                "long-running calls push one message per streaming call: they cannot be "
                "combined with delivery.batch",
            )
        if (
            long_running is not None
            and self.delivery.revoke_grace_ms >= long_running.max_processing_ms
        ):
            raise FieldProblem(
                ("delivery", "revoke_grace_ms"),
                f"{self.delivery.revoke_grace_ms} ms is not below long_running."
                f"max_processing_ms ({long_running.max_processing_ms} ms): a revoke would wait "
                "out whole long calls and hold the group's rebalance that long; open calls are "
                "cancelled after the grace and delivered by the new owner",
            )
        if self.delivery.head_block_ms is not None and not self.delivery.retry_topics:
            raise FieldProblem(
                ("delivery", "head_block_ms"),
                "head-of-line unblocking moves a message to a retry tier: it needs "
                "delivery.retry_topics",
            )
        head_block_ms = self.delivery.head_block_ms
        if (
            long_running is not None
            and head_block_ms is not None
            and head_block_ms <= long_running.max_processing_ms
        ):
            raise FieldProblem(
                ("delivery", "head_block_ms"),
                f"{head_block_ms} ms is not above long_running.max_processing_ms "
                f"({long_running.max_processing_ms} ms): a long call still heartbeating would be "
                "moved aside as a failed attempt, and pushed again from a tier while it runs",
            )
        for topic in self.retry_topics:
            if topic in self.topics:
                raise FieldProblem(
                    ("delivery", "retry_topics"),
                    f"{topic!r} (a retry tier) is also a source topic of the group",
                )
        if self.dlq_topic == self.redrive_topic:
            raise FieldProblem(
                ("dlq", "redrive_topic"),
                f"{self.redrive_topic!r} is also the DLQ topic; dlq.topic and "
                "dlq.redrive_topic must differ",
            )
        # The group consumes its retry tiers: a DLQ or redrive topic among them would be read
        # back as tier records (dead letters retried forever, none kept).
        for label, topic in (
            ("dlq.topic", self.dlq_topic),
            ("dlq.redrive_topic", self.redrive_topic),
        ):
            if topic in self.retry_topics:
                field = label.split(".")[1]
                raise FieldProblem(
                    ("dlq", field),
                    f"{topic!r} is also a retry tier of the group (delivery.retry_topics "
                    f"writes <group>.retry.<n>); the {label} must be a topic of its own",
                )
        return self

    @property
    def dlq_topic(self) -> str:
        """The DLQ topic, defaulting to ``<group>.dlq``."""
        return self.dlq.topic or f"{self.name}.dlq"

    @property
    def redrive_topic(self) -> str:
        """The redrive topic, defaulting to ``<group>.redrive``."""
        return self.dlq.redrive_topic or f"{self.name}.redrive"

    @property
    def retry_topics(self) -> list[str]:
        """The retry tier topics, ``<group>.retry.<n>`` (n = 1, 2, ... in config order)."""
        return [f"{self.name}.retry.{n}" for n in range(1, len(self.delivery.retry_topics) + 1)]


class KafkaConfig(BaseModel):
    """The Kafka cluster and librdkafka properties passed through to every client."""

    model_config = _FROZEN
    bootstrap_servers: str = Field(..., min_length=1, description="host:port[,host:port...].")
    client: dict[str, str | int | float | bool] = Field(
        default_factory=dict,
        description="librdkafka properties (security.protocol, sasl.*, ssl.*) for all clients.",
    )

    @field_validator("bootstrap_servers")
    @classmethod
    def _servers_parse(cls, value: str) -> str:
        for server in value.split(","):
            server = server.strip()
            server = server.split("://", 1)[-1]
            match = _HOSTPORT_RE.match(server)
            if not match or not 0 < int(match["port"]) < 65536:
                raise ValueError(
                    f"{server!r} is not host:port; use host:port[,host:port...] (port 1-65535)"
                )
        return value

    @field_validator("client", mode="before")
    @classmethod
    def _scalar_properties(cls, value: Any) -> Any:
        # Checked before the union of value types so one bad property gives one clear line.
        if not isinstance(value, Mapping):
            return value  # the type check reports it
        for key, item in value.items():
            if not isinstance(item, str | int | float | bool):
                # ValueError, not TypeError: pydantic turns only ValueError into a problem line.
                raise ValueError(  # noqa: TRY004
                    f"property {key!r} must be a string, number or boolean (librdkafka "
                    f"properties are flat: write 'sasl.mechanism: PLAIN', not nested maps), "
                    f"got {type(item).__name__}"
                )
        return value

    @field_validator("client")
    @classmethod
    def _not_owned_by_proxy(cls, value: dict[str, Any]) -> dict[str, Any]:
        clash = sorted(PROXY_OWNED_CLIENT_PROPERTIES & set(value))
        if clash:
            raise ValueError(f"{', '.join(clash)} are set by the proxy and cannot be overridden")
        _librdkafka_accepts(value)
        return value


def _librdkafka_accepts(client: Mapping[str, Any]) -> None:
    """ValueError with librdkafka's reason when it refuses a property or its value.

    A client with no bootstrap.servers never connects: building one only parses the
    properties (names, enums, numbers), as every client the proxy and its tools build will.
    Built as plaintext, so that files named by ssl.* are not read here (they may exist only
    where the proxy runs); security.protocol itself is checked by name.
    """
    from confluent_kafka import Consumer, KafkaException

    protocol = str(client.get("security.protocol", "plaintext")).lower()
    if protocol not in {"plaintext", "ssl", "sasl_plaintext", "sasl_ssl"}:
        raise ValueError(
            f"security.protocol {protocol!r} is not one of plaintext, ssl, sasl_plaintext, sasl_ssl"
        )
    conf: dict[str, Any] = {
        **client,
        "security.protocol": "plaintext",
        "group.id": "consumer-proxy-validate",
        "log_level": 0,
    }
    try:
        Consumer(conf, logger=logging.getLogger("consumer_proxy.validate")).close()
    except KafkaException as exc:
        reason = exc.args[0].str() if exc.args and hasattr(exc.args[0], "str") else str(exc)
        raise ValueError(f"librdkafka refuses it: {reason}") from None


class MetricsConfig(BaseModel):
    """The HTTP endpoint serving /metrics, /healthz and /readyz."""

    model_config = _FROZEN
    enabled: bool = Field(True, description="Serve metrics and health over HTTP.")
    host: str = Field(
        "0.0.0.0",
        description="Address to bind: 0.0.0.0 is every interface (Prometheus and the kubelet's "
        "probes reach the pod's IP); 127.0.0.1 only this host, e.g. behind a local agent or "
        "sidecar that scrapes it.",
    )
    port: int = Field(9464, ge=0, le=65535, description="Port to bind (0: any free port).")
    max_connections: int = Field(
        64,
        ge=1,
        le=10_000,
        description="HTTP connections served at once; one more is closed as soon as it is "
        "accepted (while the cap is reached, a probe fails too).",
    )
    request_timeout_ms: int = Field(
        5000,
        ge=100,
        le=600_000,
        description="Limit on one whole HTTP exchange, from the connection to the last byte of "
        "the answer; a slower client is disconnected.",
    )


class AdminConfig(BaseModel):
    """Operator actions on a running proxy (``consumer-proxy guard release|hold``), served on
    the HTTP endpoint under /admin/. Off unless a token is configured."""

    model_config = _FROZEN
    token: SecretStr | None = Field(
        None,
        min_length=16,
        description="Bearer token every admin request must carry (16 characters or more); "
        "absent: admin requests are refused. Set it through the environment "
        "(CONSUMER_PROXY_ADMIN__TOKEN, from a Kubernetes Secret), not in a file teams share.",
    )


class ConsoleConfig(BaseModel):
    """The operator console: a web page of the proxy's groups and their dead letters, served
    on the HTTP endpoint (metrics.host/metrics.port) under /console/. Read-only unless
    admin.token is set; its merge and purge run the DLQ commands with that token."""

    model_config = _FROZEN
    enabled: bool = Field(
        False, description="Serve the console at /console/ on the HTTP endpoint (needs metrics)."
    )
    dlq_scan_records: int = Field(
        2000,
        ge=10,
        le=50_000,
        description="Most DLQ records one page view of the dead letters reads (the newest, or "
        "from --since on); counts cover these only, the full report is `dlq report`.",
    )


class HealthConfig(BaseModel):
    """The proxy's own grpc.health.v1 service."""

    model_config = _FROZEN
    grpc_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="Serve grpc.health.v1 on this port (0: any free port; absent: off).",
    )
    host: str = Field("0.0.0.0", min_length=1, description="Address the health service binds.")


class TracingConfig(BaseModel):
    """OpenTelemetry tracing of each message (off by default; the ``tracing`` extra). The
    standard ``OTEL_*`` variables apply where a field here is absent:
    ``OTEL_EXPORTER_OTLP_ENDPOINT``, ``OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL``,
    ``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_TRACES_SAMPLER[_ARG]``;
    ``OTEL_SDK_DISABLED=true`` turns tracing off."""

    model_config = _FROZEN
    enabled: bool = Field(
        False, description="Trace each message (a span per message, per attempt, per write)."
    )
    endpoint: str | None = Field(
        None,
        min_length=1,
        max_length=2048,
        description="OTLP endpoint (gRPC: http://host:4317; HTTP: http://host:4318); absent: "
        "OTEL_EXPORTER_OTLP_ENDPOINT, else the exporter's default on localhost.",
    )
    protocol: Literal["grpc", "http/protobuf"] | None = Field(
        None,
        description="OTLP transport; absent: OTEL_EXPORTER_OTLP_TRACES_PROTOCOL or "
        "OTEL_EXPORTER_OTLP_PROTOCOL, else grpc.",
    )
    service_name: str | None = Field(
        None,
        min_length=1,
        max_length=200,
        description="service.name of the proxy's spans; absent: OTEL_SERVICE_NAME, else "
        "consumer-proxy.",
    )
    sample_ratio: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        description="Share of new traces recorded (parent-based: a record whose producer "
        "sampled it is traced, one it did not is not); absent: OTEL_TRACES_SAMPLER[_ARG], "
        "else every trace.",
    )
    link_producer: bool = Field(
        False,
        description="The process span is a new root linked to the record's trace context, "
        "instead of its child.",
    )
    batch_sampling: Literal["call", "message"] = Field(
        "call",
        description="Batch mode, messages that start a trace: call: sampled a call at a "
        "time (a call drawn in traces them all, its span links each; the share traced is "
        "still the ratio, and an unsampled call costs no span); message: each on its own "
        "(most calls then carry a sampled message and make a span).",
    )
    max_queue_size: int = Field(
        2048,
        ge=1,
        le=1_000_000,
        description="Finished spans waiting for export; more are dropped, never waited for.",
    )
    export_interval_ms: int = Field(
        1000, ge=10, le=600_000, description="How often queued spans are exported."
    )
    export_timeout_ms: int = Field(
        10_000, ge=100, le=600_000, description="Limit on one export call."
    )

    @field_validator("endpoint")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError("an OTLP endpoint is a URL: http://host:port or https://host:port")
        return value

    @field_validator("enabled")
    @classmethod
    def _installed(cls, value: bool) -> bool:
        # (find_spec imports the parent package, opentelemetry, only when tracing is on)
        if value and importlib.util.find_spec("opentelemetry.sdk") is None:
            raise ValueError(
                "tracing needs the OpenTelemetry SDK: pip install 'consumer-proxy[tracing]'"
            )
        return value


REVOKE_MARGIN_MS = 30_000
"""Room left in max.poll.interval.ms after the revoke grace (the final commit, the callback)."""


class ProxyConfig(BaseSettings):
    """The whole onboarding configuration of one proxy deployment."""

    model_config = SettingsConfigDict(
        frozen=True,
        extra="forbid",
        env_prefix="CONSUMER_PROXY_",
        env_nested_delimiter="__",
        nested_model_default_partial_update=True,
    )
    kafka: KafkaConfig = Field(..., description="The Kafka cluster.")
    metrics: MetricsConfig = Field(default_factory=MetricsConfig, description="HTTP endpoint.")
    health: HealthConfig = Field(default_factory=HealthConfig, description="gRPC health.")
    admin: AdminConfig = Field(default_factory=AdminConfig, description="Operator actions.")
    tracing: TracingConfig = Field(
        default_factory=TracingConfig, description="OpenTelemetry tracing (off by default)."
    )
    console: ConsoleConfig = Field(
        default_factory=ConsoleConfig, description="The operator console (a web page)."
    )
    groups: list[GroupConfig] = Field(..., min_length=1, description="The onboarded services.")
    shutdown_grace_s: float = Field(
        25.0, ge=0, le=3600, description="On SIGTERM, time to drain in-flight calls."
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Environment first: it overrides what the YAML files (passed as init values) say.
        return (env_settings, init_settings)

    @model_validator(mode="after")
    def _unique_groups(self) -> ProxyConfig:
        seen: dict[str, int] = {}
        for index, group in enumerate(self.groups):
            if group.name in seen:
                first = seen[group.name]
                raise FieldProblem(
                    ("groups", index, "name"),
                    f"group name {group.name!r} is already used by groups.{first}; "
                    "each group needs a name of its own",
                    also=first,
                )
            seen[group.name] = index
        return self

    @model_validator(mode="after")
    def _topics_of_one_group(self) -> ProxyConfig:
        # A group's redrive topic and retry tiers are consumed by that group alone (the DLQ
        # tools merge into and count them per group), and its DLQ topic is its own: merge and
        # purge act on the whole topic. Source topics may be shared (each group reads all).
        owner: dict[str, tuple[int, str]] = {}
        for index, group in enumerate(self.groups):
            roles = [("dlq.topic", group.dlq_topic), ("dlq.redrive_topic", group.redrive_topic)]
            roles += [("delivery.retry_topics", t) for t in group.retry_topics]
            for label, topic in roles:
                if topic in owner:
                    first, role = owner[topic]
                    raise FieldProblem(
                        ("groups", index, *label.split(".")),
                        f"{topic!r} is already the {role} of groups.{first}; each group's "
                        "DLQ, redrive and retry topics must be its own",
                        also=first,
                    )
                owner[topic] = (index, label)
        for index, group in enumerate(self.groups):
            for topic in group.topics:
                first, role = owner.get(topic, (index, ""))
                if first != index and role != "dlq.topic":
                    raise FieldProblem(
                        ("groups", index, "topics"),
                        f"{topic!r} is the {role} of groups.{first}, which only that group "
                        "consumes",
                        also=first,
                    )
        return self

    @model_validator(mode="after")
    def _ports_differ(self) -> ProxyConfig:
        port = self.health.grpc_port
        if port and self.metrics.enabled and port == self.metrics.port:
            raise FieldProblem(
                ("health", "grpc_port"),
                f"port {port} is also metrics.port; the gRPC health service needs its own port",
            )
        return self

    @model_validator(mode="after")
    def _console_needs_http(self) -> ProxyConfig:
        if self.console.enabled and not self.metrics.enabled:
            raise FieldProblem(
                ("console", "enabled"),
                "the console is served on the HTTP endpoint, which metrics.enabled: false "
                "turns off; enable metrics or disable the console",
            )
        return self

    @model_validator(mode="after")
    def _grace_within_poll_interval(self) -> ProxyConfig:
        # The revoke callback runs inside the consumer's poll: waiting longer than
        # max.poll.interval.ms would get this member thrown out of the group mid-revoke.
        poll_ms = int(self.kafka.client.get("max.poll.interval.ms", 300_000))
        # The consumers are not polled while the calls drain at shutdown: past the poll
        # interval librdkafka leaves the group, and the drain's acks cannot be committed.
        if self.shutdown_grace_s * 1000 + REVOKE_MARGIN_MS > poll_ms:
            raise FieldProblem(
                ("shutdown_grace_s",),
                f"{self.shutdown_grace_s:g} s leaves less than {REVOKE_MARGIN_MS} ms of "
                f"kafka.client max.poll.interval.ms ({poll_ms} ms): the consumers are not "
                "polled while the calls drain, and past it they leave the group before the "
                "drain's acks are committed; lower it or raise max.poll.interval.ms",
            )
        for index, group in enumerate(self.groups):
            grace = group.delivery.revoke_grace_ms
            if grace + REVOKE_MARGIN_MS > poll_ms:
                raise FieldProblem(
                    ("groups", index, "delivery", "revoke_grace_ms"),
                    f"{grace} ms leaves less than {REVOKE_MARGIN_MS} ms of kafka.client "
                    f"max.poll.interval.ms ({poll_ms} ms): the revoke wait runs inside the "
                    "consumer's poll; lower it or raise max.poll.interval.ms",
                )
        return self

    def group(self, name: str) -> GroupConfig:
        """The group called ``name``; ConfigError naming the known ones otherwise."""
        for group in self.groups:
            if group.name == name:
                return group
        known = ", ".join(g.name for g in self.groups)
        raise ConfigError([f"unknown group {name!r}; configured groups: {known}"])


MAX_FILE_BYTES = 1024 * 1024
"""Largest onboarding file read (an onboarding file is a few KiB)."""
MAX_NESTING = 32
"""Deepest nesting of mappings and lists in an onboarding file (the models need 6)."""
MAX_NODES = 20_000
"""Most YAML nodes (scalars, lists, mappings) in one onboarding file: a group takes 10-40, and
the pure-Python parser builds about 50,000 a second, at ~0.8 KiB of memory each."""


class _Refused(yaml.composer.ComposerError):
    """YAML the loader refuses although it is well-formed: an anchor or alias, deep nesting."""


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects a key given twice in one mapping (plain YAML keeps the last),
    anchors and aliases, and nesting deeper than ``MAX_NESTING``.

    Aliases are refused because each one copies a whole subtree when the document is built
    and validated: seven levels of ten aliases in 500 bytes cost seconds and gigabytes, and a
    team's file in a shared ``conf.d/`` could keep the proxy from starting. Depth is bounded
    because the composer, the constructor and the validators all recurse: 5,000 nested
    brackets raised RecursionError instead of a config error.
    """

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0
        self._nodes = 0

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        event: Any = self.peek_event()  # type: ignore[no-untyped-call]
        mark = event.start_mark
        # Refused at the anchor already (every alias needs one before it): the error then
        # points at the first line the author has to change.
        anchor = getattr(event, "anchor", None)  # an AliasEvent's is the name it refers to
        if anchor is not None:
            sign = "alias *" if isinstance(event, yaml.AliasEvent) else "anchor &"
            raise _Refused(
                None,
                None,
                f"{sign}{anchor} is not allowed in onboarding files (anchors and aliases "
                "can expand a small file beyond memory); write the value out",
                mark,
            )
        self._nodes += 1
        if self._nodes > MAX_NODES:
            raise _Refused(
                None,
                None,
                f"more than {MAX_NODES} values (scalars, lists and mappings) in one file; "
                "split it, one file per service",
                mark,
            )
        if not isinstance(event, yaml.SequenceStartEvent | yaml.MappingStartEvent):
            return super().compose_node(parent, index)
        if self._depth >= MAX_NESTING:
            raise _Refused(
                None,
                None,
                f"nested deeper than {MAX_NESTING} levels of mappings and lists",
                mark,
            )
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        try:
            first = seen.setdefault(key, key_node.start_mark.line)
        except TypeError:
            continue  # an unhashable key: construct_mapping reports it
        if first != key_node.start_mark.line:
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping",
                node.start_mark,
                f"key {key!r} is given twice (first on line {first + 1})",
                key_node.start_mark,
            )
    return loader.construct_mapping(node, deep=True)


_StrictLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
    _construct_mapping,
)


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as file:
            raw = file.read(MAX_FILE_BYTES + 1)  # never more: the path may be a pipe or huge
        if len(raw) > MAX_FILE_BYTES:
            raise ConfigError(
                [
                    f"{path}: larger than {MAX_FILE_BYTES} bytes (1 MiB); an onboarding file "
                    "is a few KiB: split it, one file per service"
                ]
            )
        text = raw.decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise ConfigError([f"{path}: cannot read: {reason or exc}"]) from exc
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # a SafeLoader subclass: no arbitrary objects
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        if isinstance(exc, _Refused):
            kind = "refused"
        elif isinstance(exc, yaml.constructor.ConstructorError):
            kind = "YAML error"
        else:
            kind = "YAML syntax error"
        raise ConfigError([f"{path}: {where}{kind}: {problem}"]) from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            [f"{path}: (top level): must be a mapping of settings, got {type(data).__name__}"]
        )
    return data


def _collect(path: Path) -> tuple[dict[str, Any], dict[str, Path], list[Path]]:
    """Merge one file or a directory of files; remember which file each part came from."""
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in {".yaml", ".yml"} and p.is_file())
        if not files:
            raise ConfigError([f"{path}: no .yaml or .yml files in this directory"])
    elif path.exists():
        files = [path]
    else:
        raise ConfigError([f"{path}: no such file or directory"])
    merged: dict[str, Any] = {}
    origin: dict[str, Path] = {}
    group_files: list[Path] = []
    problems: list[str] = []
    for file in files:
        try:
            data = _read_yaml(file)
        except ConfigError as exc:
            problems += exc.problems  # report every broken file, not just the first
            continue
        for key, value in data.items():
            if key == "groups":
                if not isinstance(value, list):
                    problems.append(
                        f"{file}: groups: must be a list of groups (each item starts with "
                        f"'- name: ...'), got {type(value).__name__}"
                    )
                    continue
                merged.setdefault("groups", []).extend(value)
                group_files.extend([file] * len(value))
            elif key in merged:
                problems.append(
                    f"{file}: {key}: already set in {origin[key]}; set each top-level "
                    "section in one file only"
                )
            else:
                merged[key] = value
                origin[key] = file
    if problems:
        raise ConfigError(problems)
    return merged, origin, group_files


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model inside an annotation such as ``list[GroupConfig]`` or ``X | None``."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType, list, typing.Annotated):
        for arg in typing.get_args(annotation):
            found = _model_in(arg)
            if found is not None:
                return found
    return None


def _model_at(loc: Sequence[str | int]) -> type[BaseModel] | None:
    """The model that a field path points into (list indexes skipped)."""
    model: type[BaseModel] | None = ProxyConfig
    for part in loc:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part) if model is not None else None
        if field is None:
            return None
        model = _model_in(field.annotation)
    return model


def _env_var(loc: Sequence[str | int]) -> str | None:
    """The environment variable that set the value at ``loc``, if one did."""
    present = {name.upper(): name for name in os.environ if name.upper().startswith(ENV_PREFIX)}
    for end in range(len(loc), 0, -1):
        head = loc[:end]
        if any(isinstance(part, int) for part in head):
            continue  # list items cannot be set one by one from the environment
        wanted = ENV_PREFIX + "__".join(str(part) for part in head).upper()
        if wanted in present:
            return present[wanted]
    return None


def _format_error(
    err: Any, path: Path, origin: dict[str, Path], group_files: list[Path], data: dict[str, Any]
) -> str:
    """One line: where (file, or the environment variable), the field path, what is wrong."""
    loc: list[str | int] = list(err["loc"])
    cause = (err.get("ctx") or {}).get("error")
    if isinstance(cause, FieldProblem):
        loc += list(cause.path)
    if loc and loc[-1] == "[key]":
        loc.pop()  # a bad mapping key: the path already ends with the key itself
    file = path
    index: int | None = None
    if len(loc) > 1 and loc[0] == "groups" and isinstance(loc[1], int):
        index = loc[1]
        if index < len(group_files):
            file = group_files[index]
    elif loc and isinstance(loc[0], str) and loc[0] in origin:
        file = origin[loc[0]]
    where = str(file)
    var = _env_var(loc)
    if var is not None:
        where = f"environment variable {var}"
    parts: list[str] = []
    groups = data.get("groups") if isinstance(data.get("groups"), list) else []
    for i, part in enumerate(loc):
        text = str(part)
        if i == 1 and index is not None and index < len(groups or []):
            item = (groups or [])[index]
            name = item.get("name") if isinstance(item, dict) else None
            if isinstance(name, str) and name:
                text = f"{index}({name})"
        parts.append(text)
    field = ".".join(parts) or "(top level)"
    message = str(err["msg"]).removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        model = _model_at(loc[:-1])
        message = "unknown field"
        if model is not None:
            allowed = list(model.model_fields)
            close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
            if close:
                message += f" (did you mean {close[0]!r}?)"
            message += f"; allowed here: {', '.join(allowed)}"
    elif err["type"] == "missing":
        message = "required field is missing"
    also = cause.also if isinstance(cause, FieldProblem) else None
    if also is not None and also < len(group_files) and group_files[also] != file:
        message += f" (groups.{also} is in {group_files[also]})"
    shown = err.get("input")
    if (
        err["type"] not in {"missing", "extra_forbidden"}
        and loc[:1] != ["kafka"]  # the passthrough, or the section as a string: may hold secrets
        and loc[:1] != ["admin"]  # the token (a SecretStr: refused, it is still the secret)
        and not isinstance(shown, dict | list)
        and repr(shown) not in message
    ):
        message += f" (got {shown!r})"
    return f"{where}: {field}: {message}"


def load_config(path: str | Path) -> ProxyConfig:
    """Load and validate a file or directory of onboarding YAML; ConfigError lists every problem.

    Each problem is one line: ``FILE: field.path: what is wrong (got VALUE)``; a value set by
    an environment override names the variable instead of the file.
    """
    path = Path(path)
    data, origin, group_files = _collect(path)
    try:
        return ProxyConfig(**data)
    except ValidationError as exc:
        problems = [_format_error(err, path, origin, group_files, data) for err in exc.errors()]
        raise ConfigError(list(dict.fromkeys(problems))) from exc
    except SettingsError as exc:
        # An override that is not valid JSON for a structured field (e.g. CONSUMER_PROXY_KAFKA).
        raise ConfigError([f"environment: {exc} (structured values must be JSON)"]) from exc
