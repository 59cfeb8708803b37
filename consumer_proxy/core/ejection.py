"""Endpoint ejection: which service instances are in rotation, and when to check their health.

Pure decisions over instance indices ``0 .. n-1`` with an injected clock: no I/O, no asyncio.
The dispatcher reports every call result (:meth:`Ejection.observe`) and every health verdict
(:meth:`Ejection.apply_health`), runs the checks :meth:`Ejection.checks_due` asks for, and
logs and counts the :class:`Change` values it gets back.

The rules (the contract in ``dispatcher``'s docstring, made exact):

- Passive: ``EJECT_AFTER_FAILURES`` service failures in a row eject an instance for
  ``min(EJECT_MAX_S, EJECT_BASE_S * 2**k)``, where k counts its ejections since its last
  success. A success resets both counts. Failures while it is out of rotation eject nothing.
- Active: a NOT_SERVING verdict, or ``FAILED_CHECKS_TO_EJECT`` unreachable verdicts in a row,
  eject an instance in rotation, with no minimum time: it was seen down.
- Return: an ejected instance returns when its last verdict is SERVING and either a check saw
  it down since its ejection or its ejection time is over. With no verdict since a passive
  ejection, it returns when its ejection time is over and it has no health service, or the
  checks are not running (:attr:`Ejection.checking`).
- The last instance in rotation is never ejected: a full outage is the circuit breaker's job.
- Checks: an instance in rotation is checked every ``health_interval_s``; an ejected one at
  once and then every ``ejected_check_interval_s``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "EJECTED_CHECK_INTERVAL_S",
    "EJECT_AFTER_FAILURES",
    "EJECT_BASE_S",
    "EJECT_MAX_S",
    "FAILED_CHECKS_TO_EJECT",
    "HEALTH_INTERVAL_S",
    "Change",
    "Ejection",
    "Instance",
    "Verdict",
    "breaker_hears",
]

EJECT_AFTER_FAILURES = 5
EJECT_BASE_S = 2.0
EJECT_MAX_S = 60.0
HEALTH_INTERVAL_S = 5.0
EJECTED_CHECK_INTERVAL_S = 0.5
FAILED_CHECKS_TO_EJECT = 2  # a check can time out under load; an unreachable instance fails on

Verdict = Literal["serving", "not_serving", "unreachable", "unsupported"]
"""One health check's answer: "unsupported" is an instance without a grpc.health.v1 service."""


@dataclass(slots=True)
class Instance:
    """One instance's ejection state. Read it freely; only :class:`Ejection` changes it."""

    consecutive_failures: int = 0
    ejections: int = 0  # since the last success: the exponent of the next ejection time
    ejected: bool = False
    ejected_until: float = 0.0
    serving: bool | None = None  # the last health verdict since the last ejection, if any
    seen_down: bool = False  # a check failed since the last ejection: SERVING means recovered
    health_supported: bool = True
    failed_checks: int = 0
    next_check: float = 0.0


@dataclass(frozen=True, slots=True)
class Change:
    """Instance ``index`` left rotation (``ejected``) or came back, and why.

    ``duration_s`` is an ejection's minimum time out of rotation (0 for an ejection by a health
    check, which lasts until a check says SERVING); ``out`` is the number of instances out of
    rotation after this change.
    """

    index: int
    ejected: bool
    reason: str
    out: int
    duration_s: float = 0.0


