"""Commit-metadata codec: round trips, offsets near 2**63, and refusing what is not ours."""

from __future__ import annotations

import base64
import zlib
from itertools import groupby

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from consumer_proxy.core.codec import MAX_OFFSET_END, PREFIX, AckState, CodecError, decode, encode
from tests.support.records import foreign_ack_state

# No per-example deadline: the suite shares small CI boxes, where a descheduled process would
# otherwise fail an example for being slow rather than wrong.
relaxed = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])


def state_from_flags(base: int, done_flags: list[bool]) -> AckState:
    """Build the state whose offsets base, base+1, ... are done as given (first is pending)."""
    return AckState(base, tuple(len(list(group)) for _, group in groupby(done_flags)))


@st.composite
def ack_states(draw: st.DrawFn) -> AckState:
    """Random run patterns: short and long runs, bases anywhere in the int64 range."""
    runs = draw(
        st.lists(
            st.one_of(st.integers(1, 3), st.integers(1, 200), st.integers(1, 2**40)),
            max_size=300,
        )
    )
    total = sum(runs)
    base = draw(st.integers(0, MAX_OFFSET_END - 1 - total))
    epoch = draw(st.one_of(st.none(), st.integers(0, 2**31 - 1)))
    return AckState(base, tuple(runs), epoch)


@st.composite
def flag_patterns(draw: st.DrawFn) -> tuple[int, list[bool]]:
    """A base and a per-offset done flag list whose first offset is pending."""
    base = draw(st.one_of(st.integers(0, 10**12), st.integers(MAX_OFFSET_END - 10_000, 2**63 - 2)))
    rest = draw(st.lists(st.booleans(), max_size=min(2000, MAX_OFFSET_END - base - 1)))
    return base, [False, *rest]


@relaxed
@given(ack_states())
def test_decode_inverts_encode(state: AckState) -> None:
    # Given any ack state / When it is encoded and decoded / Then nothing is lost or added.
    text = encode(state)
    assert decode(text) == state
    assert text.isascii() and text.isprintable()


@relaxed
@given(flag_patterns())
def test_round_trip_preserves_every_offsets_done_flag(pattern: tuple[int, list[bool]]) -> None:
    # Given a pending/done pattern over consecutive offsets
    base, flags = pattern
    state = state_from_flags(base, flags)

    # When it goes through the metadata string
    restored = decode(encode(state))

    # Then every offset reads back as it was; committed ones are done, later ones are not.
    assert [restored.is_done(base + i) for i in range(len(flags))] == flags
    assert restored.is_done(base - 1)
    assert not restored.is_done(base + len(flags))


def test_the_leader_epoch_travels_and_states_without_one_keep_the_first_format() -> None:
    with_epoch = encode(AckState(10, (1, 3, 2, 1), epoch=7))
    without = encode(AckState(10, (1, 3, 2, 1)))
    assert decode(with_epoch).epoch == 7 and decode(without).epoch is None
    assert with_epoch[3].isupper() and without[3].islower()  # older readers refuse the former
    assert decode(with_epoch).runs == decode(without).runs


def test_is_done_follows_the_runs() -> None:
    # Given offsets 100 pending, 101-102 done, 103-105 pending, 106 done
    state = AckState(100, (1, 2, 3, 1))

    # Then is_done answers per offset, with committed offsets done and the unknown tail not
    assert state.end == 107
    assert [o for o in range(95, 112) if state.is_done(o)] == [95, 96, 97, 98, 99, 101, 102, 106]


def test_offsets_at_the_top_of_the_int64_range_round_trip() -> None:
    # Given a state whose last done offset is the largest Kafka offset
    state = AckState(2**63 - 4, (1, 3))

    # When it is encoded and decoded / Then it is intact
    assert decode(encode(state)) == state
    assert state.end == MAX_OFFSET_END
    assert state.is_done(2**63 - 1)


def test_states_past_the_int64_range_are_rejected() -> None:
    # A state cannot describe offsets Kafka cannot have.
    with pytest.raises(ValueError, match="past the largest"):
        AckState(2**63 - 2, (1, 2))
    with pytest.raises(ValueError, match="not a Kafka offset"):
        AckState(-1)
    with pytest.raises(ValueError, match="positive"):
        AckState(0, (1, 0, 1))


def test_every_string_starts_with_the_version_prefix() -> None:
    # Given an encoded state / Then it announces format version 1
    assert encode(AckState(7, (1, 1))).startswith(PREFIX)
    assert PREFIX == "cp1"


def test_another_version_is_refused_by_name() -> None:
    # Given a string that would be valid if it said version 1, but says version 2
    text = "cp2" + encode(AckState(7, (1, 1)))[len(PREFIX) :]

    # When it is decoded / Then the version is the reason given
    with pytest.raises(CodecError, match="version"):
        decode(text)


