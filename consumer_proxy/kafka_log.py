"""librdkafka's log lines and errors, told as state changes instead of a flood.

While a broker is down, librdkafka reports every failed connection attempt of every client
(``FAIL`` log lines, ``_TRANSPORT`` and ``_ALL_BROKERS_DOWN`` errors): dozens of identical
lines a second. A :class:`KafkaLogGate` stands between one client and the Python logger
(``logger=`` and ``error_cb`` of Consumer, Producer and AdminClient) and says instead:

- ``<client>: Kafka unreachable since 18:01:02 UTC: <first error>``, once;
- ``<client>: Kafka still unreachable after 60 s (143 connection errors suppressed)`` at most
  every ``remind_s``;
- ``<client>: Kafka reachable again after 19 s (210 connection errors suppressed)`` once the
  client shows a broker connection up (its statistics) or an operation succeeded
  (``reachable()``). Connection failures within ``settle_s`` after that are counted, not
  told: librdkafka may serve a queued line from before the recovery after it.

Any other line that repeats identically (digits aside) within ``window_s`` is suppressed and
counted; the count is said when the line next gets through. Debug lines (librdkafka's
``debug`` setting) pass untouched: whoever turned them on wants them all.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from confluent_kafka import KafkaError

CONNECTION_FACILITIES = frozenset({"FAIL"})
"""librdkafka log facilities that report a failed broker connection."""
CONNECTION_ERRORS = frozenset(
    {KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN, KafkaError._RESOLVE}
)
"""librdkafka error codes (``error_cb``) that report a failed broker connection."""
STATS_INTERVAL_MS = 5000
"""How often a client's statistics arrive (they carry the "reachable again" signal): building
and parsing them is most of what an idle client costs in Python."""
CONSUMER_STATS_INTERVAL_MS = 15000
"""... for a group's consumer, one per group: its statistics were a sixth of an idle proxy's
CPU at 5 s (40 groups, ``bench_idle.py``). They are the slow path of its reachability: a
rebalance callback or a commit says "reachable" at once, librdkafka's "all brokers down"
says the opposite at once (``health.KafkaLink``)."""
_DECODER = json.JSONDecoder()
_last_parsed: tuple[str, dict[str, str] | None] = ("", None)
_MAX_KEYS = 256  # distinct lines remembered for repeat suppression
_DIGITS = re.compile(r"\d+")


class KafkaLogGate:
    """A ``logger=`` / ``error_cb`` / ``stats_cb`` for one librdkafka client (thread-safe).

    ``client`` names the client in every line (``group billing consumer``). ``clock`` (seconds,
    monotonic) and ``wall`` (epoch seconds) are injectable for tests.
    """

    def __init__(
        self,
        log: logging.Logger,
        client: str,
        *,
        remind_s: float = 60.0,
        window_s: float = 60.0,
        settle_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._log = log
        self.client = client
        self._remind_s = remind_s
        self._window_s = window_s
        self._settle_s = settle_s
        self._up_at: float | None = None  # when Kafka was last found reachable again
        self._clock = clock
        self._wall = wall
        self._lock = threading.Lock()
        self._down_since: float | None = None
        self._reminded = 0.0
        self._suppressed = 0  # connection errors not logged since the last line about them
        self._repeats: OrderedDict[str, list[float]] = OrderedDict()  # key -> [said at, count]
        self.suppressed_total = 0
        """Every line and error kept out of the log so far (tests, curiosity)."""

    @property
    def unreachable_since(self) -> float | None:
        """``clock()`` when Kafka became unreachable for this client; None while reachable."""
        return self._down_since

    def attach(self, conf: dict[str, Any]) -> dict[str, Any]:
        """Route a client configuration's errors and statistics through this gate.

        Sets ``error_cb``; adds statistics (a user's ``statistics.interval.ms`` wins, 0 turns
        the "reachable again" signal from them off); chains any ``error_cb`` and ``stats_cb``
        already there.
        Returns ``conf``; pass the gate itself as ``logger=``.
        """
        previous_error = conf.get("error_cb")
        if previous_error is None:
            conf["error_cb"] = self.error
        else:

            def on_error(err: KafkaError) -> None:
                self.error(err)
                previous_error(err)

            conf["error_cb"] = on_error
        conf.setdefault("statistics.interval.ms", STATS_INTERVAL_MS)
        previous = conf.get("stats_cb")

        def on_stats(raw: str) -> None:
            self.on_stats(raw)
            if previous is not None:
                previous(raw)

        conf["stats_cb"] = on_stats
        return conf

    # -- inputs ------------------------------------------------------------------------

    def log(self, level: int, msg: str, *args: Any, **_kwargs: Any) -> None:
        """The ``logging.Logger.log`` interface librdkafka's ``logger=`` calls."""
        text = msg % args if args else msg
        if level < logging.INFO:
            self._log.log(level, "%s", text)
            return
        # A FAIL at info level is a routine disconnect (e.g. the broker closed an idle
        # connection), not an outage.
        if level >= logging.WARNING and text.split(" ", 1)[0] in CONNECTION_FACILITIES:
            self.unreachable(_strip_facility(text))
            return
        self.say(level, text)

    def error(self, err: KafkaError) -> None:
        """The ``error_cb``: connection errors change the state, others are logged once."""
        if err.code() in CONNECTION_ERRORS:
            self.unreachable(err.str())
            return
        level = logging.ERROR if err.fatal() else logging.WARNING
        self.say(level, f"{err.name()}: {err.str()}")

    def on_stats(self, raw: str) -> None:
        """librdkafka statistics: a broker connection that is UP means Kafka is reachable."""
        states = broker_states(raw)
        if states and any(state == "UP" for state in states.values()):
            self.reachable()

    # -- state ---------------------------------------------------------------------------

    def unreachable(self, detail: str) -> None:
        """A broker connection failed: say so once, then only remind every ``remind_s``."""
        with self._lock:
            now = self._clock()
            if self._down_since is None and (
                self._up_at is not None and now - self._up_at < self._settle_s
            ):
                # librdkafka serves queued log lines after newer statistics: a failure
                # reported right after the recovery is most likely from before it.
                self.suppressed_total += 1
                return
            if self._down_since is None:
                self._down_since = self._reminded = now
                self._suppressed = 0
                since = time.strftime("%H:%M:%S UTC", time.gmtime(self._wall()))
                self._log.warning("%s: Kafka unreachable since %s: %s", self.client, since, detail)
                return
            self._suppressed += 1
            self.suppressed_total += 1
            if now - self._reminded >= self._remind_s:
                self._log.warning(
                    "%s: Kafka still unreachable after %.0f s (%d connection errors "
                    "suppressed): %s",
                    self.client,
                    now - self._down_since,
                    self._suppressed,
                    detail,
                )
                self._reminded = now
                self._suppressed = 0

    def reachable(self) -> None:
        """The client reached Kafka (a connection is up, or an operation succeeded)."""
        if self._down_since is None:  # the common case, without the lock
            return
        with self._lock:
            if self._down_since is None:
                return
            self._log.info(
                "%s: Kafka reachable again after %.0f s (%d connection errors suppressed)",
                self.client,
                self._clock() - self._down_since,
                self._suppressed,
            )
            self._down_since = None
            self._suppressed = 0
            self._up_at = self._clock()

    def say(self, level: int, text: str) -> None:
        """Log ``text`` for this client, unless it repeats a line said within ``window_s``."""
        key = f"{level}:{_DIGITS.sub('#', text)}"
        with self._lock:
            now = self._clock()
            seen = self._repeats.get(key)
            if seen is not None and now - seen[0] < self._window_s:
                seen[1] += 1
                self.suppressed_total += 1
                return
            repeats = int(seen[1]) if seen is not None else 0
            self._repeats[key] = [now, 0]
            self._repeats.move_to_end(key)
            while len(self._repeats) > _MAX_KEYS:
                self._repeats.popitem(last=False)
        if repeats:
            self._log.log(
                level,
                "%s: %s (and %d identical lines suppressed in the last %.0f s)",
                self.client,
                text,
                repeats,
                now - seen[0] if seen is not None else 0.0,
            )
        else:
            self._log.log(level, "%s: %s", self.client, text)


