"""Wire records: the small, durable messages that ride on the bus, and the run manifest.

Records are frozen, strict pydantic models with a schema version. They serialise to orjson
bytes and are bounded in size. No tensor or array can ride in a record: tensors live in a
feature store and a record only names them (`FeatureSpec.key`).

Compatibility decision: a record from a newer writer (a `schema_version` its class does not
read, or unknown fields) is *rejected* with `RecordError(reason="schema")`, never half-read. A
consumer dead-letters it with that reason, so nothing is silently dropped or misinterpreted.
A record class reads its older versions (`Record.reads`) and writes only its current one.

Token ids travel packed (`PromptTask` version 2): `input_ids` as base64 of little-endian int32,
`loss_mask` as base64 of its bits (LSB first), about 5.4 bytes per token instead of ~8 as JSON
numbers, so a 128k-token task is ~0.7 MB. Version-1 tasks (JSON number arrays) are still read
(and upgraded: a recapture republishes a task as version 2). docs/bus.md, "Record size".
"""

from __future__ import annotations

import base64
import binascii
import time
from typing import Annotated, Any, ClassVar, Literal

import numpy as np
import orjson
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from specbus.core.errors import RecordError

SCHEMA_VERSION = 1  # of every record but PromptTask (`PromptTask.version`)
# A SampleRef is a few hundred bytes per feature whatever the sample's length: its bound.
MAX_RECORD_BYTES = 256 * 1024
# A PromptTask grows with its tokens (~5.4 bytes each, packed): 4 MiB hold ~780k tokens. The
# embedded and cluster brokers take 8 MiB messages (`max_payload`); a stock nats-server's
# 1 MiB still holds ~190k tokens. The publisher also checks the broker's own max_payload.
MAX_TASK_BYTES = 4 << 20
TOKEN_ID_MAX = 2**31 - 1  # token ids travel as int32

DType = Literal["bfloat16", "float16", "float32", "float64", "int64", "int32", "uint8", "bool"]
TaskSource = Literal["dataset", "live", "recapture"]


class Record(BaseModel):
    """Base of every wire record: frozen, strict, versioned, orjson round trip, bounded."""

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")
    max_bytes: ClassVar[int] = MAX_RECORD_BYTES  # its serialised size limit
    version: ClassVar[int] = SCHEMA_VERSION  # the version it writes
    reads: ClassVar[frozenset[int]] = frozenset({SCHEMA_VERSION})  # the versions it reads

    schema_version: int = SCHEMA_VERSION

    @field_validator("schema_version")
    @classmethod
    def _known_version(cls, v: int) -> int:
        if v not in cls.reads:
            raise ValueError(
                f"schema_version {v} is not supported (this reader speaks {sorted(cls.reads)})"
            )
        return cls.version  # an older version read is upgraded: it is written as the current

    def to_bytes(self) -> bytes:
        """The record's wire bytes (orjson); `RecordError(reason="oversize")` beyond `max_bytes`."""
        data = orjson.dumps(self.model_dump(mode="json"))
        if len(data) > self.max_bytes:
            raise RecordError(
                f"{type(self).__name__} is {len(data)} bytes, over the {self.max_bytes}-byte limit",
                reason="oversize",
            )
        return data

    @classmethod
    def from_bytes(cls, data: bytes):
        """Parse and validate. Raises `RecordError` with reason oversize/garbage/schema/invalid."""
        if len(data) > cls.max_bytes:
            raise RecordError(
                f"record of {len(data)} bytes exceeds {cls.max_bytes}", reason="oversize"
            )
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError as e:
            raise RecordError(f"not a JSON record: {e}", reason="garbage") from e
        if not isinstance(obj, dict):
            raise RecordError(
                f"record must be a JSON object, got {type(obj).__name__}", reason="garbage"
            )
        version = obj.get("schema_version")
        if version not in cls.reads or isinstance(version, bool):
            raise RecordError(
                f"{cls.__name__} schema_version {version!r} is not supported (reads "
                f"{sorted(cls.reads)})",
                reason="schema",
            )
        try:
            # JSON has no tuples: validate in JSON mode so lists become tuples, strings stay strict.
            return cls.model_validate_json(data)
        except ValidationError as e:
            raise RecordError(f"invalid {cls.__name__}: {_first_error(e)}", reason="invalid") from e