@pytest.mark.parametrize(
    "metadata",
    [
        None,
        "",
        "cp1",
        "cp1r",
        "cp1x00000",
        '{"owner": "some-other-tool", "ts": 1712345678}',
        "checkpoint-42",
        "cp1r\u00e9\u00e9\u00e9\u00e9\u00e9",
        "cp1r" + base64.b85encode(b"\x00\x01\x02").decode(),
        "cp1z" + base64.b85encode(zlib.crc32(b"").to_bytes(4, "big") + b"\xff\xff").decode(),
    ],
)
def test_foreign_and_garbage_metadata_is_refused(metadata: str | None) -> None:
    # Given metadata we did not write / When decoded / Then CodecError, so callers redeliver
    with pytest.raises(CodecError):
        decode(metadata)


@relaxed
@given(st.text(max_size=200))
def test_random_text_is_refused(text: str) -> None:
    # Given arbitrary text that is not our prefix
    assume(not text.startswith(PREFIX))

    # Then it is never mistaken for an ack state
    with pytest.raises(CodecError):
        decode(text)


@relaxed
@given(st.sampled_from("rz"), st.binary(max_size=300))
def test_random_payload_behind_our_prefix_is_refused(flag: str, payload: bytes) -> None:
    # Given our prefix followed by well-formed base85 of random bytes
    text = PREFIX + flag + base64.b85encode(payload).decode()

    # Then the checksum (or the structure) rejects it
    with pytest.raises(CodecError):
        decode(text)


@relaxed
@given(ack_states(), st.data())
def test_any_single_character_change_is_detected(state: AckState, data: st.DataObject) -> None:
    # Given a valid encoding with one character replaced
    text = encode(state)
    index = data.draw(st.integers(0, len(text) - 1))
    replacement = data.draw(st.characters(codec="ascii").filter(lambda c: c != text[index]))
    corrupted = text[:index] + replacement + text[index + 1 :]

    # When decoded / Then it is refused rather than read as some other state
    with pytest.raises(CodecError):
        decode(corrupted)


def test_body_that_does_not_add_up_is_refused() -> None:
    # Given a correctly checksummed body whose runs (1, 1) do not match its length 5
    body = bytes([10, 5, 1, 1])
    text = "cp1r" + base64.b85encode(zlib.crc32(body).to_bytes(4, "big") + body).decode()

    # Then it is refused
    with pytest.raises(CodecError, match="add up"):
        decode(text)


def test_a_state_of_more_runs_than_a_window_holds_is_refused_before_it_is_built() -> None:
    # Given commit metadata someone else wrote: 4 KiB that inflate to 2 million runs (the
    # proxy's own hold at most two a window offset), and the same shape within a window
    bomb, fits = foreign_ack_state(100, [1] * 2_000_000), foreign_ack_state(100, [1] * 2_000)
    assert len(bomb) < 4096

    # Then read for a window of 1,000 offsets, the bomb is refused (its runs never held in
    # memory: the inflating stops at the window's bound), and what fits is read
    with pytest.raises(CodecError, match="inflates past"):
        decode(bomb, max_runs=2 * 1_000 + 2)
    assert len(decode(fits, max_runs=2 * 1_000 + 2).runs) == 2_000
    # (read with no bound, as the DLQ tools read their marks, it still decodes)
    assert len(decode(bomb).runs) == 2_000_000


def test_compression_is_used_when_it_is_smaller() -> None:
    # Given a long regular pattern (every other offset done) and a short irregular one
    regular = AckState(1_000_000, (1,) * 2000)
    short = AckState(1_000_000, (3, 250))

    # When encoded
    regular_text, short_text = encode(regular), encode(short)

    # Then the regular one is deflated and far smaller than one byte per run; the short one,
    # where deflate would only add overhead, is stored raw
    assert regular_text[len(PREFIX)] == "z"
    assert len(regular_text) < 200
    assert short_text[len(PREFIX)] == "r"
    assert decode(regular_text) == regular
    assert decode(short_text) == short


def raw_form(state: AckState) -> str:
    """The uncompressed encoding, written out independently of the codec."""
    body = bytearray()
    epoch = () if state.epoch is None else (state.epoch,)
    for value in (*epoch, state.base, state.end - state.base, *state.runs):
        while value >= 0x80:
            body.append(value & 0x7F | 0x80)
            value >>= 7
        body.append(value)
    flag = "r" if state.epoch is None else "R"
    return "cp1" + flag + base64.b85encode(zlib.crc32(body).to_bytes(4, "big") + body).decode()


@relaxed
@given(ack_states())
def test_the_smaller_form_is_chosen(state: AckState) -> None:
    # Given any state / When encoded
    text = encode(state)

    # Then it is the documented raw form, or a deflated form that is no longer than it
    raw = raw_form(state)
    assert text == raw or (text.startswith(("cp1z", "cp1Z")) and len(text) <= len(raw))


@relaxed
@given(flag_patterns(), st.integers(-5, 2010))
def test_next_pending_is_the_first_offset_not_done(
    pattern: tuple[int, list[bool]], delta: int
) -> None:
    # Given a state and any offset near it
    base, flags = pattern
    state = state_from_flags(base, flags)
    offset = max(0, base + delta)

    # When asked for the next offset to deliver / Then it is the first one not done
    expected = offset
    while state.is_done(expected):
        expected += 1
    assert state.next_pending(offset) == expected
