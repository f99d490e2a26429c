"""`mem://<store_id>`: an in-process store (colocated mode: capture and train in one process).

Zero copy: `put` keeps the tensors it is given (on their device) and `get` returns them, so a
caller must not mutate a tensor after putting it (with `crc` on, a mutation is caught at get).
Handles opened with the same URI in one process share the same samples, so a capture source
and a loader can each `open_store(uri)`. Budget, generations, NaN screen, CRC and gc behave as
in every backend; gc(live) frees samples not in `live` older than `gc_grace_s`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch
from specbus.core.config import StoreConfig
from specbus.core.contracts import FeatureSpec
from specbus.core.errors import FeatureMissing, IntegrityError, StoreFull
from specbus.core.store.base import (
    RefLike,
    StoreBase,
    Stored,
    StoreUsage,
    check_crc,
    parse_key,
    prepare,
    specs_of,
    to_device,
)


@dataclass
class _Sample:
    tensors: dict[str, torch.Tensor]
    nbytes: int
    created: float = field(default_factory=time.monotonic)


class _Shared:
    """The samples of one store id, shared by every handle in this process."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.samples: dict[tuple[str, int], _Sample] = {}
        self.resident = 0
        self.peak = 0


_REGISTRY: dict[str, _Shared] = {}
_REGISTRY_LOCK = threading.Lock()


class MemStore(StoreBase):
    """A `FeatureStore` in this process's memory, shared by the handles of one store id (tensors
    are kept as given, contiguous: a GPU tensor stays on its GPU)."""

    def __init__(self, cfg: StoreConfig, store_id: str):
        self.cfg = cfg
        self.store_id = store_id
        self.uri = f"mem://{store_id}"
        with _REGISTRY_LOCK:
            self._shared = _REGISTRY.setdefault(store_id, _Shared())

    def put(
        self, sample_id: str, tensors: Mapping[str, torch.Tensor], gen: int = 0
    ) -> dict[str, FeatureSpec]:
        """Keep the sample's tensors (see `FeatureStore.put`)."""
        kept, specs = prepare(
            self.store_id,
            sample_id,
            gen,
            tensors,
            crc=self.cfg.crc,
            screen=self.cfg.screen_nonfinite,
            to_cpu=False,
        )
        nbytes = sum(s.nbytes for s in specs.values())
        sh = self._shared
        with sh.lock:
            replaced = sh.samples.get((sample_id, gen))
            freed = replaced.nbytes if replaced else 0
            if sh.resident - freed + nbytes > self.cfg.budget_bytes:
                raise StoreFull(
                    f"{self.uri}: putting sample {sample_id!r} ({nbytes} B) would exceed the budget "
                    f"({sh.resident - freed} of {self.cfg.budget_bytes} B in use)"
                )
            for key in [k for k in sh.samples if k[0] == sample_id and k[1] < gen]:
                freed += sh.samples.pop(key).nbytes  # supersede older generations
            sh.samples[(sample_id, gen)] = _Sample(kept, nbytes)
            sh.resident += nbytes - freed
            sh.peak = max(sh.peak, sh.resident)
        return specs

    def get(
        self, ref: RefLike, names: Iterable[str] | None = None, device=None
    ) -> dict[str, torch.Tensor]:
        """The kept tensors (see `FeatureStore.get`); `FeatureMissing` once released."""
        out = {}
        with self._shared.lock:
            for name, spec in specs_of(ref, names).items():
                p = parse_key(spec.key, self.store_id)
                sample = self._shared.samples.get((p.sample_id, p.gen))
                if sample is None or p.name not in sample.tensors:
                    raise FeatureMissing(spec.key)
                out[name] = sample.tensors[p.name]
        for name, t in out.items():
            spec = specs_of(ref, [name])[name]
            if tuple(t.shape) != spec.shape or t.numel() * t.element_size() != spec.nbytes:
                raise IntegrityError(
                    f"feature {spec.key!r}: stored shape {tuple(t.shape)} != spec {spec.shape}"
                )
            if spec.crc32 is not None:  # device tensors are copied to host only to check a CRC
                check_crc(spec, t if t.device.type == "cpu" else t.cpu())
        return to_device(out, device)

    def release(self, ref: RefLike) -> None:
        """Forget one generation of a sample (see `FeatureStore.release`)."""
        sh = self._shared
        with sh.lock:
            for spec in specs_of(ref).values():
                p = parse_key(spec.key, self.store_id)
                sample = sh.samples.pop((p.sample_id, p.gen), None)
                if sample is not None:
                    sh.resident -= sample.nbytes

    def adopt(self, ref: RefLike) -> None:
        """Verify a sample another handle of this process put: present, with the spec's sizes (and
        CRC)."""
        self.get(ref)  # presence + sizes (+ CRC): nothing else to take over in one process

    def gc(self, live: Iterable[str] | None = None, *, min_age_s: float | None = None) -> int:
        """With `live`, forget samples not in it that are older than `gc_grace_s` (or `min_age_s`);
        without, nothing can be orphaned in one process. Returns the bytes freed."""
        if live is None:
            return 0  # nothing in a process can be half-written or owned by a dead writer
        live = set(live)
        grace = self.cfg.gc_grace_s if min_age_s is None else min_age_s
        now = time.monotonic()
        sh = self._shared
        with sh.lock:
            dead = [
                k for k, s in sh.samples.items() if k[0] not in live and now - s.created >= grace
            ]
            freed = sum(sh.samples.pop(k).nbytes for k in dead)
            sh.resident -= freed
        return freed

    def alloc(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An empty tensor (nothing to gain from special memory here)."""
        return torch.empty(shape, dtype=dtype)  # a put copies (shm) or keeps (mem) any tensor

    def usage(self) -> StoreUsage:
        """Residency of the store id in this process."""
        sh = self._shared
        with sh.lock:
            return StoreUsage(sh.resident, len(sh.samples), sh.peak, self.cfg.budget_bytes)

    # ---- sweep / purge primitives (StoreBase); close keeps nothing to let go of: the
    # samples belong to the process and go with it

    def _stored(self) -> list[Stored]:
        with self._shared.lock:
            return [Stored(sid, gen) for sid, gen in self._shared.samples]

    def _drop(self, stored: list[Stored], force: bool) -> int:
        sh = self._shared
        freed = 0
        with sh.lock:
            for s in stored:
                sample = sh.samples.pop((s.sample_id, s.gen), None)
                if sample is not None:
                    freed += sample.nbytes
            sh.resident -= freed
        return freed


def open_mem(cfg: StoreConfig, store_id: str, path: str | None, query: dict[str, str]) -> MemStore:
    """`mem://<store_id>[?option=value]` (`core.registry.STORES`)."""
    from specbus.core.store import query_options

    return MemStore(query_options(cfg, query), store_id)
