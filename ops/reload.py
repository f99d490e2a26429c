"""Hot reload for `specbus serve --speculative`: follow the run's checkpoints, serve each new draft.

`DraftFollower` is a thread of the serving process. Every `live.reload_poll_s` it reads the
run's latest-checkpoint pointer, and when the pointer names a checkpoint it has not tried
yet, it builds that draft off the worker thread (`DraftLoader.load`: the state dict read,
loaded strictly into a draft built from the run config, checked finite, moved to the
engine's device and dtype) and publishes it in the server's `DraftSlot`; the worker takes it
between two rounds of decoding (`producers/live/speculative.py`). A checkpoint that cannot be
loaded (partial, corrupt, of another strategy or shape, non-finite) is refused with one
warning line and counted (`specbus_serve_draft_reloads_total{outcome="refused"}`); the
served draft stays. The same pointer is tried again only once its files change.

The pointer: the run KV's (`RunKV.get_checkpoint`, what the trainers publish after each
checkpoint; `KVPointers`) when the server is given the broker (`--url` or `bus.url`),
otherwise the checkpoint directory's `latest` file (`FilePointers`, `consumers/checkpoint.py`;
same host, or a shared filesystem). The first draft: the latest checkpoint's, else the
untrained draft the trainers start from (`training.seed`); an EAGLE3 draft needs the run's
draft vocabulary for that (the manifest, through the KV): a server without the broker decodes
without a draft until the first checkpoint. The version of a draft is its checkpoint's step
(0: untrained).
"""

from __future__ import annotations

import logging
import math
import re
import threading
import time
from pathlib import Path
from typing import Protocol

import torch
from specbus.consumers.checkpoint import with_frozen_state
from specbus.core.config import RunConfig
from specbus.core.data.vocab import VocabMapping
from specbus.core.errors import CheckpointError
from specbus.core.models.target import load_target_heads, load_target_info, resolve_target_dir
from specbus.core.strategies.base import build_strategy
from specbus.producers.live.speculative import DraftSlot, ServedDraft, SpecStats

log = logging.getLogger("specbus.serve")

STEP_DIR = re.compile(r"step-(\d+)$")


class DraftLoader:
    """Builds the run's drafts for serving: the strategy and the target's heads once, then
    `untrained(vocab)` and `load(path)` (raises `CheckpointError` with the reason)."""

    def __init__(self, cfg: RunConfig, device: torch.device, dtype: torch.dtype):
        target_dir = resolve_target_dir(cfg.target.model)
        self.info = load_target_info(target_dir, name=cfg.target.model)
        self.heads = load_target_heads(target_dir)
        self.strategy = build_strategy(cfg.strategy, self.info, heads=self.heads,
                                       aux_layers=cfg.target.aux_layers)  # fmt: skip
        self.seed, self.device, self.dtype = cfg.training.seed, device, dtype
        self.block = cfg.strategy.name != "eagle3"

    @property
    def needs_vocab(self) -> bool:
        """An EAGLE3 draft is built with the run's draft vocabulary (the manifest's)."""
        return not self.block

    def _served(self, model: torch.nn.Module, version: int) -> ServedDraft:
        model = model.to(device=self.device, dtype=self.dtype).eval()
        return ServedDraft(version, model, self.block, tuple(self.strategy.aux_layers))

    def untrained(self, vocab: VocabMapping | None) -> ServedDraft:
        """The draft the trainers start from (their seed), version 0."""
        torch.manual_seed(self.seed)
        return self._served(self.strategy.build_model(self.info, self.heads, vocab), 0)

    def load(self, path: Path, version: int) -> ServedDraft:
        """The draft of checkpoint directory `path`, as version `version`."""
        try:
            state = torch.load(path / "state.pt", map_location="cpu", weights_only=False)
            model_state = state["model"]
        except Exception as e:  # noqa: BLE001 - whatever is wrong with the file, it is refused
            raise CheckpointError(f"{path}/state.pt cannot be read: {type(e).__name__}: {e}") from e
        vocab = None
        if "d2t" in model_state:
            vocab = VocabMapping(d2t=model_state["d2t"].long(), t2d=model_state["t2d"].bool())
        try:
            draft = self.strategy.build_model(self.info, self.heads, vocab)
            draft.load_state_dict(with_frozen_state(draft, model_state), strict=True)
        except Exception as e:  # noqa: BLE001 - another strategy, shape or vocab
            raise CheckpointError(f"{path} is not a draft of this run: {e}") from e
        bad = [n for n, p in draft.state_dict().items()
               if p.is_floating_point() and not torch.isfinite(p).all()]  # fmt: skip
        if bad:
            raise CheckpointError(f"{path} has non-finite weights ({', '.join(bad[:3])})")
        return self._served(draft, version)


class Pointers(Protocol):
    """Where the run's latest checkpoint is."""

    def latest(self) -> tuple[int, Path] | None:
        """(step, directory) of the latest checkpoint, None when there is none yet."""

    def vocab(self) -> VocabMapping | None:
        """The run's draft vocabulary (None: not known yet)."""

    def close(self) -> None:
        """Let go of what it holds."""


