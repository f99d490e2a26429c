"""Permission refusals by the broker, turned into an error instead of a silent wait.

A NATS server that refuses a publish or a subscribe for the connection's user answers with
an asynchronous `-ERR 'Permissions Violation for Publish to "<subject>"'` and drops the
message: a request to that subject gets no answer, a pull request no delivery. Without more,
a role publishing where it may not would wait for an answer until `bus.outage_give_up_s`.

`Denials` collects the refusals the connection's error callback sees; `take()` returns the
oldest one not reported yet. `bus.outage.ride` checks it whenever an operation got no answer
(so a refused request fails after one timeout, `bus.connect_timeout_s`, with
`PermissionDenied` naming the user's subject), and so do `Leases.fetch` and the confirmed
acks. A refused fire-and-forget publish (an ack, a heartbeat) is reported by the next bus call
of that connection that waits for an answer.
"""

from __future__ import annotations

import re
from collections import deque

from specbus.core.errors import BusError

_VIOLATION = re.compile(r'permissions violation for (publish|subscription) to "?([^"\s\']+)', re.I)


class PermissionDenied(BusError):
    """The broker refused this connection's user a publish or a subscription: the role's
    credentials do not allow it (`specbus auth` says which role may do what)."""

    def __init__(self, message: str, *, operation: str, subject: str):
        super().__init__(message)
        self.operation = operation  # "publish" or "subscription"
        self.subject = subject


def parse_violation(text: str) -> tuple[str, str] | None:
    """(operation, subject) of a server's permissions-violation error text, else None."""
    m = _VIOLATION.search(text)
    return (m.group(1).lower(), m.group(2)) if m else None


class Denials:
    """Refusals seen on one connection, reported once each."""

    def __init__(self, who: str):
        self.who = who  # the connection's name (and user), for the message
        self._seen: deque[tuple[str, str]] = deque(maxlen=64)

    def add(self, text: str) -> bool:
        """Record a server error if it is a permissions violation; True if it was one."""
        found = parse_violation(text)
        if found is None:
            return False
        self._seen.append(found)
        return True

    def __bool__(self) -> bool:
        return bool(self._seen)

    def take(self) -> PermissionDenied | None:
        """The oldest unreported refusal as an error (the rest stay for later calls)."""
        if not self._seen:
            return None
        operation, subject = self._seen.popleft()
        return PermissionDenied(
            f"permission denied: the broker refused {self.who} a {operation} to {subject!r} "
            "(these credentials' role may not do that; see `specbus auth`)",
            operation=operation,
            subject=subject,
        )
