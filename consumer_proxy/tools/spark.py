"""The Spark session for the DLQ jobs: availability, the Kafka connector lookup, the session.

PySpark (and matplotlib, for the report's chart) are the optional ``pipeline`` extra. Every
Spark import sits inside a function, so importing this module costs nothing and the proxy
never needs them.

``local[*]`` is the embedded default; ``--master spark://host:port`` runs the same jobs on a
standalone cluster (the executors then need the Kafka connector, which Spark ships to them
from the driver's resolved ``spark.jars.packages``, and, for ``merge --rate``, this package
and confluent-kafka in the Python that ``PYSPARK_PYTHON`` names: this one by default).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..config import KafkaConfig
from ..errors import ConfigError, ConsumerProxyError

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'consumer-proxy[pipeline]'"
MAVEN_CENTRAL = "https://repo1.maven.org/maven2"
CONNECTOR_ARTIFACT = "spark-sql-kafka-0-10"
TOKEN_PROVIDER_ARTIFACT = "spark-token-provider-kafka-0-10"  # the connector's own Spark dep
DEFAULT_MASTER = "local[*]"
PROBE_TIMEOUT_S = 5.0

Progress = Callable[[str], None]


class PipelineError(ConsumerProxyError):
    """A Spark job failed at run time (not a usage problem)."""


@dataclass(frozen=True)
class SparkOptions:
    """How to run Spark: the master, extra Spark settings and the Kafka connector's version."""

    master: str = DEFAULT_MASTER
    conf: tuple[tuple[str, str], ...] = ()
    connector_version: str | None = None  # None: match the installed PySpark
    quiet: bool = True  # send the JVM's own console output to a log file


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
    if options.master.startswith("local") or os.environ.get("SPARK_LOCAL_IP") == "127.0.0.1":
        # One machine (or a cluster on loopback): stay on loopback (no "hostname resolves
        # to a loopback address" noise).
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
    # Python workers (merge --rate writes from Python) run this interpreter, which has this
    # package and confluent-kafka, not whatever python3 is first on PATH. PySpark reads only
    # the environment variable for it; an operator's own setting wins.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
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


def jaas_quoted(text: str) -> str:
    """``text`` as a quoted value of a JAAS line, read back exactly by Kafka's parser.

    Kafka's ``JaasConfig`` reads quoted values with ``java.io.StreamTokenizer``, which takes C
    escapes (a ``\\n`` in a password would become a newline, a trailing backslash would escape
    the closing quote) and ends a value at a line break: escape the backslash first, then the
    quote and the line breaks.
    """
    escaped = (
        text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r")
    )
    return f'"{escaped}"'


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
        user = jaas_quoted(client["sasl.username"])
        password = jaas_quoted(client.get("sasl.password", ""))
        out["kafka.sasl.jaas.config"] = f"{module} required username={user} password={password};"
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


def spark_message(exc: BaseException) -> str:
    """A Spark error as its class and message, without the plan dump and the JVM stack."""
    text = str(exc).strip()
    # Keep the error class and message; drop the plan dump and the JVM stack.
    lines = [line for line in text.splitlines() if line.strip()]
    head = lines[0] if lines else type(exc).__name__
    head = re.sub(r"(; line \d+ pos \d+)?;?$", "", head.rstrip())
    sql = "\n".join(lines[1:4]) if "PARSE_SYNTAX_ERROR" in head else ""
    if "Python worker" in head and len(lines) > 1:
        # A task's Python code raised: its own exception is the traceback's last line.
        cause = next((line.strip() for line in reversed(lines) if not line.startswith(" ")), "")
        return f"{head} {cause}"
    return head + (f"\n{sql}" if sql else "")
