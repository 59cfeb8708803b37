"""The DLQ record format: user headers kept in order, cp-* headers added as UTF-8 text."""

from __future__ import annotations

from consumer_proxy.core import records as dlq_records


def test_dlq_headers_keep_user_headers_and_add_the_contract_headers() -> None:
    user = [("trace", b"\x00\xff binary"), ("trace", b"second"), ("empty", b"")]
    origin = dlq_records.Origin("orders", 3, 42, 1700000000000, 0)
    headers = dlq_records.dlq_headers(
        user,
        origin,
        attempt=5,
        status="INVALID_ARGUMENT",
        reason="x" * 3000,
        endpoint="10.0.0.1:50051",
        group="billing",
        now_ms=1700000001234,
    )
    assert headers[:3] == user  # order and repeats preserved, binary untouched
    ours = dict(headers[3:])
    assert ours == {
        dlq_records.H_TOPIC: b"orders",
        dlq_records.H_PARTITION: b"3",
        dlq_records.H_OFFSET: b"42",
        dlq_records.H_TIMESTAMP: b"1700000000000",
        dlq_records.H_ATTEMPT: b"5",
        dlq_records.H_STATUS: b"INVALID_ARGUMENT",
        dlq_records.H_REASON: b"x" * 1024,
        dlq_records.H_ENDPOINT: b"10.0.0.1:50051",
        dlq_records.H_GROUP: b"billing",
        dlq_records.H_DEAD_LETTERED_AT: b"1700000001234",
    }


def test_split_headers_round_trips_a_dlq_record_to_its_origin() -> None:
    origin = dlq_records.Origin("orders", 3, 42, 1700000000000, 0)
    headers = dlq_records.dlq_headers(
        [("k", b"v")],
        origin,
        attempt=2,
        status="DEAD_LETTER",
        reason="r",
        endpoint="e",
        group="g",
    )
    user, ours = dlq_records.split_headers(headers)
    assert user == [("k", b"v")]
    assert dlq_records.origin_from_headers(ours) == dlq_records.Origin(
        "orders", 3, 42, 1700000000000, 2
    )


def test_split_headers_accepts_none_values_and_dicts() -> None:
    user, ours = dlq_records.split_headers([("a", None), ("cp-attempt", b"3")])
    assert user == [("a", b"")] and ours == {"cp-attempt": "3"}
    assert dlq_records.split_headers(None) == ([], {})
    assert dlq_records.split_headers({"x": "text"}) == ([("x", b"text")], {})


def test_incomplete_origin_headers_are_not_an_origin() -> None:
    assert dlq_records.origin_from_headers({dlq_records.H_TOPIC: "t"}) is None
    assert (
        dlq_records.origin_from_headers(
            {dlq_records.H_TOPIC: "t", dlq_records.H_PARTITION: "x", dlq_records.H_OFFSET: "1"}
        )
        is None
    )