def _first_error(e: ValidationError) -> str:
    err = e.errors()[0]
    loc = ".".join(str(p) for p in err["loc"]) or "<record>"
    return f"{loc}: {err['msg']}"


class FeatureSpec(Record):
    """Where one tensor of a sample lives and what it is. Shape/dtype travel here, not with the bytes."""

    name: str
    key: str
    shape: tuple[int, ...]
    dtype: DType
    nbytes: int = Field(ge=0)
    crc32: int | None = None


class Provenance(Record):
    """Who captured a sample: the producer and its engine, and when."""

    producer_id: str
    engine: str
    created_at: float = Field(default_factory=time.time)


def pack_ids(ids: tuple[int, ...]) -> str:
    """Token ids as base64 of little-endian int32 (the version-2 wire form)."""
    arr = np.asarray(ids, dtype=np.int64)
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > TOKEN_ID_MAX):
        raise ValueError(f"token ids must be in 0..{TOKEN_ID_MAX}")
    return base64.b64encode(arr.astype("<i4").tobytes()).decode("ascii")


def _b64(v: str, what: str) -> bytes:
    try:
        return base64.b64decode(v, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"{what}: not base64 ({e})") from e


def _ids_in(v: Any) -> Any:
    """The wire's packed ids (version 2) or a JSON array (version 1) as a tuple."""
    if isinstance(v, str):
        raw = _b64(v, "input_ids")
        if len(raw) % 4:
            raise ValueError(f"input_ids: {len(raw)} bytes is not a whole number of int32")
        ids = np.frombuffer(raw, dtype="<i4")
        if ids.size and int(ids.min()) < 0:
            raise ValueError("input_ids: negative token id")
        return tuple(ids.tolist())
    return tuple(v) if isinstance(v, list) else v


def pack_mask(mask: tuple[int, ...]) -> str:
    """A 0/1 mask as base64 of its bits, least significant first (8 positions a byte)."""
    bits = np.asarray(mask, dtype=np.uint8)
    return base64.b64encode(np.packbits(bits, bitorder="little").tobytes()).decode("ascii")


def _mask_in(v: Any, info: ValidationInfo) -> Any:
    """The wire's packed mask (version 2, as long as `input_ids`) or a JSON array as a tuple."""
    if isinstance(v, str):
        ids = info.data.get("input_ids")
        if ids is None:
            raise ValueError("a packed loss_mask needs input_ids (its length)")
        raw = _b64(v, "loss_mask")
        if len(raw) != (len(ids) + 7) // 8:
            raise ValueError(
                f"loss_mask: {len(raw)} bytes do not hold the bits of {len(ids)} input_ids"
            )
        bits = np.unpackbits(np.frombuffer(raw, dtype=np.uint8), bitorder="little")
        if bits[len(ids) :].any():
            raise ValueError("loss_mask: bits set past the last token")
        return tuple(bits[: len(ids)].tolist())
    return tuple(v) if isinstance(v, list) else v


TokenIds = Annotated[
    tuple[int, ...], BeforeValidator(_ids_in), PlainSerializer(pack_ids, when_used="json")
]
LossMask = Annotated[
    tuple[int, ...], BeforeValidator(_mask_in), PlainSerializer(pack_mask, when_used="json")
]


