"""The DLQ data pipeline on PySpark: the Spark side of ``dlq report`` and ``dlq merge``.

PySpark (and matplotlib, for the report's chart) are the optional ``pipeline`` extra. Every
Spark and matplotlib import sits inside a function, so importing this module costs nothing and
the proxy never needs them.

A job reads a *bounded* offset range of the DLQ with Spark's Kafka source (``startingOffsets``
and ``endingOffsets`` pinned per partition by the caller), so a DLQ that keeps growing while
the job runs cannot make it chase the end. The records are exposed with friendly columns (see
``DLQ_COLUMNS``) on which ``--status``, ``--since``/``--until`` and ``--where`` run as Spark
expressions.

``dlq merge`` writes through Spark's own Kafka sink (acks=all, idempotent producer), not by
collecting rows to the driver: the write scales with the executors like the read does (a
``--master`` cluster writes in parallel too), rows never cross into Python, and a finished
``save()`` means every task flushed its producer and checked each send (a failed send fails
the task and the job). The merge mark is committed by the caller only after that.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import shutil
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .config import KafkaConfig
from .dlq import (
    H_ATTEMPT,
    H_DEAD_LETTERED_AT,
    H_ENDPOINT,
    H_GROUP,
    H_OFFSET,
    H_PARTITION,
    H_REASON,
    H_STATUS,
    H_TIMESTAMP,
    H_TOPIC,
)
from .errors import ConfigError, ConsumerProxyError

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'consumer-proxy[pipeline]'"
MAVEN_CENTRAL = "https://repo1.maven.org/maven2"
CONNECTOR_ARTIFACT = "spark-sql-kafka-0-10"
TOKEN_PROVIDER_ARTIFACT = "spark-token-provider-kafka-0-10"  # the connector's own Spark dep
DEFAULT_MASTER = "local[*]"
PROBE_TIMEOUT_S = 5.0
# Per task when a DLQ partition is big: smaller tasks spread over the cores and show progress.
RECORDS_PER_TASK = 250_000

Progress = Callable[[str], None]
Ranges = dict[int, tuple[int, int]]
"""DLQ partition -> [start, end) offsets to read."""

DLQ_COLUMNS: dict[str, str] = {
    "partition": "INT: the DLQ record's partition",
    "offset": "BIGINT: the DLQ record's offset",
    "timestamp": "TIMESTAMP: the DLQ record's timestamp (--since/--until use it)",
    "key": "STRING: the key as UTF-8 text",
    "value": "STRING: the value as UTF-8 text",
    "key_bytes": "BINARY: the key",
    "value_bytes": "BINARY: the value",
    "headers": "ARRAY<STRUCT<key: STRING, value: BINARY>>: all headers, cp-* included",
    "status": f"STRING: {H_STATUS} (gRPC code name or action)",
    "reason": f"STRING: {H_REASON}",
    "endpoint": f"STRING: {H_ENDPOINT}",
    "dlq_group": f"STRING: {H_GROUP}",
    "original_topic": f"STRING: {H_TOPIC}",
    "original_partition": f"INT: {H_PARTITION}",
    "original_offset": f"BIGINT: {H_OFFSET}",
    "original_timestamp": f"TIMESTAMP: {H_TIMESTAMP}",
    "attempt": f"INT: {H_ATTEMPT} (attempts made before it was dead-lettered)",
    "dead_lettered_at": f"TIMESTAMP: {H_DEAD_LETTERED_AT}, else the record's timestamp",
}
"""The columns ``--where`` may use (view ``dlq``), with their types and meaning."""


class PipelineError(ConsumerProxyError):
    """A Spark job failed at run time (not a usage problem)."""


@dataclass(frozen=True)
class SparkOptions:
    """How to run Spark: the master, extra Spark settings and the Kafka connector's version."""

    master: str = DEFAULT_MASTER
    conf: tuple[tuple[str, str], ...] = ()
    connector_version: str | None = None  # None: match the installed PySpark
    quiet: bool = True  # send the JVM's own console output to a log file


