"""The specbus error hierarchy.

Every error raised on purpose by specbus derives from `SpecbusError`. Errors wrapping a
library failure keep it as `__cause__` (`raise ... from e`). Errors caused by user input also
derive from `ValueError` and name the offending key and value.
"""

from __future__ import annotations


class SpecbusError(Exception):
    """Root of every error specbus raises on purpose."""


class ConfigError(SpecbusError, ValueError):
    """A run configuration, override or CLI flag is invalid. The message names the key."""


class RecordError(SpecbusError, ValueError):
    """A wire record (SampleRef, PromptTask, ...) is malformed, oversize or of another schema.

    `reason` is a short machine-readable tag used as the dead-letter reason.
    """

    def __init__(self, message: str, reason: str = "invalid"):
        super().__init__(message)
        self.reason = reason


class BusError(SpecbusError):
    """The broker refused or failed an operation.

    Keeps the server's words when it answered, as nats.py's `APIError` does: `code` (the
    status, e.g. 404, 503), `err_code` (JetStream's error code, e.g. 10059 "stream not
    found"), `description`; and what it concerned: `stream`, `seq`. Any of them is None when
    unknown. The nats exception, if any, is the `__cause__` (bus/errors.py wraps them).
    """

    def __init__(
        self,
        message: str,
        *,
        code: int | None = None,
        err_code: int | None = None,
        description: str | None = None,
        stream: str | None = None,
        seq: int | None = None,
    ):
        super().__init__(message)
        self.code, self.err_code, self.description = code, err_code, description
        self.stream, self.seq = stream, seq


class BusNotFound(BusError):
    """What an operation names does not exist on the broker (404): a stream, a consumer, a KV
    bucket or key, a stored message."""


class BusRejected(BusError):
    """The broker understood a request and refused it (400, a publish with no stream or over a
    limit, a change the server cannot apply in place)."""


class BrokerUnavailable(BusError):
    """The broker did not answer for `bus.outage_give_up_s`: the ride-through gave up.

    Raised by any bus operation once an outage has lasted that long (`bus/outage.py`); the
    message names the broker, the operation and how long it was gone, the cause is the last
    transport error (None when the connection was simply down). Shorter outages never raise.
    """


class StoreError(SpecbusError):
    """A feature store operation failed."""


class FeatureMissing(StoreError, KeyError):
    """A feature's bytes are not in the store (released, superseded, node lost, never put).

    `key` names the missing object. Callers treat it as "recapture this sample".
    """

    def __init__(self, key: str, detail: str = ""):
        super().__init__(
            f"feature {key!r} is missing from the store" + (f": {detail}" if detail else "")
        )
        self.key = key

    def __str__(self) -> str:  # KeyError would repr() the message
        return self.args[0]


class StoreFull(StoreError):
    """A put would exceed the store's byte budget. Callers treat it as backpressure."""


class StoreNoSpace(StoreFull):
    """The filesystem under a file-backed store (shm://) has no room for a put, whatever the
    budget says: `directory`, `needed` (the sample's bytes) and `free` (the filesystem's free
    bytes after the failed put was cleaned up) name the shortfall. Nothing of the put stays
    behind. A `StoreFull`, so callers back off as for the budget; the cure is a larger
    filesystem (Docker: `--shm-size`) or a `store.budget_bytes` that fits in it.
    """

    def __init__(self, message: str, *, directory: str, needed: int, free: int):
        super().__init__(message)
        self.directory = directory
        self.needed = needed
        self.free = free


class IntegrityError(StoreError):
    """Stored bytes do not match their spec (CRC mismatch, short read, NaN/Inf at put)."""


class StoreUnavailable(StoreError):
    """The store's service (Mooncake master or store node) cannot be reached right now.

    Transient by nature: callers retry later (a trainer naks with a delay), unlike
    `FeatureMissing`, which means the bytes are gone and the sample must be recaptured.
    """


class StoreDenied(ConfigError):
    """The store refused this client's credentials (http://: a wrong or missing bearer
    token). A configuration error, never retried: `store.http.token` (or
    `SPECBUS_STORE_TOKEN`) must be the same for the producers and the trainers."""


class CaptureError(SpecbusError):
    """The target engine failed to capture a sample (the task is retried, then dead-lettered)."""


class CheckpointError(SpecbusError):
    """A checkpoint is missing, corrupt, or does not match the run it should resume."""


class ExportError(SpecbusError):
    """An exported draft would not load as intended (missing/extra tensor names, bad config)."""