class PromptTask(Record):
    """One unit of capture work on the TASKS stream.

    Carries either token ids + loss mask (pre-tokenised, live traffic, recapture) or a
    conversation/text to tokenise at capture time. `generation` > 0 marks a recapture.
    In memory the ids and the mask are tuples; on the wire (version 2) they are packed (module
    doc); version-1 tasks (JSON arrays) are read and upgraded. Bounded by `MAX_TASK_BYTES`.
    """

    max_bytes: ClassVar[int] = MAX_TASK_BYTES
    version: ClassVar[int] = 2
    reads: ClassVar[frozenset[int]] = frozenset({1, 2})

    schema_version: int = 2
    task_id: str
    run_id: str
    epoch: int = Field(ge=0, default=0)
    source: TaskSource = "dataset"
    generation: int = Field(ge=0, default=0)
    input_ids: TokenIds | None = None
    loss_mask: LossMask | None = None
    messages: tuple[dict[str, str], ...] | None = None
    text: str | None = None
    index: int = Field(ge=0, default=0)

    @field_validator("input_ids")
    @classmethod
    def _ids_fit_int32(cls, v: tuple[int, ...] | None) -> tuple[int, ...] | None:
        if v is not None and v and (min(v) < 0 or max(v) > TOKEN_ID_MAX):
            raise ValueError(f"input_ids must be in 0..{TOKEN_ID_MAX}")
        return v

    @field_validator("loss_mask")
    @classmethod
    def _mask_is_binary(cls, v: tuple[int, ...] | None) -> tuple[int, ...] | None:
        if v is not None and not set(v) <= {0, 1}:
            raise ValueError("loss_mask values must be 0 or 1")
        return v

    @model_validator(mode="after")
    def _has_payload(self) -> PromptTask:
        if self.input_ids is None and self.messages is None and self.text is None:
            raise ValueError("a PromptTask needs input_ids, messages or text")
        if self.loss_mask is not None and self.input_ids is None:
            raise ValueError("a loss_mask needs the input_ids it masks")
        if (
            self.input_ids is not None
            and self.loss_mask is not None
            and len(self.input_ids) != len(self.loss_mask)
        ):
            raise ValueError(
                f"input_ids ({len(self.input_ids)}) and loss_mask ({len(self.loss_mask)}) differ in length"
            )
        return self

    @property
    def msg_id(self) -> str:
        """Broker dedup id: a retried publish of the same task (epoch, generation) is dropped."""
        return f"{self.run_id}:{self.task_id}:e{self.epoch}:g{self.generation}"


class SampleRef(Record):
    """One captured sample on the SAMPLES stream: names its tensors in a feature store."""

    sample_id: str
    run_id: str
    task_id: str
    task_seq: int = Field(ge=0)
    epoch: int = Field(ge=0, default=0)
    generation: int = Field(ge=0, default=0)
    store_uri: str
    features: dict[str, FeatureSpec]
    nbytes: int = Field(ge=0)
    num_tokens: int = Field(ge=0)
    strategy: str
    target_fingerprint: str
    tokenizer_fingerprint: str
    provenance: Provenance

    @model_validator(mode="after")
    def _bytes_add_up(self) -> SampleRef:
        total = sum(f.nbytes for f in self.features.values())
        if total != self.nbytes:
            raise ValueError(f"nbytes {self.nbytes} != sum of feature bytes {total}")
        return self

    @property
    def msg_id(self) -> str:
        """Broker dedup id: sample id + generation (a recapture is a new message)."""
        return f"{self.run_id}:{self.sample_id}:g{self.generation}"


class ManifestTarget(Record):
    """The target a run was fed for: trainers refuse refs of another fingerprint."""

    model: str
    fingerprint: str
    tokenizer_fingerprint: str
    num_layers: int = Field(ge=1)
    hidden_size: int = Field(ge=1)
    vocab_size: int = Field(ge=1)


class VocabTable(Record):
    """The draft vocabulary as offsets: draft id i -> target id i + d2t[i] (t2d is derived)."""

    d2t: tuple[int, ...]
    target_vocab_size: int = Field(ge=1)


class Manifest(Record):
    """A run's identity, written once to the run KV by the feeder (a live run: the intake),
    read by every process.

    `plan` is what every process must agree on (strategy and data settings, target, sample
    count, vocab fingerprint) and `plan_hash` its digest: a feeder of another plan under the
    same run name, or a checkpoint of another plan, is refused by it. `planned_tasks` sizes
    the schedule (None in a live run: traffic has no count). `mode` is "driven" (a feeder's
    tasks) or "live" (serving traffic, `docs/live.md`); `live` is a live run's capture
    handshake (the intake's `CaptureConfig` as JSON). Larger than a stream record (the vocab
    table): bounded by the KV's 1 MiB.
    """

    max_bytes: ClassVar[int] = 1000 * 1024

    run: str
    plan: dict[str, Any]
    plan_hash: str
    planned_tasks: int | None = Field(ge=0)
    target: ManifestTarget
    strategy: str
    vocab: VocabTable
    mode: Literal["driven", "live"] = "driven"
    live: dict[str, Any] | None = None


def decode(cls: type[Record], data: bytes) -> Record:
    """`cls.from_bytes(data)`; a helper for call sites holding the class in a variable."""
    return cls.from_bytes(data)
