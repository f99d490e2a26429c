"""The feature store API shared by every backend, and the helpers they all use.

A store holds the tensors of captured samples; a `SampleRef` on the bus only names them. One
object per tensor, keyed `{store_id}/{sample_id}/g{gen}/{name}`; the key, shape, dtype, byte
size (and optionally a CRC32) travel in the `FeatureSpec`, never with the bytes: no pickle,
no header on the wire.

Guarantees every backend keeps (tests/test_store_*.py pin them down):
- `get` of anything that is not there raises `FeatureMissing` naming the key: never empty
  data, never a hang (every remote call has a bounded timeout).
- bytes that do not match their spec raise `IntegrityError` (short read, size or CRC
  mismatch); `put` rejects NaN/Inf in floating tensors with `IntegrityError` naming the
  sample and the tensor (when `screen_nonfinite`).
- `put` beyond `budget_bytes` raises `StoreFull` (backpressure), before writing anything.
- a put of generation N removes generations < N of that sample (a stale ref then raises
  `FeatureMissing`), and writing an existing key replaces its value.
- `release` is idempotent; `gc` reclaims orphans and returns the bytes it freed.
- `sweep(done)` removes every sample generation whose id `done` names (trained or dead) or
  that a newer generation superseded, whoever put or released it, and retries what the
  store refused before; `purge()` removes everything of the store id (a run that is gone).
  Both are written once, in `StoreBase`, on three primitives of each backend.
- `close()` is idempotent and bounded (safe from a signal-triggered shutdown path).
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from specbus.core.contracts import FeatureSpec, SampleRef
from specbus.core.errors import ConfigError, IntegrityError, StoreError
from specbus.core.store.chunked import SharedScreen

log = logging.getLogger(__name__)

# Ids become path components and key segments: no "/", no leading dot, bounded length.
_ID = re.compile(r"^[A-Za-z0-9_:=+\-][A-Za-z0-9._:=+\-]{0,199}$")
_KEY = re.compile(r"(?P<store>[^/]+)/(?P<sample>[^/]+)/g(?P<gen>[0-9]{1,18})/(?P<name>[^/]+)")

DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


@dataclass(frozen=True)
class StoreUsage:
    """What a store holds right now, as the store sees it (all processes, not just this one).

    `resident_bytes` counts bytes held for samples (and, for shm, reserved by puts in flight);
    `num_samples` counts sample generations; `peak_bytes` is the highest `resident_bytes`
    seen (shm/mem: exact, kept by the store; mooncake: the highest this handle observed).
    `pending_release_bytes` are released bytes whose remove the store has not yet accepted
    (Mooncake read leases), retried in the background.
    """

    resident_bytes: int
    num_samples: int
    peak_bytes: int
    budget_bytes: int
    capacity_bytes: int | None = None
    pending_release_bytes: int = 0
    cached_bytes: int = 0  # shm: released files kept for reuse (bounded; not samples)

    @property
    def fraction(self) -> float:
        """Resident bytes over the budget (0 without a budget)."""
        return self.resident_bytes / self.budget_bytes if self.budget_bytes else 0.0


RefLike = SampleRef | Mapping[str, FeatureSpec]


@runtime_checkable
class FeatureStore(Protocol):
    """One API for producers and trainers; the backend is chosen by URI (`open_store`)."""

    uri: str  # what SampleRef.store_uri records; another process can open_store(uri) it

    def put(
        self, sample_id: str, tensors: Mapping[str, torch.Tensor], gen: int = 0
    ) -> dict[str, FeatureSpec]:
        """Store a sample's tensors; return their specs. Raises StoreFull, IntegrityError."""
        ...

    def get(
        self, ref: RefLike, names: Iterable[str] | None = None, device=None
    ) -> dict[str, torch.Tensor]:
        """Read tensors by spec. Raises FeatureMissing (naming the key), IntegrityError."""
        ...

    def release(self, ref: RefLike) -> None:
        """Free a sample's tensors. Idempotent; never raises for an already-gone sample."""
        ...

    def adopt(self, ref: RefLike) -> None:
        """Take over a sample written by another writer: verify every feature is present
        with its spec's size (FeatureMissing / IntegrityError otherwise) and count it as
        held by this store handle."""
        ...

    def gc(self, live: Iterable[str] | None = None, *, min_age_s: float | None = None) -> int:
        """Reclaim orphans; return the bytes freed. See the backend for its policy."""
        ...

    def usage(self) -> StoreUsage:
        """The store's residency (resident bytes, samples, peak, budget, capacity, pending
        releases, cached bytes) as this handle sees it; the budget check's source."""

    def alloc(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An empty tensor to fill and then `put`; where the backend can (Mooncake: registered
        transfer memory), putting it costs no staging copy. Any tensor can be put anyway."""
        ...

    def sweep(self, done: Callable[[str], bool], *, timeout_s: float | None = None) -> int:
        """Remove every sample of this store that `done(sample_id)` says is finished (all its
        generations) and every generation a newer one superseded; retry refused removes
        (Mooncake read leases) for up to `timeout_s`. Returns the bytes freed. See StoreBase."""
        ...

    def purge(self) -> int:
        """Remove every object of this store id, forced: for a run that is gone."""
        ...

    def close(self, timeout_s: float | None = None) -> None:
        """Flush refused removes for up to `timeout_s`, then let go. Idempotent, bounded."""
        ...


@dataclass(frozen=True)
class Stored:
    """One complete sample generation as its backend lists it for `sweep`/`purge`.
    `objects` are the backend's names for its pieces where the id and generation do not
    find them (Mooncake keys)."""

    sample_id: str
    gen: int
    objects: tuple[str, ...] = ()


# One lock for every handle's close flag: held only to test-and-set it (never across a
# store call), and re-entrant, so a signal handler that calls close() while this thread is
# inside close() returns at once instead of deadlocking.
_CLOSE_LOCK = threading.RLock()


class StoreBase:
    """What every backend shares, written once: `sweep`, `purge` and the shape of `close`.

    A backend provides:
    - `_stored() -> list[Stored]`: every complete sample generation of this store id as the
      store sees it (every process's, not only this handle's);
    - `_drop(stored, force) -> int`: remove those; the bytes freed now. What the store
      refuses for now (a Mooncake read lease) is queued and retried, never forgotten while
      this handle lives; `force` (purge) overrides leases;
    - `_settle(deadline) -> int`: retry queued removes at least once, then until none is
      left or `deadline` (time.monotonic()); the bytes freed meanwhile. Never blocks past
      the deadline by more than one bounded store call, and gives up at once when the
      store's service is gone (nothing can be freed there, a restarted one holds nothing);
    - `_purge_rest() -> int`: what `purge` removes besides complete samples (puts in
      progress, cached files), bytes freed;
    - `_reclaim_orphans() -> int`: what `sweep` removes besides complete samples: what is
      certainly dead whatever the sample (shm: puts whose writer died), bytes freed;
    - `_shutdown()`: let go of the handle's resources (runs once).
    `settle_timeout_s` is how long `sweep` and `close` wait for refused removes by default.
    """

    store_id: str
    uri: str
    settle_timeout_s: float = 0.0
    _closing: bool = False

    def sweep(self, done: Callable[[str], bool], *, timeout_s: float | None = None) -> int:
        """Remove what nobody will read again, whatever its generation and whoever wrote or
        released it: every stored generation of a sample for which `done(sample_id)` is true
        (trained, or dead-lettered) and every generation older than the newest stored one of
        its sample (superseded). Then retry every remove the store refused, this sweep's and
        earlier ones (Mooncake read leases: gently, forced once `force_release_after_s` has
        passed since the first refusal, as `release` does), for up to `timeout_s` (default
        `settle_timeout_s`; 0: one retry, the rest stays with the background retrier).

        Also reclaims what is certainly dead whatever the sample (shm: puts whose writer was
        killed, as `gc()` does), so a sweep at the end of a run leaves nothing behind.
        Returns the bytes freed by this call. `done` is called once per stored sample id.
        This is how releases survive a crash: a release that a killed process had queued is
        re-derived from the trainer's record (the checkpoint's lineage) by whoever sweeps
        next, so nothing needs to have been written down when it was refused."""
        self._check_open()
        stored = self._stored()
        newest: dict[str, int] = {}
        for s in stored:
            newest[s.sample_id] = max(newest.get(s.sample_id, -1), s.gen)
        verdict: dict[str, bool] = {}
        doomed = []
        for s in stored:
            if s.sample_id not in verdict:
                verdict[s.sample_id] = bool(done(s.sample_id))
            if verdict[s.sample_id] or s.gen < newest[s.sample_id]:
                doomed.append(s)
        freed = self._drop(doomed, force=False) + self._reclaim_orphans()
        return freed + self._settle(self._deadline(timeout_s))

    def purge(self) -> int:
        """Remove every object of this store id, leases overridden: the samples of every
        generation, puts in progress and cached space. For a run that is gone (the caller
        knows: nothing of the run runs any more); a reader still running would get
        FeatureMissing, a writer still running a failed put. Returns the bytes freed."""
        self._check_open()
        return self._drop(self._stored(), force=True) + self._purge_rest()

    def close(self, timeout_s: float | None = None) -> None:
        """Flush removes the store refused so far (for up to `timeout_s`, default
        `settle_timeout_s`), then let go of the handle. Idempotent and safe from a
        signal-triggered shutdown path: a second call (another thread, a signal handler
        re-entering this one) returns at once; the flush never waits past the deadline by
        more than one bounded store call, and not at all when the store's service is gone;
        no error escapes. Removes still refused at the deadline are logged and left to the
        next `sweep` (they are re-derivable from the trainer's record)."""
        with _CLOSE_LOCK:
            if self._closing:
                return
            self._closing = True
        try:
            self._settle(self._deadline(timeout_s))
        except Exception as e:  # noqa: BLE001 - close must let go whatever the store says
            log.warning("%s: flushing releases at close failed: %s", self.uri, e)
        finally:  # also after a second Ctrl-C in the flush
            try:
                self._shutdown()
            except Exception as e:  # noqa: BLE001 - a shutdown path must not die in close
                log.warning("%s: closing the store handle failed: %s", self.uri, e)

    def _deadline(self, timeout_s: float | None) -> float:
        wait = self.settle_timeout_s if timeout_s is None else max(timeout_s, 0.0)
        return time.monotonic() + wait

    def _check_open(self) -> None:
        if self._closing:
            raise StoreError(f"{self.uri}: store handle is closed")

    # Backends override these (see the class docstring).
    def _stored(self) -> list[Stored]:
        raise NotImplementedError

    def _drop(self, stored: list[Stored], force: bool) -> int:
        raise NotImplementedError

    def _settle(self, deadline: float) -> int:
        return 0  # removes are never refused here

    def _purge_rest(self) -> int:
        return 0

    def _reclaim_orphans(self) -> int:
        return 0

    def _shutdown(self) -> None:
        pass


# ---- keys and ids ------------------------------------------------------------------------


def check_id(kind: str, value: str) -> str:
    """`value` if it is a legal key segment (`kind` names it in the `ValueError`)."""
    if not isinstance(value, str) or not _ID.match(value):
        raise ValueError(f"{kind} {value!r} must match {_ID.pattern} (it becomes a key segment)")
    return value


def make_key(store_id: str, sample_id: str, gen: int, name: str) -> str:
    """The object key of one tensor: `{store_id}/{sample_id}/g{gen}/{name}`; `ValueError` for an
    illegal id or generation."""
    if not isinstance(gen, int) or gen < 0:
        raise ValueError(f"generation {gen!r} of sample {sample_id!r} must be an int >= 0")
    return f"{store_id}/{check_id('sample id', sample_id)}/g{gen}/{check_id('tensor name', name)}"


@dataclass(frozen=True)
class KeyParts:
    """The parts of an object key."""

    store_id: str
    sample_id: str
    gen: int
    name: str


def parse_key(key: str, store_id: str | None = None) -> KeyParts:
    """Split a key; with `store_id`, also check the key belongs to that store."""
    m = _KEY.fullmatch(key)
    if not m:
        raise StoreError(f"key {key!r} is not of the form store/sample/g<gen>/name")
    parts = KeyParts(m["store"], m["sample"], int(m["gen"]), m["name"])
    if store_id is not None and parts.store_id != store_id:
        raise StoreError(
            f"key {key!r} belongs to store {parts.store_id!r}, not to this store {store_id!r}"
        )
    return parts


def sample_prefix(store_id: str, sample_id: str, gen: int) -> str:
    """The key prefix of one generation of a sample."""
    return f"{store_id}/{sample_id}/g{gen}/"


def specs_of(ref: RefLike, names: Iterable[str] | None = None) -> dict[str, FeatureSpec]:
    """The specs of a ref (a SampleRef or a name -> FeatureSpec mapping), filtered by `names`."""
    specs = ref.features if isinstance(ref, SampleRef) else dict(ref)
    if names is None:
        return dict(specs)
    out = {}
    for name in names:
        if name not in specs:
            raise KeyError(f"feature {name!r} is not in the ref (it has {sorted(specs)})")
        out[name] = specs[name]
    return out


def sample_of(specs: Mapping[str, FeatureSpec], store_id: str) -> tuple[str, int]:
    """(sample_id, gen) shared by all the specs of one ref; raises StoreError otherwise."""
    found = {(p.sample_id, p.gen) for p in (parse_key(s.key, store_id) for s in specs.values())}
    if len(found) != 1:
        raise StoreError(f"a ref must name exactly one sample generation, found {sorted(found)}")
    return found.pop()


# ---- tensors <-> bytes -------------------------------------------------------------------


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous CPU tensor (no copy)."""
    return t.reshape(-1).view(torch.uint8)


def as_cpu_contiguous(name: str, t: torch.Tensor) -> torch.Tensor:
    """The tensor as a contiguous CPU tensor (a copy only when needed)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"feature {name!r} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in DTYPE_NAMES:
        raise ValueError(f"feature {name!r} has dtype {t.dtype}, not one of {sorted(DTYPES)}")
    return t.detach().to("cpu").contiguous()


def crc32_of(t: torch.Tensor) -> int:
    """CRC32 of the tensor's bytes (0 for an empty one)."""
    return zlib.crc32(byte_view(t).numpy().data) if t.numel() else 0


def screen_nonfinite(sample_id: str, name: str, t: torch.Tensor) -> None:
    """Raise IntegrityError if a floating tensor holds NaN or Inf.

    Fast path: one reduction (NaN/Inf poison a sum); only a non-finite sum pays for the
    exact element-wise check, so a large-but-finite tensor whose sum overflows passes.
    """
    if not t.is_floating_point() or t.numel() == 0:
        return
    if torch.isfinite(t.sum()).item():
        return
    bad = (~torch.isfinite(t)).sum().item()
    if bad:
        raise IntegrityError(f"sample {sample_id!r}: tensor {name!r} holds {bad} NaN/Inf value(s)")


def screen_all(sample_id: str, tensors: Mapping[str, torch.Tensor]) -> None:
    """`IntegrityError` if any floating tensor holds NaN or Inf."""
    for name, t in tensors.items():
        screen_nonfinite(sample_id, name, t)


class Screener:
    """A store handle's screen workers: long-lived threads (started at first use, no thread
    per put) that help with `SharedScreen`s (core/store/chunked.py) while the put's own
    thread moves the bytes. The sum and the copy or transfer release the GIL, so where a
    core is idle the screen runs beside the put; where none is, the put waits for no helper:
    its own thread sums whatever the helper has not finished (`SharedScreen.finish`).

    Samples below `NICE_BELOW_BYTES` go to a worker at nice 19 (Linux), larger ones to one
    at normal priority. Measured on loopback Mooncake (docs/store.md): a 4 MB transfer is
    short and latency-bound, and a helper at normal priority that wakes beside it preempts
    the transfer's threads (0.76-0.83x raw against 0.81-0.89x at nice 19); over a 64 MB
    transfer a nice-19 helper gets too little of the CPU to matter (0.74-0.78x against
    0.74-0.84x at normal priority)."""

    NICE_BELOW_BYTES = 16 << 20

    def __init__(self) -> None:
        self._pools: dict[int, ThreadPoolExecutor] = {}

    def help(self, shared: SharedScreen) -> None:
        """Let a worker thread sum the chunks of `shared` from the back while the put goes on."""
        nice = 19 if shared.nbytes < self.NICE_BELOW_BYTES else 0
        pool = self._pools.get(nice)
        if pool is None:
            pool = self._pools[nice] = ThreadPoolExecutor(
                1, thread_name_prefix="nan-screen", initializer=_niced, initargs=(nice,)
            )
        pool.submit(shared.help)

    def close(self) -> None:
        """Wait for the workers and stop them."""
        for pool in self._pools.values():
            pool.shutdown(wait=True)


def _niced(nice: int) -> None:
    """Raise the calling thread's niceness (Linux: per thread; elsewhere left alone)."""
    if nice and sys.platform == "linux":
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)


