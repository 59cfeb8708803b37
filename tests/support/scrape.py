"""Reading the proxy's HTTP endpoint the way Prometheus and Kubernetes do: over a socket."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families


async def http_get(port: int, path: str, host: str = "127.0.0.1") -> tuple[int, str]:
    """GET ``path``; returns (status code, body text)."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(f"GET {path} HTTP/1.0\r\nHost: {host}\r\n\r\n".encode())
        await writer.drain()
        data = await reader.read()
    finally:
        writer.close()
        await writer.wait_closed()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body.decode()


@dataclass(frozen=True)
class Scrape:
    """One parsed /metrics exposition: every sample by name and labels."""

    samples: dict[tuple[str, frozenset[tuple[str, str]]], float]
    types: dict[str, str]

    def value(self, name: str, **labels: str) -> float | None:
        """The sample with exactly these labels, or None."""
        return self.samples.get((name, frozenset(labels.items())))

    def series(self, name: str, **labels: str) -> list[tuple[dict[str, str], float]]:
        """Every sample called ``name`` whose labels include ``labels``."""
        wanted = set(labels.items())
        return [
            (dict(key), value)
            for (sample, key), value in self.samples.items()
            if sample == name and wanted <= key
        ]

    def total(self, name: str, **labels: str) -> float:
        """The sum of ``series(name, **labels)``."""
        return sum(value for _, value in self.series(name, **labels))


def parse(text: str) -> Scrape:
    """Parse Prometheus text exposition with prometheus_client's own parser."""
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    types: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        types[family.name] = family.type
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return Scrape(samples, types)


async def scrape(port: int) -> Scrape:
    """GET /metrics and parse it; fails on a non-200 answer."""
    status, body = await http_get(port, "/metrics")
    assert status == 200, body
    return parse(body)
