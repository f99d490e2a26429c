"""The live capture wire: the handshake document and the capture record, as pydantic models.

A capture-enabled serving server (the capture sink in it) GETs `CaptureConfig` from the
intake once (`GET /v1/spec-capture/config`), puts each captured request's tensors into the
feature store the handshake names, then POSTs one `CaptureRecord` naming them
(`POST /v1/spec-capture/records`). The server knows no algorithm: layers, feature names,
shapes, dtype and limits all come from the handshake.

Rows of a capture are the tokens the target was fed: the prompt, then every generated token
but the last (`prompt + output[:-1]`), one row per token, prefill and decode alike. The loss
mask supervises the generated rows (1) and not the prompt (0).

Records are strict (unknown fields and another `schema_version` are rejected: a newer writer
is refused, never half-read). Decisions are pure functions of the request id, so every
tensor-parallel rank of a server (and a retry of the same request) agrees:
`capture_decision(request_id, rate)` and `sample_id_of(request_id)`.

A *driven* request id (`driven_rid`: `specbus-task:<TASKS seq>:<task sample id>`, sent by a
producer on `target.engine: sglang_server`) is always captured, and its sample id is the
task's own (`<task_id>-e<epoch>`), so a retried request publishes under the same dedup id.
"""

from __future__ import annotations

import hashlib
import math
import re
import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from specbus.core.contracts import DType, FeatureSpec

CAPTURE_SCHEMA_VERSION = 1
CONFIG_PATH = "/v1/spec-capture/config"
RECORDS_PATH = "/v1/spec-capture/records"
_ID = re.compile(r"[A-Za-z0-9_:=+-][A-Za-z0-9._:=+-]{0,127}")  # no leading dot (a path)


class Wire(BaseModel):
    """Base of the wire models: frozen, strict, unknown fields refused."""

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")


class FeatureDecl(Wire):
    """One tensor a capture carries: `shape` entries are ints or "L" (the capture's rows)."""

    name: str
    shape: tuple[int | Literal["L"], ...]
    dtype: DType
    # where its values come from: "input_ids", "loss_mask", "aux" (the aux layers' outputs,
    # concatenated in `aux_layers` order) or "final" (the last layer's post-norm hidden state)
    source: Literal["input_ids", "loss_mask", "aux", "final"]

    def resolve(self, rows: int) -> tuple[int, ...]:
        """The concrete shape of a capture of `rows` rows."""
        return tuple(rows if d == "L" else int(d) for d in self.shape)


class CaptureConfig(Wire):
    """The handshake (`GET /v1/spec-capture/config`): everything a sink needs."""

    schema_version: int = CAPTURE_SCHEMA_VERSION  # of the records this intake accepts
    run_id: str
    store_uri: str
    store_id: str
    store_budget_bytes: int  # the sink's store handle checks puts against it
    strategy: str
    features: tuple[FeatureDecl, ...]
    aux_layers: tuple[int, ...]  # 0-based decoder layers whose outputs are captured
    hidden_size: int
    dtype: DType  # of the float features
    min_num_tokens: int  # generated (supervised) rows a capture needs at least
    max_num_tokens: int  # rows a capture holds at most (longer ones are cut to the first rows)
    sample_rate: float
    loss_mask: Literal["generated"] = "generated"  # generated rows 1, prompt rows 0
    target_fingerprint: str
    tokenizer_fingerprint: str
    record_timeout_s: float  # how long a sink waits for the intake's answer before dropping
    max_record_bytes: int


class CaptureRecord(Wire):
    """One captured request (`POST /v1/spec-capture/records`): names its tensors in the store."""

    schema_version: int = CAPTURE_SCHEMA_VERSION
    run_id: str
    request_id: str = Field(min_length=1, max_length=256)
    sample_id: str
    store_uri: str
    features: dict[str, FeatureSpec]
    num_tokens: int = Field(ge=1)  # rows
    num_prompt_tokens: int = Field(ge=0)
    target_fingerprint: str
    tokenizer_fingerprint: str
    server_id: str = Field(min_length=1, max_length=128)
    engine: str = Field(min_length=1, max_length=64)
    created_at: float = Field(default_factory=time.time)
    # speculative serving: the version (checkpoint step) of the draft that decoded the request
    draft_version: int | None = Field(None, ge=0)

    @field_validator("schema_version")
    @classmethod
    def _known_version(cls, v: int) -> int:
        if v != CAPTURE_SCHEMA_VERSION:
            raise ValueError(f"schema_version {v} is not {CAPTURE_SCHEMA_VERSION}")
        return v

    @field_validator("sample_id")
    @classmethod
    def _sample_id(cls, v: str) -> str:
        if not _ID.fullmatch(v):
            raise ValueError(
                f"sample_id {v[:80]!r} is not [A-Za-z0-9._:=+-]{{1,128}} (no leading dot)"
            )
        return v

    @model_validator(mode="after")
    def _rows(self) -> CaptureRecord:
        if self.num_prompt_tokens >= self.num_tokens:
            raise ValueError(
                f"num_prompt_tokens {self.num_prompt_tokens} leaves no generated row of {self.num_tokens}"
            )
        return self

    @property
    def num_generated(self) -> int:
        """Generated (supervised) rows."""
        return self.num_tokens - self.num_prompt_tokens