@dataclass(frozen=True)
class Selection:
    """Which DLQ records a merge takes: every given condition must hold."""

    # On the DLQ record's timestamp (when the proxy wrote it), the time purge --until uses.
    since_ms: int | None = None  # timestamp >= since
    until_ms: int | None = None  # timestamp < until
    statuses: tuple[str, ...] = ()
    where: str | None = None  # a Spark SQL boolean expression over DLQ_COLUMNS

    def describe(self) -> str:
        """One line for progress output."""
        parts = []
        if self.since_ms is not None:
            parts.append(f"since {format_ms(self.since_ms)}")
        if self.until_ms is not None:
            parts.append(f"until {format_ms(self.until_ms)}")
        if self.statuses:
            parts.append("status in " + ",".join(self.statuses))
        if self.where:
            parts.append(f"where {self.where}")
        return "; ".join(parts) or "every record"


@dataclass
class MergeOutcome:
    """What a merge selected and whether it wrote it."""

    in_range: int
    selected: int
    by_partition: dict[int, int] = field(default_factory=dict)
    by_status: dict[str, int] = field(default_factory=dict)
    written: bool = False
    write_seconds: float = 0.0


def format_ms(ms: int) -> str:
    """Epoch milliseconds as ISO-8601 UTC."""
    return datetime.fromtimestamp(ms / 1000, tz=UTC).isoformat(timespec="milliseconds")


def format_hour(ms: int) -> str:
    """The start of an hour (epoch ms) as ``2025-05-01T13:00Z``."""
    return datetime.fromtimestamp(ms / 1000, tz=UTC).strftime("%Y-%m-%dT%H:00Z")


# --- availability ----------------------------------------------------------------------------


def require_pipeline(command: str, *, chart: bool = False) -> None:
    """ConfigError (exit 2) saying how to install what ``command`` needs when it is missing."""
    missing = []
    try:
        import pyspark  # noqa: F401
    except ImportError:
        missing.append("PySpark")
    if chart:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            missing.append("matplotlib")
    if missing:
        raise ConfigError(
            [
                f"dlq {command} runs on Spark and needs {' and '.join(missing)}, which "
                f"{'is' if len(missing) == 1 else 'are'} not installed; install the pipeline "
                f"extra: {INSTALL_HINT}"
            ]
        )
    if not os.environ.get("JAVA_HOME") and shutil.which("java") is None:
        raise ConfigError(
            [f"dlq {command} runs on Spark, which needs Java 17 or later: none found on PATH"]
        )


# --- the Kafka connector ---------------------------------------------------------------------


def scala_binary_version() -> str:
    """The Scala binary version the installed PySpark was built with (e.g. ``2.13``)."""
    import pyspark

    jars = Path(pyspark.__file__).parent / "jars"
    for jar in jars.glob("spark-core_*.jar"):
        found = re.match(r"spark-core_(\d+\.\d+)-", jar.name)
        if found:
            return found.group(1)
    return "2.13"  # Spark 4 is built for Scala 2.13 only


def _cache_roots() -> list[tuple[str, Path]]:
    home = Path.home()
    # Spark 4 keeps its Ivy cache in ~/.ivy2.5.2 (spark.jars.ivy); older ones in ~/.ivy2.
    return [
        ("ivy", home / ".ivy2.5.2" / "cache"),
        ("ivy", home / ".ivy2" / "cache"),
        ("m2", home / ".m2" / "repository"),
    ]


def _cached(artifact: str, version: str) -> bool:
    for kind, root in _cache_roots():
        name = f"{artifact}-{version}.jar"
        if kind == "ivy":
            jar = root / "org.apache.spark" / artifact / "jars" / name
        else:
            jar = root / "org" / "apache" / "spark" / artifact / version / name
        if jar.is_file():
            return True
    return False


def _cached_versions(artifact: str) -> set[str]:
    found: set[str] = set()
    for kind, root in _cache_roots():
        if kind == "ivy":
            jars = root / "org.apache.spark" / artifact / "jars"
            prefix = f"{artifact}-"
            if jars.is_dir():
                found.update(j.name[len(prefix) : -4] for j in jars.glob(f"{prefix}*.jar"))
        else:
            base = root / "org" / "apache" / "spark" / artifact
            if base.is_dir():
                found.update(d.name for d in base.iterdir() if _cached(artifact, d.name))
    return found