class Ejection:
    """The rotation of ``n`` instances: ejections, returns and the health-check plan.

    ``checking`` says whether the caller runs the health checks; while it does not, an
    instance ejected by its calls returns on its ejection time alone.
    """

    def __init__(
        self,
        n: int,
        clock: Callable[[], float],
        *,
        health_interval_s: float = HEALTH_INTERVAL_S,
        ejected_check_interval_s: float = EJECTED_CHECK_INTERVAL_S,
    ) -> None:
        if n < 1:
            raise ValueError(f"needs at least one instance, got {n}")
        self._clock = clock
        self._health_interval_s = health_interval_s
        self._ejected_interval_s = ejected_check_interval_s
        self.instances: tuple[Instance, ...] = tuple(Instance() for _ in range(n))
        self.ejected = 0
        """Instances out of rotation: always fewer than ``n``."""
        self.checking = False
        self._live: tuple[int, ...] = tuple(range(n))

    def live(self) -> Sequence[int]:
        """The instances in rotation, in index order (never empty)."""
        return self._live

    # -- call results ----------------------------------------------------------------------

    def observe(self, index: int, service_failure: bool, status: str) -> Change | None:
        """One call's result; ``status`` names a service failure in the ejection's reason."""
        instance = self.instances[index]
        if not service_failure:
            instance.consecutive_failures = 0
            instance.ejections = 0
            return None
        instance.consecutive_failures += 1
        if instance.consecutive_failures < EJECT_AFTER_FAILURES or instance.ejected:
            return None
        duration_s = min(EJECT_MAX_S, EJECT_BASE_S * 2**instance.ejections)
        reason = f"{instance.consecutive_failures} {status} in a row"
        change = self._eject(index, reason, duration_s)
        if change is not None:
            instance.ejections += 1
            instance.consecutive_failures = 0
        return change

    # -- health checks ---------------------------------------------------------------------

    def checks_due(self) -> list[int]:
        """The instances to check now."""
        now = self._clock()
        return [i for i, instance in enumerate(self.instances) if instance.next_check <= now]

    def check_delay(self) -> float:
        """Seconds until the next check is due (0 or less: one is due now)."""
        return min(instance.next_check for instance in self.instances) - self._clock()

    def apply_health(self, index: int, verdict: Verdict) -> Change | None:
        """One check's verdict, and the instance's next check. Returns are left to
        :meth:`return_due`, so that a round of verdicts is applied before anyone returns."""
        instance = self.instances[index]
        change = self._verdict(index, verdict)
        interval = self._ejected_interval_s if instance.ejected else self._health_interval_s
        instance.next_check = max(instance.next_check, self._clock() + interval)
        return change

    def _verdict(self, index: int, verdict: Verdict) -> Change | None:
        instance = self.instances[index]
        if verdict == "unsupported":
            instance.health_supported = False
            instance.serving = None
            return None
        instance.health_supported = True
        instance.serving = verdict == "serving"
        instance.failed_checks = 0 if instance.serving else instance.failed_checks + 1
        if instance.ejected:
            instance.seen_down = instance.seen_down or not instance.serving
            return None
        if verdict == "not_serving":
            return self._eject(index, "health check NOT_SERVING")
        if verdict == "unreachable" and instance.failed_checks >= FAILED_CHECKS_TO_EJECT:
            return self._eject(index, f"{instance.failed_checks} health checks failed")
        return None

    # -- ejection and return ---------------------------------------------------------------

    def return_due(self) -> list[Change]:
        """Return the ejected instances that the rules let back into rotation."""
        if not self.ejected:
            return []
        now = self._clock()
        changes = []
        for index, instance in enumerate(self.instances):
            if not instance.ejected:
                continue
            if instance.serving is True and (instance.seen_down or now >= instance.ejected_until):
                changes.append(self._return(index, "health check SERVING", now))
            elif now >= instance.ejected_until and (
                not self.checking  # no checks run (any more): the ejection time alone decides
                or (instance.serving is None and not instance.health_supported)
            ):
                changes.append(self._return(index, "ejection time over", now))
        return changes

    def _eject(self, index: int, reason: str, duration_s: float = 0.0) -> Change | None:
        """Take an instance in rotation out for at least ``duration_s`` (0: it was seen down by
        a check); None when it is the last one in rotation."""
        if self.ejected + 1 >= len(self.instances):
            return None
        instance = self.instances[index]
        now = self._clock()
        instance.ejected = True
        instance.ejected_until = now + duration_s
        instance.seen_down = duration_s == 0  # ejected by a failed check: it was seen down
        if duration_s > 0:
            instance.serving = None  # a check after this ejection decides the return
        instance.next_check = now  # check it at once: is it down, or does it only fail calls?
        self.ejected += 1
        self._rotation_changed()
        return Change(index, True, reason, self.ejected, duration_s)

    def _return(self, index: int, reason: str, now: float) -> Change:
        instance = self.instances[index]
        instance.ejected = False
        instance.failed_checks = 0
        instance.next_check = now + self._health_interval_s
        self.ejected -= 1
        self._rotation_changed()
        return Change(index, False, reason, self.ejected)

    def _rotation_changed(self) -> None:
        self._live = tuple(i for i, instance in enumerate(self.instances) if not instance.ejected)


def breaker_hears(failure: bool | None, ejected: bool) -> bool | None:
    """What the circuit breaker records of one call (unary or batch): ``failure`` is whether
    the call failed for the service's sake (None: it says nothing about the service's health,
    e.g. a batch protocol error). None means the breaker records nothing (a probe is given
    back): a service failure of an instance out of rotation is ejection's business, not a
    group outage; the breaker hears from the instances still in rotation (the last one is
    never ejected)."""
    if failure is None or (failure and ejected):
        return None
    return failure
