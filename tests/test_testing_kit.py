"""consumer_proxy.testing: a handler called without a server, its outcome as the proxy sees it."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import grpc
import pytest

from consumer_proxy import handler as cp
from consumer_proxy.testing import HandlerEnvironment, Outcome, classify_status, message


async def acks(_msg: cp.Message) -> None:
    return None


def test_message_has_defaults_and_encodes_text() -> None:
    msg = message("hé", key="k", headers=[("h", "1"), ("h", b"2")], attempt=2)

    assert msg.value == "hé".encode()
    assert msg.key == b"k"
    assert msg.header_values("h") == [b"1", b"2"]
    assert (msg.topic, msg.partition, msg.offset, msg.attempt) == ("test-topic", 0, 0, 2)
    assert msg.source == "primary"
    assert message(None).value is None
    assert message(headers={"a": "b"}).header("a") == b"b"


def test_returning_none_is_an_ack_from_a_sync_test() -> None:
    outcome = HandlerEnvironment(acks).run(message())

    outcome.assert_ack()
    assert (outcome.kind, outcome.status, outcome.code) == ("ack", "OK", grpc.StatusCode.OK)


@pytest.mark.parametrize(
    ("result", "kind", "status"),
    [
        (cp.ack(), "ack", "ACK"),
        (cp.drop(), "drop", "DROP"),
        (cp.retry(after_ms=250, reason="later"), "retry", "RETRY"),
        (cp.dead_letter("bad"), "dead_letter", "DEAD_LETTER"),
    ],
)
async def test_each_result_helper_becomes_its_outcome(
    result: cp.Result, kind: str, status: str
) -> None:
    async def handle(_msg: cp.Message) -> cp.Result:
        return result

    outcome = await HandlerEnvironment(handle).handle(message())

    assert (outcome.kind, outcome.status) == (kind, status)
    assert outcome.reason == result.reason
    assert outcome.retry_after_ms == result.retry_after_ms


async def test_retry_and_dead_letter_assertions_check_their_details() -> None:
    async def handle(msg: cp.Message) -> cp.Result:
        if msg.value == b"later":
            return cp.retry(after_ms=500)
        return cp.dead_letter("schema v3 is not supported")

    env = HandlerEnvironment(handle)
    later = await env.handle(message("later"))
    never = await env.handle(message("v3"))

    later.assert_retry(after_ms=500, counted=True)
    never.assert_dead_letter("schema v3")
    with pytest.raises(AssertionError, match="expected a retry after 100 ms, got retry"):
        later.assert_retry(after_ms=100)
    with pytest.raises(AssertionError, match="expected ack, got dead_letter"):
        never.assert_ack()
    with pytest.raises(AssertionError, match="reason contains 'v4'"):
        never.assert_dead_letter("v4")


@pytest.mark.parametrize(
    ("error", "kind", "counted", "service_failure", "slow_down"),
    [
        (cp.PoisonPill("bad json"), "dead_letter", True, False, False),
        (cp.AlreadyProcessed("dup"), "ack", True, False, False),
        (cp.Overloaded("busy"), "retry", True, False, True),
        (cp.Unavailable("db down"), "retry", False, True, False),
        (cp.HandlerError(grpc.StatusCode.NOT_FOUND, "gone"), "dead_letter", True, False, False),
        (cp.HandlerError(grpc.StatusCode.PERMISSION_DENIED, "no"), "retry", False, True, False),
    ],
)
async def test_raised_errors_go_through_the_status_table(
    error: cp.HandlerError, kind: str, counted: bool, service_failure: bool, slow_down: bool
) -> None:
    async def handle(_msg: cp.Message) -> None:
        raise error

    outcome = await HandlerEnvironment(handle).handle(message())

    assert outcome.kind == kind
    assert outcome.code == error.code
    assert outcome.status == error.code.name
    assert outcome.reason == error.message
    assert (outcome.counted, outcome.service_failure, outcome.slow_down) == (
        counted,
        service_failure,
        slow_down,
    )
    assert outcome.error is error


async def test_any_other_exception_is_a_counted_retry_and_is_kept() -> None:
    boom = KeyError("customer")

    async def handle(_msg: cp.Message) -> None:
        raise boom

    outcome = await HandlerEnvironment(handle).handle(message())

    outcome.assert_retry(counted=True)
    assert outcome.status == "INTERNAL"
    assert outcome.reason == "KeyError: 'customer'"
    assert outcome.error is boom


def test_a_sync_handler_gets_what_the_sdk_answers_it() -> None:
    def handle(_msg: cp.Message) -> None:
        return None

    outcome = HandlerEnvironment(handle).run(message())  # type: ignore[arg-type]

    outcome.assert_retry(counted=True)
    assert "the handler must be async" in outcome.reason


async def test_an_object_with_a_handle_method_and_the_message_it_saw() -> None:
    class Billing:
        def __init__(self) -> None:
            self.seen: list[cp.Message] = []

        async def handle(self, msg: cp.Message) -> cp.Result | None:
            self.seen.append(msg)
            return cp.drop() if msg.source == "redrive" else None

    billing = Billing()
    env = HandlerEnvironment(billing)
    sent = message(b"x", key=None, topic="orders", partition=2, offset=9, source="redrive")

    (await env.handle(sent)).assert_drop()
    assert billing.seen == [sent]  # the wire round trip keeps every field


async def test_a_batch_answers_in_order_and_raised_errors_become_actions() -> None:
    async def handle(msg: cp.Message) -> cp.Result | None:
        if msg.value == b"poison":
            raise cp.PoisonPill("unparseable")
        if msg.value == b"dup":
            raise cp.AlreadyProcessed()
        if msg.value == b"down":
            raise cp.Unavailable("db")
        await asyncio.sleep(0)
        return None

    values = [b"ok", b"poison", b"dup", b"down"]
    outcomes = await HandlerEnvironment(handle).handle_batch(
        [message(v, offset=i) for i, v in enumerate(values)]
    )

    assert [o.kind for o in outcomes] == ["ack", "dead_letter", "ack", "retry"]
    assert outcomes[1].reason == "unparseable"
    assert outcomes[1].code == grpc.StatusCode.INVALID_ARGUMENT
    assert isinstance(outcomes[1].error, cp.PoisonPill)
    outcomes[3].assert_retry(counted=False)  # an outage per message, as in a unary call
    assert outcomes[3].service_failure
    assert outcomes[0].error is None


def test_run_batch_from_a_sync_test() -> None:
    outcomes = HandlerEnvironment(acks).run_batch([message(offset=0), message(offset=1)])

    assert [o.kind for o in outcomes] == ["ack", "ack"]


async def test_a_batch_of_messages_sharing_coordinates_is_refused_with_how_to_fix_it() -> None:
    # Given a batch written with message()'s defaults: every message at t/0/0, so the
    # outcome of one (the error it raised) cannot be told from another's
    async def handle(msg: cp.Message) -> None:
        if msg.value == b"bad":
            raise ValueError("boom")

    env = HandlerEnvironment(handle)
    # When it is run, Then it is refused, saying what to pass (no outcome carrying another
    # message's error)
    with pytest.raises(ValueError, match=r"share coordinates.*offset="):
        await env.handle_batch([message("good"), message("bad")])
    # ... and with distinct offsets each outcome is its own
    good, bad = await env.handle_batch([message("good", offset=0), message("bad", offset=1)])
    assert (good.kind, good.error) == ("ack", None)
    assert bad.kind == "retry" and isinstance(bad.error, ValueError)


@pytest.mark.parametrize(
    ("overrides", "problem"),
    [
        ({"not_found": "drop"}, "not_found"),
        ({"OK": "drop"}, "OK"),
        ({"NOT_FOUND": "x"}, "NOT_FOUND: Input should be 'ack'"),
    ],
)
def test_status_overrides_the_proxy_would_refuse_are_refused(
    overrides: dict[str, str], problem: str
) -> None:
    # Given a status table the proxy refuses to start with, When a test uses it, Then it is
    # refused with the proxy's reason (not a KeyError, nor a table the proxy never runs)
    with pytest.raises(ValueError, match=f"status_overrides: .*{problem}"):
        HandlerEnvironment(acks, status_overrides=overrides)
    with pytest.raises(ValueError, match="status_overrides"):
        classify_status(grpc.StatusCode.NOT_FOUND, status_overrides=overrides)


async def test_status_overrides_are_the_groups() -> None:
    async def handle(_msg: cp.Message) -> None:
        raise cp.HandlerError(grpc.StatusCode.NOT_FOUND, "no such customer")

    env = HandlerEnvironment(handle, status_overrides={"NOT_FOUND": "drop"})

    (await env.handle(message())).assert_drop()


def test_classify_status_reads_the_table() -> None:
    assert classify_status(grpc.StatusCode.DATA_LOSS).kind == "dead_letter"
    assert classify_status(grpc.StatusCode.ABORTED, "race").reason == "race"
    unavailable = classify_status(grpc.StatusCode.UNAVAILABLE)
    assert (unavailable.kind, unavailable.counted) == ("retry", False)
    assert (
        classify_status(grpc.StatusCode.UNAVAILABLE, status_overrides={"UNAVAILABLE": "ack"}).kind
        == "ack"
    )
    with pytest.raises(ValueError, match="OK call"):
        classify_status(grpc.StatusCode.OK)


def test_outcome_reads_well_in_a_failure() -> None:
    outcome = Outcome("retry", "INTERNAL", grpc.StatusCode.INTERNAL, reason="boom", counted=False)

    assert str(outcome) == "retry (INTERNAL), after_ms=0, not counted, reason='boom'"


async def test_run_refuses_a_running_loop() -> None:
    env = HandlerEnvironment(acks)
    pending = message()

    with pytest.raises(RuntimeError, match="cannot be called from a running event loop"):
        env.run(pending)


def test_the_readme_example_runs() -> None:
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"^```python\n(.*?)^```$", readme, re.S | re.M)
    [example] = [b for b in blocks if "consumer_proxy.testing" in b]

    exec(compile(example, "README.md", "exec"), {})  # its asserts are the test