def _published(artifact: str, version: str, repo: str) -> bool:
    url = f"{repo}/org/apache/spark/{artifact}/{version}/{artifact}-{version}.pom"
    request = urllib.request.Request(url, method="HEAD")
    try:
        with urllib.request.urlopen(request, timeout=PROBE_TIMEOUT_S) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _published_versions(artifact: str, repo: str) -> set[str]:
    url = f"{repo}/org/apache/spark/{artifact}/maven-metadata.xml"
    try:
        with urllib.request.urlopen(url, timeout=PROBE_TIMEOUT_S) as response:
            text = response.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError):
        return set()
    return set(re.findall(r"<version>([^<]+)</version>", text))


def _release_key(version: str) -> tuple[int, ...] | None:
    """A sort key for a final release ``X.Y.Z``; None for previews, RCs and snapshots."""
    if not re.fullmatch(r"\d+\.\d+\.\d+", version):
        return None
    return tuple(int(part) for part in version.split("."))


def resolve_connector_version(
    spark_version: str, progress: Progress, repo: str = MAVEN_CENTRAL
) -> str:
    """The Kafka connector version to ask Ivy for: the installed PySpark's, when it exists.

    The connector and its token-provider dependency must both resolve, or Spark's launcher
    exits. In order: the exact version in a local cache (no network), the exact version on
    Maven Central, then -- when a mirror does not carry it -- the newest final release of the
    same major version no newer than PySpark that is cached or published, with a warning.
    """
    scala = scala_binary_version()
    artifacts = [f"{CONNECTOR_ARTIFACT}_{scala}", f"{TOKEN_PROVIDER_ARTIFACT}_{scala}"]
    if all(_cached(a, spark_version) for a in artifacts):
        return spark_version
    if all(_published(a, spark_version, repo) for a in artifacts):
        return spark_version
    wanted = _release_key(spark_version)
    if wanted is None:
        raise ConfigError(
            [
                f"no Kafka connector {spark_version} for PySpark {spark_version}; pass "
                "--connector-version"
            ]
        )

    def usable(versions: set[str]) -> list[str]:
        keyed = [(k, v) for v in versions if (k := _release_key(v)) is not None]
        return [v for k, v in sorted(keyed, reverse=True) if k[0] == wanted[0] and k <= wanted]

    local = set.intersection(*(_cached_versions(a) for a in artifacts))
    candidates = usable(local)
    if not candidates:
        remote = set.intersection(*(_published_versions(a, repo) for a in artifacts))
        # Newest first; HEAD-check each until one has both jars (a mirror may lag).
        first = next(
            (v for v in usable(remote) if all(_published(a, v, repo) for a in artifacts)), None
        )
        candidates = [first] if first else []
    if not candidates:
        raise ConfigError(
            [
                f"the Spark Kafka connector org.apache.spark:{artifacts[0]}:{spark_version} "
                f"(and {artifacts[1]}) is neither cached in ~/.ivy2.5.2 or ~/.m2 nor "
                f"published on {repo}; pass --connector-version or make Maven Central "
                "reachable"
            ]
        )
    progress(
        f"warning: the Kafka connector {spark_version} is not on {repo}; using "
        f"{candidates[0]}, the newest {wanted[0]}.x release found (--connector-version "
        "to choose)"
    )
    return candidates[0]


# --- the session -----------------------------------------------------------------------------


@contextlib.contextmanager
def _jvm_console_to(path: Path) -> Iterator[None]:
    """While the JVM starts, point fds 1 and 2 at ``path``: the JVM keeps them for good.

    Ivy's resolution report, log4j's console appender and Spark's warnings then land in the
    log file instead of the operator's terminal, while Python's own sys.stdout/stderr come
    back at once.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with open(path, "ab") as sink:
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)


def _quiet_python_loggers() -> None:
    # PySpark logs every analysis error with its JVM stack trace before raising it; we turn
    # the exception into one clear line ourselves.
    for name in ("SQLQueryContextLogger", "DataFrameQueryContextLogger", "py4j"):
        logging.getLogger(name).setLevel(logging.CRITICAL)


def session_conf(options: SparkOptions, packages: str) -> dict[str, str]:
    """The Spark settings of a pipeline session (``options.conf`` wins)."""
    conf = {
        "spark.app.name": "consumer-proxy-dlq",
        "spark.jars.packages": packages,
        "spark.ui.enabled": "false",  # no fixed port 4040, nothing to look at for a batch job
        "spark.ui.showConsoleProgress": "false",  # we print our own progress lines
        "spark.log.level": "WARN",
        "spark.sql.session.timeZone": "UTC",  # report hours are UTC hours
        # Forgiving SQL over messy dead letters: a bad cast in --where is NULL (not selected)
        # instead of failing the whole job half way.
        "spark.sql.ansi.enabled": "false",
        "spark.sql.shuffle.partitions": "8",  # tiny aggregates; 200 empty tasks cost seconds
    }
    if options.master.startswith("local"):
        # One machine: stay on loopback (no "hostname resolves to a loopback address" noise).
        conf["spark.driver.host"] = "127.0.0.1"
        conf["spark.driver.bindAddress"] = "127.0.0.1"
    conf.update(dict(options.conf))
    return conf


@dataclass(frozen=True)
class SparkRun:
    """A session, whether this command started it, and where the JVM's console output goes."""

    spark: SparkSession
    owned: bool
    console_log: Path | None = None