def _strip_facility(text: str) -> str:
    # "FAIL [rdkafka#consumer-1] [thrd:host:9092/bootstrap]: host:9092/bootstrap: Connect to
    # ... failed" -> "host:9092/bootstrap: Connect to ... failed"
    _, sep, rest = text.partition("]: ")
    return rest if sep else text


def broker_states(raw: str) -> dict[str, str] | None:
    """{broker name: connection state} from a librdkafka statistics JSON; None if unreadable.

    Decodes only the ``brokers`` object (the topics and partitions after it are most of the
    text), and once per statistics string: a consumer's gate and its health link both read the
    same one on the same thread.
    """
    global _last_parsed
    last_raw, last_states = _last_parsed
    if raw is last_raw:
        return last_states
    states: dict[str, str] | None = None
    try:
        start = raw.find('"brokers":')
        if start >= 0:
            brokers, _end = _DECODER.raw_decode(raw, raw.index("{", start))
            if isinstance(brokers, dict):
                states = {
                    str(name): str(b.get("state")) if isinstance(b, dict) else "?"
                    for name, b in brokers.items()
                }
        else:
            found = json.loads(raw).get("brokers")
            states = {} if found is None else None
    except (ValueError, AttributeError):
        states = None
    _last_parsed = (raw, states)
    return states