class RecordAnswer(Wire):
    """The intake's answer to a record (every status): `reason` is machine-readable."""

    status: Literal["accepted", "duplicate", "shed", "rejected", "unavailable"]
    reason: str
    detail: str = ""
    seq: int | None = None  # the SampleRef's stream sequence (accepted, duplicate)


def _digest(request_id: str) -> bytes:
    return hashlib.sha256(request_id.encode("utf-8", "surrogatepass")).digest()


# Stream sequences: the broker answers 408 to sequence 0 ("Empty Request") and to one that is
# no uint64 ("Malformed Request"); specbus takes 1 .. 2^63-1 from a request (int64 everywhere).
MAX_SEQ = 2**63 - 1
_UINT = re.compile(r"0|[1-9][0-9]{0,18}")  # ASCII, canonical: no sign, space, "_", leading 0
_SECONDS = re.compile(r"[0-9]{1,20}(\.[0-9]{1,20})?([eE][-+]?[0-9]{1,3})?")  # as str(float)


def parse_uint(text: str | None, lo: int = 0, hi: int = MAX_SEQ) -> int | None:
    """`text` as an int in `[lo, hi]` if it is canonical ASCII decimal digits, else None.
    Strict on purpose: `str.isdigit` and `int` also take "²", "٣", " 1", "+1" and "1_0"."""
    if text is None or not _UINT.fullmatch(text):
        return None
    n = int(text)
    return n if lo <= n <= hi else None


def parse_seq(text: str | None) -> int | None:
    """A stream sequence (1 .. `MAX_SEQ`) from a request, else None (`parse_uint`)."""
    return parse_uint(text, 1, MAX_SEQ)


def parse_seconds(text: str | None) -> float | None:
    """A non-negative finite duration from a request (ASCII, as `str(float)` writes it: no
    sign, nan or inf), else None."""
    if text is None or not _SECONDS.fullmatch(text):
        return None
    value = float(text)
    return value if math.isfinite(value) else None


DRIVEN_PREFIX = "specbus-task:"


def driven_rid(task_seq: int, sample_id: str) -> str:
    """The request id a driving producer gives a task's prefill (module doc)."""
    return f"{DRIVEN_PREFIX}{int(task_seq)}:{sample_id}"


def driven_of(request_id: str) -> tuple[int, str] | None:
    """(TASKS seq, sample id) of a driven request id, None for any other id (and for an id
    with the prefix whose sequence is not a canonical 1 .. `MAX_SEQ`: `is_reserved`)."""
    if not request_id.startswith(DRIVEN_PREFIX):
        return None
    seq, _, sample_id = request_id[len(DRIVEN_PREFIX) :].partition(":")
    n = parse_seq(seq)
    if n is None or not _ID.fullmatch(sample_id):
        return None
    return n, sample_id


def is_reserved(request_id: str) -> bool:
    """A request id with the driven prefix that is not a valid driven id: the intake refuses
    its record (422 `driven`) rather than take it for a serving request's."""
    return request_id.startswith(DRIVEN_PREFIX) and driven_of(request_id) is None


def capture_decision(request_id: str, rate: float) -> bool:
    """Whether a request is captured: a pure function of its id (every TP rank agrees); a
    driven id always is."""
    if rate >= 1.0 or driven_of(request_id) is not None:
        return True
    if rate <= 0.0:
        return False
    return int.from_bytes(_digest(request_id)[:8], "big") / 2**64 < rate


def sample_id_of(request_id: str) -> str:
    """The sample id of a request's capture (`live-` + 32 hex digits of its hash; a driven
    id's task sample id)."""
    driven = driven_of(request_id)
    if driven is not None:
        return driven[1]
    return "live-" + _digest(request_id)[8:24].hex()