def start_spark(options: SparkOptions, progress: Progress) -> SparkRun:
    """The process's Spark session; a running one (a test's shared one, say) is reused."""
    import pyspark
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    _quiet_python_loggers()
    if SparkContext._active_spark_context is not None:
        return SparkRun(SparkSession.builder.getOrCreate(), owned=False)
    version = options.connector_version or resolve_connector_version(pyspark.__version__, progress)
    packages = f"org.apache.spark:{CONNECTOR_ARTIFACT}_{scala_binary_version()}:{version}"
    builder = SparkSession.builder.master(options.master)
    for key, value in session_conf(options, packages).items():
        builder = builder.config(key, value)
    started = time.monotonic()
    progress(f"starting Spark {pyspark.__version__} on {options.master} with {packages} ...")
    console: Path | None = None
    if options.quiet:
        handle, name = tempfile.mkstemp(prefix="consumer-proxy-spark-", suffix=".log")
        os.close(handle)
        console = Path(name)
    try:
        with _jvm_console_to(console) if console else contextlib.nullcontext():
            spark = builder.getOrCreate()
    except Exception as exc:
        where = f"; Spark's output is in {console}" if console else ""
        raise PipelineError(f"Spark did not start: {_first_line(exc)}{where}") from exc
    spark.sparkContext.setLogLevel("WARN")
    progress(f"Spark ready in {time.monotonic() - started:.1f}s")
    return SparkRun(spark, owned=True, console_log=console)


@contextlib.contextmanager
def spark_session(options: SparkOptions, progress: Progress) -> Iterator[SparkSession]:
    """A session for one command; stopped afterwards only if this command started it.

    The JVM's console log is removed after a clean run and pointed at after a failed one.
    """
    run = start_spark(options, progress)
    failed = True
    try:
        yield run.spark
        failed = False
    except ConfigError:
        failed = False  # a usage problem (a bad --where): Spark's log has nothing to add
        raise
    finally:
        if run.owned:
            run.spark.stop()
        if run.console_log is not None:
            if failed:
                progress(f"Spark's own log: {run.console_log}")
            else:
                run.console_log.unlink(missing_ok=True)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]


# --- reading the DLQ -------------------------------------------------------------------------