def make_spec(
    store_id: str, sample_id: str, gen: int, name: str, t: torch.Tensor, crc: bool
) -> FeatureSpec:
    """The `FeatureSpec` of tensor `name` of a sample (CRC when `crc`)."""
    return FeatureSpec(
        name=name,
        key=make_key(store_id, sample_id, gen, name),
        shape=tuple(int(d) for d in t.shape),
        dtype=DTYPE_NAMES[t.dtype],
        nbytes=t.numel() * t.element_size(),
        crc32=crc32_of(t if t.device.type == "cpu" else t.cpu()) if crc else None,
    )


def prepare(
    store_id: str,
    sample_id: str,
    gen: int,
    tensors: Mapping[str, torch.Tensor],
    *,
    crc: bool,
    screen: bool,
    to_cpu: bool = True,
) -> tuple[dict[str, torch.Tensor], dict[str, FeatureSpec]]:
    """Validate a put: ids, dtypes, NaN/Inf screen; return (contiguous tensors, specs)."""
    check_id("sample id", sample_id)
    if not tensors:
        raise ValueError(f"sample {sample_id!r}: put needs at least one tensor")
    out, specs = {}, {}
    for name, t in tensors.items():
        check_id("tensor name", name)
        t = as_cpu_contiguous(name, t) if to_cpu else t.detach().contiguous()
        if screen:
            screen_nonfinite(sample_id, name, t)
        out[name] = t
        specs[name] = make_spec(store_id, sample_id, gen, name, t, crc)  # host copy only for a CRC
    return out, specs


