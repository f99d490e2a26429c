"""nats exceptions -> specbus bus errors, at the bus boundary.

Nothing outside `bus/` sees a nats exception: every broker call goes through `bus.outage.ride`
or `send`, which raise `wrap(e)` for a failure that is not transient. The server's words
(status, JetStream error code, description) are kept on the `BusError`, the nats exception is
its `__cause__`.
"""

from __future__ import annotations

import nats.errors
import nats.js.errors
from specbus.core.errors import BusError, BusNotFound, BusRejected, SpecbusError


def wrap(
    error: BaseException, what: str, *, stream: str | None = None, seq: int | None = None
) -> BaseException:
    """The `BusError` for a nats failure while `what` (`BusNotFound` for a 404, `BusRejected`
    for a 400); specbus errors and anything that is not a nats error come back unchanged."""
    if isinstance(error, SpecbusError) or not isinstance(error, nats.errors.Error):
        return error
    if isinstance(error, nats.js.errors.APIError):
        cls = (
            BusNotFound
            if isinstance(error, nats.js.errors.NotFoundError)
            else BusRejected
            if isinstance(error, nats.js.errors.BadRequestError)
            else BusError
        )
        # KV errors skip APIError.__init__: read every field defensively.
        code, err_code = getattr(error, "code", None), getattr(error, "err_code", None)
        description = getattr(error, "description", None) or str(error).strip()
        return cls(
            f"{what}: {description or type(error).__name__} (code {code}, err_code {err_code})",
            code=code if code is not None else (404 if cls is BusNotFound else None),
            err_code=err_code,
            description=description,
            stream=stream or getattr(error, "stream", None),
            seq=seq if seq is not None else getattr(error, "seq", None),
        )
    text = str(error).strip()
    return BusError(f"{what}: {type(error).__name__}" + (f": {text}" if text else ""),
                    stream=stream, seq=seq)  # fmt: skip


def status_error(
    what: str, status: str, description: str, *, stream: str | None = None
) -> BusError:
    """The `BusError` for a status message the server sent instead of a delivery
    ("409 Consumer Deleted", ...)."""
    code = int(status) if status.isdigit() else None
    cls = BusNotFound if code == 404 else BusError
    return cls(f"{what}: {status} {description}".strip(), code=code, description=description,
               stream=stream)  # fmt: skip