def java_kafka_options(kafka: KafkaConfig) -> dict[str, str]:
    """Spark's ``kafka.*`` options from the config: bootstrap servers and the security settings.

    ``kafka.client`` holds librdkafka names; Spark's source and sink use the Java client, so the
    common security settings are translated and anything else security-related is reported.
    """
    client = {str(k): str(v) for k, v in kafka.client.items()}
    out = {"kafka.bootstrap.servers": kafka.bootstrap_servers}
    if "security.protocol" in client:
        out["kafka.security.protocol"] = client["security.protocol"].upper()
    mechanism = client.get("sasl.mechanism") or client.get("sasl.mechanisms")
    if mechanism:
        out["kafka.sasl.mechanism"] = mechanism.upper()
    if "sasl.username" in client:
        module = (
            "org.apache.kafka.common.security.scram.ScramLoginModule"
            if (mechanism or "").upper().startswith("SCRAM")
            else "org.apache.kafka.common.security.plain.PlainLoginModule"
        )
        user = client["sasl.username"].replace('"', '\\"')
        password = client.get("sasl.password", "").replace('"', '\\"')
        out["kafka.sasl.jaas.config"] = (
            f'{module} required username="{user}" password="{password}";'
        )
    if "ssl.ca.location" in client:
        out["kafka.ssl.truststore.type"] = "PEM"
        out["kafka.ssl.truststore.location"] = client["ssl.ca.location"]
    if "ssl.certificate.location" in client and "ssl.key.location" in client:
        out["kafka.ssl.keystore.type"] = "PEM"
        out["kafka.ssl.keystore.certificate.chain"] = Path(
            client["ssl.certificate.location"]
        ).read_text()
        out["kafka.ssl.keystore.key"] = Path(client["ssl.key.location"]).read_text()
        if "ssl.key.password" in client:
            out["kafka.ssl.key.password"] = client["ssl.key.password"]
    if client.get("ssl.endpoint.identification.algorithm") == "none":
        out["kafka.ssl.endpoint.identification.algorithm"] = ""
    handled = {
        "security.protocol", "sasl.mechanism", "sasl.mechanisms", "sasl.username",
        "sasl.password", "ssl.ca.location", "ssl.certificate.location", "ssl.key.location",
        "ssl.key.password", "ssl.endpoint.identification.algorithm",
    }  # fmt: skip
    ignored = sorted(k for k in client if k not in handled and k.startswith(("sasl.", "ssl.")))
    if ignored:
        log.warning("not passed to Spark's Kafka client (no translation): %s", ", ".join(ignored))
    return out


def _header(name: str) -> str:
    # The last occurrence wins: the proxy appends its cp-* headers after the user's.
    return f"CAST(try_element_at(filter(headers, h -> h.key = '{name}'), -1).value AS STRING)"


def dlq_frame(
    spark: SparkSession, kafka_options: dict[str, str], topic: str, ranges: Ranges
) -> DataFrame:
    """The DLQ records in ``ranges`` with the columns of ``DLQ_COLUMNS`` (also view ``dlq``)."""
    from pyspark.sql import functions as F

    parts = sorted(ranges)
    total = sum(max(0, end - start) for start, end in ranges.values())
    reader = (
        spark.read.format("kafka")
        .options(**kafka_options)
        .option("assign", json.dumps({topic: parts}))
        .option("startingOffsets", json.dumps({topic: {str(p): ranges[p][0] for p in parts}}))
        .option("endingOffsets", json.dumps({topic: {str(p): ranges[p][1] for p in parts}}))
        .option("includeHeaders", "true")
        # Records purged between planning and reading are gone either way; skip, do not fail.
        .option("failOnDataLoss", "false")
        .option("groupIdPrefix", "consumer-proxy-dlq")
    )
    if parts and total // len(parts) > RECORDS_PER_TASK:
        reader = reader.option("minPartitions", str(math.ceil(total / RECORDS_PER_TASK)))
    raw = reader.load()
    frame = raw.select(
        F.col("partition"),
        F.col("offset"),
        F.col("timestamp"),
        F.col("key").cast("string").alias("key"),
        F.col("value").cast("string").alias("value"),
        F.col("key").alias("key_bytes"),
        F.col("value").alias("value_bytes"),
        F.col("headers"),
        F.expr(_header(H_STATUS)).alias("status"),
        F.expr(_header(H_REASON)).alias("reason"),
        F.expr(_header(H_ENDPOINT)).alias("endpoint"),
        F.expr(_header(H_GROUP)).alias("dlq_group"),
        F.expr(_header(H_TOPIC)).alias("original_topic"),
        F.expr(f"try_cast({_header(H_PARTITION)} AS INT)").alias("original_partition"),
        F.expr(f"try_cast({_header(H_OFFSET)} AS BIGINT)").alias("original_offset"),
        F.expr(f"timestamp_millis(try_cast({_header(H_TIMESTAMP)} AS BIGINT))").alias(
            "original_timestamp"
        ),
        F.expr(f"try_cast({_header(H_ATTEMPT)} AS INT)").alias("attempt"),
        F.expr(
            f"coalesce(timestamp_millis(try_cast({_header(H_DEAD_LETTERED_AT)} AS BIGINT)), "
            "timestamp)"
        ).alias("dead_lettered_at"),
    )
    frame.createOrReplaceTempView("dlq")
    return frame


