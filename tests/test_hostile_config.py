"""Hostile onboarding files: one team's file in a shared ``conf.d/`` cannot keep the proxy from
starting, and a config error never echoes a value that may hold a secret.

Each case runs the real CLI entry point in-process (``validate``, and ``run``, which checks
the config before it connects to anything) on a directory of a good ``kafka.yaml``, a good
team's file and the hostile one: exit code 2, one line naming the hostile file and why.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from consumer_proxy.config import MAX_FILE_BYTES, MAX_NESTING, MAX_NODES
from tests.support.cli import Cli

SECRET = "Hunter2-sasl-pa55-9d1e"
# Nothing listens here: ``run`` must stop at the config, before it connects.
NOWHERE = "127.0.0.1:1"
TEAM = {
    "groups": [
        {"name": "billing", "topics": ["trips"], "service": {"endpoints": ["127.0.0.1:50051"]}}
    ]
}


def alias_bomb(levels: int = 7) -> str:
    """The billion laughs: each level a list of ten aliases of the level below (~500 bytes)."""
    lines = ['  l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for level in range(1, levels + 1):
        lines.append(f"  l{level}: &l{level} [" + ", ".join([f"*l{level - 1}"] * 10) + "]")
    head = "x:\n" + "\n".join(lines) + "\n"
    return head + "groups:\n- name: evil\n  topics: [t]\n  service: {endpoints: *l7}\n"


def deep_nesting() -> str:
    return "groups: " + "[" * 5000 + "]" * 5000 + "\n"


def too_large() -> str:
    return "groups: []\n# " + "x" * MAX_FILE_BYTES + "\n"


def too_many_values() -> str:
    return "groups: []\nx: [" + ", ".join(["1"] * (MAX_NODES + 1)) + "]\n"


HOSTILE = [
    ("alias bomb", alias_bomb, "line 2, column 7: refused: anchor &l0 is not allowed"),
    ("deep nesting", deep_nesting, f"refused: nested deeper than {MAX_NESTING} levels"),
    ("too large", too_large, f"larger than {MAX_FILE_BYTES} bytes"),
    ("too many values", too_many_values, f"refused: more than {MAX_NODES} values"),
]


@pytest.mark.parametrize("command", ["validate", "run"])
@pytest.mark.parametrize(
    ("text", "reason"), [case[1:] for case in HOSTILE], ids=[case[0] for case in HOSTILE]
)
def test_a_hostile_yaml_file_is_refused_at_once_with_exit_2_naming_file_and_reason(
    tmp_path: Path, cli: Cli, command: str, text: Callable[[], str], reason: str
) -> None:
    # Given a conf.d directory where one team's file is hostile
    (tmp_path / "kafka.yaml").write_text(yaml.safe_dump({"kafka": {"bootstrap_servers": NOWHERE}}))
    (tmp_path / "billing.yaml").write_text(yaml.safe_dump(TEAM))
    evil = tmp_path / "evil.yaml"
    evil.write_text(text())

    # When the proxy validates or runs it
    started = time.monotonic()
    code, out, err = cli(command, "--config", str(tmp_path))
    elapsed = time.monotonic() - started

    # Then it stops with exit 2 and one line that names the file and the reason, at once
    assert code == 2, out + err
    assert err.splitlines() == [line for line in err.splitlines() if line.startswith(f"{evil}: ")]
    assert len(err.splitlines()) == 1, err
    assert reason in err, err
    assert elapsed < 5, f"{elapsed:.1f} s to refuse it"


def test_a_kafka_section_given_as_a_string_is_rejected_without_echoing_it(
    tmp_path: Path, cli: Cli
) -> None:
    # Given a kafka section written as one string that holds a password
    path = tmp_path / "proxy.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "kafka": f"bootstrap.servers={NOWHERE} sasl.password={SECRET}",
                **TEAM,
            }
        )
    )

    # When it is validated
    code, out, err = cli("validate", "--config", str(path))

    # Then the error names the file and the field, and not the value
    assert code == 2, out + err
    assert err.startswith(f"{path}: kafka: "), err
    assert SECRET not in out + err