def empty_for(spec: FeatureSpec) -> torch.Tensor:
    """An uninitialised CPU tensor of the spec's shape and dtype."""
    return torch.empty(spec.shape, dtype=DTYPES[spec.dtype])


def check_crc(spec: FeatureSpec, t: torch.Tensor) -> None:
    """`IntegrityError` when the spec has a CRC and the tensor does not match it."""
    if spec.crc32 is not None and crc32_of(t) != spec.crc32:
        raise IntegrityError(
            f"feature {spec.key!r}: CRC32 mismatch (stored bytes differ from the spec)"
        )


def as_feature(spec: FeatureSpec, flat: torch.Tensor) -> torch.Tensor:
    """`flat`'s bytes as the tensor `spec` names (a new empty one for 0 bytes), CRC checked."""
    t = flat.view(DTYPES[spec.dtype]).reshape(spec.shape) if spec.nbytes else empty_for(spec)
    check_crc(spec, t)
    return t


def to_device(tensors: dict[str, torch.Tensor], device) -> dict[str, torch.Tensor]:
    """The tensors moved to `device` (unchanged for None)."""
    if device is None:
        return tensors
    return {k: v.to(device) for k, v in tensors.items()}


def check_store_id(store_id: str) -> str:
    """`store_id` if it is a legal store id; `ConfigError` otherwise."""
    try:
        return check_id("store id", store_id)
    except ValueError as e:
        raise ConfigError(str(e)) from e