class FilePointers:
    """The checkpoint directory's `latest` file (module doc)."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)

    def latest(self) -> tuple[int, Path] | None:
        try:
            name = (self.directory / "latest").read_text().strip()
        except OSError:
            return None
        match = STEP_DIR.search(name)
        return (int(match.group(1)) if match else -1), self.directory / name

    def vocab(self) -> VocabMapping | None:
        return None

    def close(self) -> None:
        pass


class KVPointers:
    """The run KV's checkpoint pointer and manifest, over a broker connection of its own."""

    def __init__(self, cfg: RunConfig, url: str):
        from specbus.consumers.loop_thread import LoopThread

        self.cfg, self.url = cfg, url
        self.loop = LoopThread("specbus-serve-kv")
        self._bus = self._run = None

    async def _kv(self):
        from specbus.bus.connection import connect
        from specbus.bus.run import open_run

        if self._bus is None:
            self._bus = await connect(self.cfg.bus, self.url, name="specbus-serve-drafts")
        if self._run is None:
            self._run = await open_run(self._bus, self.cfg.run)  # None until declared
        return None if self._run is None else self._run.kv

    def _call(self, what: str, timeout_s: float = 30.0):
        async def go():
            kv = await self._kv()
            return None if kv is None else await getattr(kv, what)()

        return self.loop.call(go(), timeout=timeout_s)

    def latest(self) -> tuple[int, Path] | None:
        pointer = self._call("get_checkpoint")
        if not pointer or "path" not in pointer:
            return None
        return int(pointer.get("step", -1)), Path(pointer["path"])

    def vocab(self) -> VocabMapping | None:
        manifest = self._call("get_manifest")
        if manifest is None:
            return None
        return VocabMapping.from_d2t(manifest.vocab.d2t, manifest.vocab.target_vocab_size)

    def close(self) -> None:
        if self._bus is not None:
            try:
                self.loop.call(self._bus.close(), timeout=10)
            except Exception as e:  # noqa: BLE001 - closing at exit
                log.debug("closing the KV connection: %s", e)
        self.loop.close()


def _files_key(path: Path) -> tuple:
    """What identifies one state of a checkpoint directory (a rewritten one is tried again)."""
    try:
        st = (path / "state.pt").stat()
        return str(path), st.st_size, st.st_mtime_ns
    except OSError:
        return str(path), None, None


class DraftFollower:
    """The reload thread (module doc): `start()`, `stop()`; `ready` is set once a first draft
    is served (or the first poll found none to serve)."""

    def __init__(self, loader: DraftLoader, pointers: Pointers, slot: DraftSlot,
                 stats: SpecStats | None = None, poll_s: float = 1.0):  # fmt: skip
        self.loader, self.pointers, self.slot, self.stats = loader, pointers, slot, stats
        self.poll_s = poll_s
        self.ready = threading.Event()
        self._stop = threading.Event()
        self._tried: tuple | None = None  # the files of the last pointer tried (loaded or not)
        self._thread = threading.Thread(target=self._run, name="specbus-reload", daemon=True)

    def start(self) -> DraftFollower:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
        self.pointers.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll()
            except Exception as e:  # noqa: BLE001 - an unreachable broker: try again later
                log.warning("draft reload: cannot read the checkpoint pointer: %s", e)
            self.ready.set()
            self._stop.wait(self.poll_s)

    def poll(self) -> None:
        """One look at the pointer: load and publish a new checkpoint's draft; before any,
        the untrained one."""
        pointer = self.pointers.latest()
        if pointer is None:
            if self.slot.version is None:
                self._untrained()
            return
        step, path = pointer
        key = _files_key(path)
        if key == self._tried:
            return
        self._tried = key
        started = time.monotonic()
        try:
            draft = self.loader.load(path, max(step, 0))
        except CheckpointError as e:
            self._count("refused")
            why = " ".join(str(e).split())  # one line, whatever the loader said
            log.warning("draft reload refused %s (still serving version %s): %s", path,
                        self.slot.version, why[:600])  # fmt: skip
            if self.slot.version is None:
                self._untrained()
            return
        self._publish(draft, f"{path}, loaded in {time.monotonic() - started:.1f}s")

    def _untrained(self) -> None:
        vocab = self.pointers.vocab() if self.loader.needs_vocab else None
        if self.loader.needs_vocab and vocab is None:
            return  # no manifest yet (or no broker): decode without a draft for now
        self._publish(self.loader.untrained(vocab), "untrained")

    def _publish(self, draft: ServedDraft, how: str) -> None:
        self.slot.publish(draft)
        if self.stats is not None:
            self.stats.serving(draft.version)
        self._count("loaded")
        log.info("serving draft version %d (%s)", draft.version, how)

    def _count(self, outcome: str) -> None:
        if self.stats is not None:
            self.stats.reloads[outcome] = self.stats.reloads.get(outcome, 0) + 1


def wait_ready(follower: DraftFollower, timeout_s: float = math.inf) -> bool:
    """Block until the follower's first poll is done (True) or `timeout_s` passed."""
    return follower.ready.wait(None if math.isinf(timeout_s) else timeout_s)


def pointer_source(cfg: RunConfig, bus_url: str | None) -> Pointers:
    """The run KV's pointer with a broker URL, else the checkpoint directory's (module doc)."""
    if bus_url:
        return KVPointers(cfg, bus_url)
    directory = cfg.training.checkpoint_dir or (cfg.resolved_run_dir / "checkpoints")
    return FilePointers(directory)
