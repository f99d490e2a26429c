"""What the intake answers when it cannot serve a request: `Rejection` and the mapping of the
broker's and the store's errors onto it.

The contract (docs/live.md, "Answers"): a 4xx is the request's fault (no or a wrong token, a
malformed body, id or number, a record a check refuses, something it names that does not
exist: 404), 429 is shedding, 503 a service the intake depends on that cannot serve now (the
broker, the store: the client retries later). A broker or store error is never the request's
fault once its ids and numbers were parsed strictly (`wire.parse_uint`): they are 503s with
the service's words as the detail. Nothing else is a 5xx on purpose: a 500 `internal` is a bug.
"""

from __future__ import annotations

import logging

from specbus.bus.denied import PermissionDenied
from specbus.core.errors import BrokerUnavailable, BusError, StoreDenied
from specbus.producers.live.wire import RecordAnswer

log = logging.getLogger("specbus.intake")


class Rejection(Exception):
    """A request the intake answers with a 4xx/5xx: `code`, machine-readable `reason`, `detail`."""

    def __init__(self, code: int, status: str, reason: str, detail: str = ""):
        super().__init__(f"{code} {reason}: {detail}")
        self.code, self.status, self.reason, self.detail = code, status, reason, detail

    def answer(self) -> RecordAnswer:
        """The body the client gets."""
        return RecordAnswer(status=self.status, reason=self.reason, detail=self.detail[:500])


def rejected(reason: str, detail: str, code: int = 422) -> Rejection:
    """The request's fault (a 4xx)."""
    return Rejection(code, "rejected", reason, detail)


def unavailable(reason: str, detail: str) -> Rejection:
    """A service the intake needs cannot serve now: 503, retry later."""
    return Rejection(503, "unavailable", reason, detail)


def bus_refusal(error: BusError) -> Rejection:
    """The 503 for a broker error: `broker_denied` (the intake's credentials may not do it:
    an operator's fix), `broker_unavailable` (gone for `bus.outage_give_up_s`), `broker_error`
    (any other refusal, the server's words in the detail)."""
    if isinstance(error, PermissionDenied):
        return unavailable("broker_denied", str(error))
    if isinstance(error, BrokerUnavailable):
        return unavailable("broker_unavailable", str(error))
    return unavailable("broker_error", str(error))


def store_refusal(error: Exception) -> Rejection:
    """The 503 for a store failure that is not about the record's keys (those are 422s,
    `Intake._admit`): `store_denied` (the intake's store credentials), `store_unavailable`."""
    if isinstance(error, StoreDenied):
        return unavailable("store_denied", str(error))
    return unavailable("store_unavailable", str(error) or type(error).__name__)


def add_handlers(app, metrics) -> None:
    """Nets under every route of `app`: a broker error no route mapped is still a 503 with a
    reason (`bus_refusal`), a bug a JSON 500 `internal` (logged), never a bare traceback
    page. Both are counted in `metrics` (`IntakeMetrics`)."""
    from fastapi.responses import JSONResponse

    async def broker_error(_request, e: BusError):
        r = bus_refusal(e)
        metrics.count(r.code, r.reason)
        return JSONResponse(r.answer().model_dump(), status_code=r.code)

    async def internal(_request, e: Exception):
        log.error("request failed", exc_info=e)
        metrics.count(500, "internal")
        answer = RecordAnswer(status="unavailable", reason="internal", detail=str(e)[:300])
        return JSONResponse(answer.model_dump(), status_code=500)

    app.add_exception_handler(BusError, broker_error)
    app.add_exception_handler(Exception, internal)