def apply_selection(frame: DataFrame, selection: Selection) -> DataFrame:
    """``frame`` filtered by ``selection``; ConfigError naming the problem for a bad --where.

    Spark parses and analyses the expression right here (no data is read), so a bad one is
    caught before anything is written.
    """
    from pyspark.errors import PySparkException
    from pyspark.sql import functions as F

    selected = frame
    if selection.since_ms is not None:
        selected = selected.where(
            F.col("timestamp") >= F.timestamp_millis(F.lit(selection.since_ms))
        )
    if selection.until_ms is not None:
        selected = selected.where(
            F.col("timestamp") < F.timestamp_millis(F.lit(selection.until_ms))
        )
    if selection.statuses:
        selected = selected.where(F.col("status").isin(list(selection.statuses)))
    if selection.where:
        try:
            selected = selected.where(F.expr(selection.where))
            _ = selected.schema  # analysis is eager in classic Spark; make sure of it
        except PySparkException as exc:
            raise ConfigError(
                [
                    f"bad --where {selection.where!r}: {_spark_message(exc)}",
                    "columns: " + ", ".join(DLQ_COLUMNS),
                ]
            ) from exc
    return selected


def _spark_message(exc: BaseException) -> str:
    text = str(exc).strip()
    # Keep the error class and message; drop the plan dump and the JVM stack.
    lines = [line for line in text.splitlines() if line.strip()]
    head = lines[0] if lines else type(exc).__name__
    head = re.sub(r"(; line \d+ pos \d+)?;?$", "", head.rstrip())
    sql = "\n".join(lines[1:4]) if "PARSE_SYNTAX_ERROR" in head else ""
    return head + (f"\n{sql}" if sql else "")


# --- progress --------------------------------------------------------------------------------


