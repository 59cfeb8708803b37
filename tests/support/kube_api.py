"""A stand-in Kubernetes API server that answers discovery only, for `helm install --dry-run`.

Helm 3's `install --dry-run=client` still checks that a cluster is reachable and reads its
version and API groups (discovery) before it validates the values against the schema and
renders the templates; only `helm template` skips that. This server answers exactly those
discovery requests, so a bad value is refused by the real install path, not a copy of it.
It knows no resources: an install that gets as far as building objects fails with
"unable to build kubernetes objects", which no test expects from a good render.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any


def _resources(group_version: str, *kinds: tuple[str, str]) -> dict[str, Any]:
    return {
        "kind": "APIResourceList",
        "groupVersion": group_version,
        "resources": [
            {"name": plural, "singularName": "", "namespaced": True, "kind": kind, "verbs": ["get"]}
            for kind, plural in kinds
        ],
    }


def _group(name: str, version: str) -> dict[str, Any]:
    gv = {"groupVersion": f"{name}/{version}", "version": version}
    return {"name": name, "versions": [gv], "preferredVersion": gv}


# The kinds the chart renders, so that a good install (with --disable-openapi-validation: no
# OpenAPI documents here) maps every object; a GET of any object answers 404, "not there yet".
_ANSWERS: dict[str, dict[str, Any]] = {
    "/version": {
        "major": "1",
        "minor": "37",
        "gitVersion": "v1.37.0",
        "platform": "linux/amd64",
    },
    "/api": {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []},
    "/api/v1": _resources(
        "v1",
        ("ConfigMap", "configmaps"),
        ("Service", "services"),
        ("ServiceAccount", "serviceaccounts"),
        ("Pod", "pods"),
    ),
    "/apis": {
        "kind": "APIGroupList",
        "apiVersion": "v1",
        "groups": [
            _group("apps", "v1"),
            _group("policy", "v1"),
            _group("autoscaling", "v2"),
            _group("monitoring.coreos.com", "v1"),
        ],
    },
    "/apis/apps/v1": _resources("apps/v1", ("Deployment", "deployments")),
    "/apis/policy/v1": _resources("policy/v1", ("PodDisruptionBudget", "poddisruptionbudgets")),
    "/apis/autoscaling/v2": _resources(
        "autoscaling/v2", ("HorizontalPodAutoscaler", "horizontalpodautoscalers")
    ),
    "/apis/monitoring.coreos.com/v1": _resources(
        "monitoring.coreos.com/v1", ("ServiceMonitor", "servicemonitors")
    ),
}


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        answer = _ANSWERS.get(self.path.split("?", 1)[0])
        body = json.dumps(answer or {"kind": "Status", "code": 404}).encode()
        self.send_response(200 if answer else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # keep the test output clean


@contextmanager
def discovery_only_api(directory: Path) -> Iterator[dict[str, str]]:
    """Serve discovery on a free 127.0.0.1 port; yields the environment helm should run with."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, name="kube-api", daemon=True)
    thread.start()
    kubeconfig = directory / "kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {
                        "name": "stub",
                        "cluster": {"server": f"http://127.0.0.1:{server.server_port}"},
                    }
                ],
                "users": [{"name": "stub", "user": {}}],
                "contexts": [{"name": "stub", "context": {"cluster": "stub", "user": "stub"}}],
                "current-context": "stub",
            }
        ),
        encoding="utf-8",
    )
    try:
        yield {
            "KUBECONFIG": str(kubeconfig),
            "KUBECACHEDIR": str(directory / "kube-cache"),
            "HELM_CACHE_HOME": str(directory / "helm-cache"),
            "HELM_CONFIG_HOME": str(directory / "helm-config"),
            "HELM_DATA_HOME": str(directory / "helm-data"),
        }
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
