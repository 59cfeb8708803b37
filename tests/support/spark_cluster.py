"""A Spark standalone cluster on 127.0.0.1 (one master, one worker) from PySpark's own launcher.

PySpark's wheel carries ``bin/spark-class``, so a test needs no separate Spark download: the
master and the worker are the classes ``org.apache.spark.deploy.master.Master`` and
``org.apache.spark.deploy.worker.Worker``, both on port 0 (free ports), their web UIs too.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from .waiting import wait_until

START_TIMEOUT_S = 120.0


class ClusterError(RuntimeError):
    """The master or the worker did not come up; the message carries its log's tail."""


@dataclass
class SparkCluster:
    """A running master and worker; ``url`` is the master's ``spark://`` address."""

    url: str
    dir: Path
    processes: list[subprocess.Popen[bytes]]

    def log(self, name: str) -> str:
        """The console log of ``master`` or ``worker``."""
        return (self.dir / f"{name}.log").read_text(errors="replace")


def spark_home() -> Path:
    """The installed PySpark package, which is a Spark home (jars/, bin/spark-class)."""
    import pyspark

    return Path(pyspark.__file__).parent


def cluster_env(directory: Path) -> dict[str, str]:
    """Environment for the daemons and for drivers talking to them: everything on loopback."""
    return {
        **os.environ,
        "SPARK_HOME": str(spark_home()),
        "SPARK_LOCAL_IP": "127.0.0.1",
        "SPARK_LOG_DIR": str(directory),
        "SPARK_WORKER_DIR": str(directory / "work"),
    }


def _launch(directory: Path, name: str, *args: str) -> subprocess.Popen[bytes]:
    log = open(directory / f"{name}.log", "wb")  # noqa: SIM115 (the child keeps it open)
    try:
        return subprocess.Popen(
            [str(spark_home() / "bin" / "spark-class"), *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=cluster_env(directory),
            start_new_session=True,  # its own process group: stopped as a whole
        )
    finally:
        log.close()


def _wait_for(cluster: SparkCluster, name: str, process: subprocess.Popen[bytes], text: str) -> str:
    def seen() -> str | None:
        if process.poll() is not None:
            raise ClusterError(
                f"the {name} exited ({process.returncode}):\n{cluster.log(name)[-3000:]}"
            )
        log = cluster.log(name)
        return log if text in log else None

    try:
        found = wait_until(seen, timeout=START_TIMEOUT_S, interval=0.2, message=f"{name}: {text}")
    except AssertionError as exc:
        raise ClusterError(f"{exc}\n{cluster.log(name)[-3000:]}") from exc
    assert found is not None
    return found


def start_cluster(directory: Path, cores: int = 2, memory: str = "1g") -> SparkCluster:
    """Start a master and one worker in ``directory`` and return once the worker registered."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "work").mkdir(exist_ok=True)
    cluster = SparkCluster(url="", dir=directory, processes=[])
    try:
        master = _launch(
            directory, "master", "org.apache.spark.deploy.master.Master",
            "--host", "127.0.0.1", "--port", "0", "--webui-port", "0",
        )  # fmt: skip
        cluster.processes.append(master)
        log = _wait_for(cluster, "master", master, "I have been elected leader")
        found = re.search(r"Starting Spark master at (spark://127\.0\.0\.1:\d+)", log)
        if found is None:
            raise ClusterError(f"no master URL in its log:\n{log[-3000:]}")
        cluster.url = found.group(1)
        worker = _launch(
            directory, "worker", "org.apache.spark.deploy.worker.Worker", cluster.url,
            "--host", "127.0.0.1", "--port", "0", "--webui-port", "0",
            "--cores", str(cores), "--memory", memory, "--work-dir", str(directory / "work"),
        )  # fmt: skip
        cluster.processes.append(worker)
        _wait_for(cluster, "worker", worker, "Successfully registered with master")
    except BaseException:
        stop_cluster(cluster)
        raise
    return cluster


def stop_cluster(cluster: SparkCluster) -> None:
    """Stop the worker (and the executors it launched), then the master. Idempotent."""
    for process in reversed(cluster.processes):
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=30)