@contextlib.contextmanager
def stage_progress(spark: SparkSession, label: str, progress: Progress) -> Iterator[None]:
    """Print ``label: done/total tasks`` while a Spark action runs (at most every 2 s)."""
    stop = threading.Event()
    tracker = spark.sparkContext.statusTracker()

    def watch() -> None:
        last = ""
        while not stop.wait(2.0):
            done = total = 0
            with contextlib.suppress(Exception):  # the job may end between the two calls
                for stage_id in tracker.getActiveStageIds():
                    info = tracker.getStageInfo(stage_id)
                    if info is not None:
                        done += info.numCompletedTasks
                        total += info.numTasks
            line = f"  {label}: {done}/{total} tasks done" if total else ""
            if line and line != last:
                progress(line)
                last = line

    watcher = threading.Thread(target=watch, name=f"progress-{label}", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        stop.set()
        watcher.join()


# --- report ----------------------------------------------------------------------------------


def build_report(
    spark: SparkSession,
    kafka_options: dict[str, str],
    topic: str,
    ranges: Ranges,
    progress: Progress,
    top: int = 10,
) -> dict[str, Any]:
    """Counts by status, reason, original partition, hour and key over the DLQ range."""
    from pyspark import StorageLevel
    from pyspark.sql import functions as F

    frame = dlq_frame(spark, kafka_options, topic, ranges).select(
        "partition",
        "status",
        "reason",
        "original_topic",
        "original_partition",
        "key_bytes",
        F.unix_millis(F.date_trunc("hour", "timestamp")).alias("hour_ms"),
    )
    # One read of Kafka; every aggregate below runs over the cached projection.
    frame.persist(StorageLevel.MEMORY_AND_DISK)
    try:
        with stage_progress(spark, "reading the DLQ", progress):
            by_dlq_partition = {
                int(r["partition"]): int(r["count"])
                for r in frame.groupBy("partition").count().collect()
            }
        total = sum(by_dlq_partition.values())
        progress(f"read {total} records; aggregating")

        def counted(*cols: str) -> list[Any]:
            return frame.groupBy(*cols).count().orderBy(F.desc("count"), *cols).collect()

        by_status = [{"status": r["status"], "count": r["count"]} for r in counted("status")]
        reasons = counted("reason")
        by_origin = [
            {
                "topic": r["original_topic"],
                "partition": r["original_partition"],
                "count": r["count"],
            }
            for r in frame.groupBy("original_topic", "original_partition")
            .count()
            .orderBy("original_topic", "original_partition")
            .collect()
        ]
        by_hour = [
            {
                "hour": format_hour(r["hour_ms"]) if r["hour_ms"] is not None else None,
                "hour_ms": r["hour_ms"],
                "count": r["count"],
            }
            for r in frame.groupBy("hour_ms").count().orderBy("hour_ms").collect()
        ]
        keys = (
            frame.groupBy("key_bytes")
            .count()
            .orderBy(F.desc("count"), "key_bytes")
            .limit(top)
            .collect()
        )
    finally:
        frame.unpersist()
    from .dlq_cli import show_value

    return {
        "topic": topic,
        "generated_at": format_ms(int(time.time() * 1000)),
        "offsets": {str(p): list(r) for p, r in sorted(ranges.items())},
        "total": total,
        "by_dlq_partition": [
            {"partition": p, "count": n} for p, n in sorted(by_dlq_partition.items())
        ],
        "by_status": by_status,
        "by_reason": [{"reason": r["reason"], "count": r["count"]} for r in reasons[:20]],
        "reasons_distinct": len(reasons),
        "by_original_partition": by_origin,
        "by_hour": by_hour,
        "top_keys": [
            {
                "key": show_value(bytes(r["key_bytes"]) if r["key_bytes"] is not None else None),
                "count": r["count"],
            }
            for r in keys
        ],
    }


def write_chart(report: dict[str, Any], path: Path) -> None:
    """A 2x2 PNG: records per hour, by status, by original partition, top reasons."""
    import matplotlib

    matplotlib.use("Agg")  # files only, never a display
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.dates import AutoDateLocator, ConciseDateFormatter
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 8.5), layout="constrained")
    FigureCanvasAgg(fig)
    fig.suptitle(
        f"DLQ {report['topic']} of group {report.get('group', '?')}: {report['total']} records"
        f" (generated {report['generated_at']})"
    )
    ax_hour, ax_status, ax_part, ax_reason = fig.subplots(2, 2).flatten()

    hours = [h for h in report["by_hour"] if h["hour_ms"] is not None]
    ax_hour.set_title("dead-lettered per hour (UTC)")
    if hours:
        times = [datetime.fromtimestamp(h["hour_ms"] / 1000, tz=UTC) for h in hours]
        ax_hour.bar(times, [h["count"] for h in hours], width=0.9 / 24, align="edge")
        locator = AutoDateLocator()  # type: ignore[no-untyped-call]
        ax_hour.xaxis.set_major_locator(locator)
        ax_hour.xaxis.set_major_formatter(ConciseDateFormatter(locator))  # type: ignore[no-untyped-call]
    ax_hour.set_ylabel("records")

    def barh(ax: Any, title: str, labels: Sequence[str], counts: Sequence[int]) -> None:
        ax.set_title(title)
        ax.barh(range(len(labels)), counts)
        ax.set_yticks(range(len(labels)), labels)
        ax.invert_yaxis()  # biggest first
        ax.set_xlabel("records")

    barh(
        ax_status,
        "by cp-status",
        [s["status"] or "(none)" for s in report["by_status"]],
        [s["count"] for s in report["by_status"]],
    )
    origins = report["by_original_partition"]
    topics = {o["topic"] for o in origins}
    ax_part.set_title("by original partition")
    ax_part.bar(
        range(len(origins)),
        [o["count"] for o in origins],
        tick_label=[
            (f"{o['topic']}[{o['partition']}]" if len(topics) > 1 else str(o["partition"]))
            for o in origins
        ],
    )
    ax_part.set_ylabel("records")
    reasons = report["by_reason"][:10]
    barh(
        ax_reason,
        "top cp-reason",
        [_clip(r["reason"] or "(none)", 45) for r in reasons],
        [r["count"] for r in reasons],
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def _clip(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


def render_report(report: dict[str, Any]) -> str:
    """The terminal summary: a few small tables."""
    total = report["total"] or 1
    lines = [f"DLQ {report['topic']} of group {report.get('group')}: {report['total']} records"]

    def table(title: str, rows: list[tuple[str, int]], limit: int = 12) -> None:
        lines.append("")
        lines.append(f"{title:<48} {'count':>10} {'share':>7}")
        for label, count in rows[:limit]:
            lines.append(f"  {_clip(label, 46):<46} {count:>10} {100 * count / total:>6.1f}%")
        if len(rows) > limit:
            rest = sum(c for _, c in rows[limit:])
            lines.append(f"  {f'... {len(rows) - limit} more':<46} {rest:>10}")

    table("by cp-status", [(s["status"] or "(none)", s["count"]) for s in report["by_status"]])
    table(
        f"by cp-reason (top of {report['reasons_distinct']})",
        [(r["reason"] or "(none)", r["count"]) for r in report["by_reason"]],
        limit=8,
    )
    table(
        "by original partition",
        [(f"{o['topic']}[{o['partition']}]", o["count"]) for o in report["by_original_partition"]],
    )
    table("by hour (UTC)", [(h["hour"] or "(none)", h["count"]) for h in report["by_hour"]], 24)
    table("top keys", [(k["key"], k["count"]) for k in report["top_keys"]])
    files = report.get("files")
    if files:
        lines.append("")
        lines.append(f"report: {files['json']}")
        lines.append(f"chart:  {files['png']}")
    return "\n".join(lines)


# --- merge -----------------------------------------------------------------------------------


def merge(
    spark: SparkSession,
    kafka_options: dict[str, str],
    dlq_topic: str,
    redrive_topic: str,
    ranges: Ranges,
    selection: Selection,
    progress: Progress,
    *,
    dry_run: bool,
    confirm: Callable[[MergeOutcome], bool],
) -> MergeOutcome:
    """Select DLQ records in ``ranges`` and write them, unchanged, to ``redrive_topic``.

    Key, value and every header (the user's and the ``cp-*`` ones) are kept, so the proxy
    delivers them with the original coordinates and the attempt count carried on. The
    selection is counted in a first pass (so a selection that fails at run time fails before
    anything is written, and the operator can be asked), then a second pass over the same
    pinned offset range writes it. Two reads of Kafka beat caching the selection in between:
    measured on 1M dead letters, building Spark's cache cost twice a plain read, and its
    deserialized variant ran out of heap in a 1 GiB driver. Returns once every write is
    acknowledged (acks=all); raises PipelineError when the write failed.
    """
    from pyspark.errors import PySparkException
    from pyspark.sql import functions as F

    in_range = sum(max(0, end - start) for start, end in ranges.values())
    frame = dlq_frame(spark, kafka_options, dlq_topic, ranges)
    selected = apply_selection(frame, selection).select(
        "partition",
        "status",
        F.col("key_bytes").alias("key"),
        F.col("value_bytes").alias("value"),
        "headers",
    )
    outcome = MergeOutcome(in_range=in_range, selected=0)
    try:
        with stage_progress(spark, "selecting", progress):
            rows = selected.groupBy("partition", "status").count().collect()
    except PySparkException as exc:
        raise PipelineError(
            f"reading or selecting from {dlq_topic} failed (nothing written): {_spark_message(exc)}"
        ) from exc
    for row in rows:
        count = int(row["count"])
        outcome.selected += count
        part = int(row["partition"])
        outcome.by_partition[part] = outcome.by_partition.get(part, 0) + count
        status = row["status"] or "(none)"
        outcome.by_status[status] = outcome.by_status.get(status, 0) + count
    progress(f"selected {outcome.selected} of {in_range} records ({selection.describe()})")
    if dry_run or outcome.selected == 0 or not confirm(outcome):
        return outcome
    progress(f"writing {outcome.selected} records to {redrive_topic} ...")
    started = time.monotonic()
    writer = (
        selected.select("key", "value", "headers")
        .write.format("kafka")
        .options(**kafka_options)
        .option("topic", redrive_topic)
        # The same guarantees as the proxy's DLQ writer: acknowledged by all in-sync
        # replicas, no duplicates from producer retries.
        .option("kafka.acks", "all")
        .option("kafka.enable.idempotence", "true")
        .option("kafka.compression.type", "lz4")
        .option("kafka.linger.ms", "20")
        .option("kafka.batch.size", str(512 * 1024))
    )
    try:
        with stage_progress(spark, "writing", progress):
            writer.save()
    except PySparkException as exc:
        raise PipelineError(
            f"writing to {redrive_topic} failed; some records may have been written and "
            f"will be written again by the next merge (the mark did not move): "
            f"{_spark_message(exc)}"
        ) from exc
    outcome.written = True
    outcome.write_seconds = time.monotonic() - started
    return outcome
