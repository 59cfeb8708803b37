"""``dlq report`` and ``dlq merge`` on a Spark standalone cluster give what ``local[*]`` gives.

A master and a worker on 127.0.0.1, started from PySpark's own launcher, serve the whole
module. The cluster runs go through the real CLI in a fresh process each (a driver's JVM
keeps the master it was launched for); the local runs go through ``main()`` in-process.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from consumer_proxy.cli import main
from consumer_proxy.core import records as dlq_records
from tests.support.kafka import Broker, consume_all, create_topic, produce, unique_name
from tests.support.spark_cluster import (
    ClusterError,
    SparkCluster,
    cluster_env,
    start_cluster,
    stop_cluster,
)
from tests.test_dlq_tools import BASE_MS, dead_letter, group_config, merge_marks

# ``slow``: a Spark standalone master and worker, and a JVM per CLI run (make test-fast
# leaves it out).
pytestmark = [pytest.mark.kafka, pytest.mark.spark, pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent
STATUSES = ["INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "FAILED_PRECONDITION", "DATA_LOSS"]
N = 3000


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SparkCluster]:
    """One standalone master and worker for the module. Fails, never skips."""
    try:
        running = start_cluster(tmp_path_factory.mktemp("spark-cluster"), cores=2, memory="1g")
    except (ClusterError, OSError) as exc:
        pytest.fail(f"the Spark standalone cluster did not start:\n{exc}", pytrace=False)
    try:
        yield running
    finally:
        stop_cluster(running)


@pytest.fixture(scope="module")
def dlq_group(kafka: Broker, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """3000 dead letters over 3 partitions: statuses, reasons with values, keys, hours."""
    group = unique_name("dlqcl")
    create_topic(kafka.bootstrap, f"{group}.dlq", partitions=3)
    create_topic(kafka.bootstrap, f"{group}.redrive", partitions=2)
    records = [
        dead_letter(
            i,
            status=STATUSES[(i * 7) % 4],
            value=f"payload {i}".encode(),
            key=f"k{i % 13}".encode(),
            ts=BASE_MS + i * 7_000,
            attempt=1 + i % 3,
            reason=f"order {i % 50} rejected: field '{i % 7}'",
            original_partition=i % 5,
            partition=i % 3,
        )
        for i in range(N)
    ]
    produce(kafka.bootstrap, f"{group}.dlq", records)
    path = group_config(kafka.bootstrap, tmp_path_factory.mktemp("cluster-config"), group)
    return {"group": group, "config": path, "bootstrap": kafka.bootstrap, "records": records}


def on_cluster(cluster: SparkCluster, *args: str | Path) -> dict[str, Any]:
    """A ``consumer-proxy dlq`` command on the cluster, in its own process; its JSON output."""
    result = subprocess.run(
        [sys.executable, "-m", "consumer_proxy", "dlq", *map(str, args), "--json",
         "--master", cluster.url, "--spark-conf", "spark.executor.memory=512m"],
        capture_output=True, text=True, timeout=300, cwd=ROOT, env=cluster_env(cluster.dir),
        stdin=subprocess.DEVNULL, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    answer: dict[str, Any] = json.loads(result.stdout)
    return answer


def locally(capsys: pytest.CaptureFixture[str], *args: str | Path) -> dict[str, Any]:
    """The same command on ``local[2]``, in-process."""
    code = main(["dlq", *map(str, args), "--json", "--master", "local[2]"])
    out, err = capsys.readouterr()
    assert code == 0, err[-3000:]
    answer: dict[str, Any] = json.loads(out)
    return answer


REPORT_FIELDS = [
    "total", "by_dlq_partition", "by_status", "by_reason_template", "by_reason",
    "reasons_distinct", "by_original_partition", "by_hour", "top_keys",
]  # fmt: skip


def test_report_and_merge_on_a_standalone_cluster_match_local(
    cluster: SparkCluster, dlq_group: dict[str, Any], tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    group, path = dlq_group["group"], dlq_group["config"]
    common = ["--config", path, "--group", group]

    # When the report runs on local[2] and on the standalone cluster
    local_report = locally(capsys, "report", *common, "--out", tmp_path / "local")
    cluster_report = on_cluster(cluster, "report", *common, "--out", tmp_path / "cluster")

    # Then every count is the same
    assert local_report["total"] == N
    for field in REPORT_FIELDS:
        assert cluster_report[field] == local_report[field], field
    # and the cluster did the work: the master ran the application on its worker's executor
    assert "Registering app consumer-proxy-dlq" in cluster.log("master")
    assert "Asked to launch executor" in cluster.log("worker")

    # When a merge is counted locally (dry run) and then run on the cluster
    selection = ["--status", "INVALID_ARGUMENT,DATA_LOSS", "--where", "attempt >= 2"]
    local_merge = locally(capsys, "merge", *common, *selection, "--dry-run")
    cluster_merge = on_cluster(cluster, "merge", *common, *selection, "--yes")

    # Then the cluster wrote exactly what the local run selected
    wanted = [
        r for r in dlq_group["records"]
        if dict(r["headers"])[dlq_records.H_STATUS] in (b"INVALID_ARGUMENT", b"DATA_LOSS")
        and int(dict(r["headers"])[dlq_records.H_ATTEMPT]) >= 2
    ]  # fmt: skip
    assert local_merge["selected"] == cluster_merge["written"] == cluster_merge["merged"]
    assert cluster_merge["written"] == len(wanted)
    for field in ("in_range", "selected", "by_partition", "by_status"):
        assert cluster_merge[field] == local_merge[field], field
    sent = Counter(
        dlq_records.split_headers(m.headers())[1][dlq_records.H_OFFSET]
        for m in consume_all(dlq_group["bootstrap"], f"{group}.redrive")
    )
    assert sent == Counter(dict(r["headers"])[dlq_records.H_OFFSET].decode() for r in wanted)
    # and the merge mark records them: a local rerun finds nothing left to merge
    prefixes = merge_marks(dlq_group["bootstrap"], group)
    assert set(prefixes) == {r["partition"] for r in wanted}  # 1 and 2: attempt 1 in 0
    rerun = locally(capsys, "merge", *common, *selection, "--dry-run")
    assert rerun["selected"] == 0
    assert rerun["skipped_merged"] + sum(prefixes.values()) == len(wanted)
    print(
        f"standalone vs local: report total {cluster_report['total']}/{local_report['total']}, "
        f"merge written {cluster_merge['written']} / selected locally {local_merge['selected']}"
    )
