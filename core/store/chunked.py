"""Copy a tensor's bytes into store memory chunk by chunk, screening each chunk for NaN/Inf
while it is still in cache.

The NaN/Inf screen reads every byte of a floating tensor. As a pass of its own that is a
second trip through memory for bytes the put copies anyway (64 MB of bf16: ~9 ms to sum from
DRAM here, against ~12 ms for the copy). Summing each ~1 MiB chunk right after it was copied
reads it from L2 (2 MiB per core here) instead: one pass over DRAM, not two. Measured at 64
MB: ~17 ms fused against ~21 ms for copy then sum. The bf16 sum is compute-bound even from L2
(~14-22 GB/s on one core), so the screen still costs a quarter or so of an shm put.

The screen is a sum per chunk (a NaN or Inf poisons it). Only a chunk whose sum is not finite
pays for the exact element-wise check, so a large-but-finite chunk whose sum overflows (fp16
above 65504) is never rejected. A rejection names the sample and the tensor.

`SharedScreen` splits one sample's screen between the put's own thread and a helper (the
store's screen worker, a long-lived nice-19 thread): the put's thread claims chunks from
the front as it writes them (summing each from cache, as above), the helper claims chunks
from the back, and at `finish` the put's thread sums whatever the helper has not finished
itself, never waiting for it. So the screen runs beside the put where a core is idle, and
costs no more than the inline screen where none is (a starved helper takes nothing).
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable

import torch
from specbus.core.errors import IntegrityError

CHUNK_BYTES = 1 << 20  # fits L2 with room for the destination; measured flat from 256 KiB to 1 MiB

Writer = Callable[[int, torch.Tensor], None]  # (first element, chunk) -> None


def copy_screened(
    sample_id: str,
    name: str,
    src: torch.Tensor,
    write: Writer,
    *,
    screen: bool,
    shared: SharedScreen | None = None,
    chunk_bytes: int = CHUNK_BYTES,
) -> None:
    """Hand `src` (contiguous, CPU) to `write` in order, as flat chunks of ~`chunk_bytes`.

    With `screen` and a floating `src`, each chunk is summed right after `write` returned;
    IntegrityError (naming sample and tensor) is raised once every chunk is written if any
    value is NaN/Inf: the caller discards what was written. With `shared` (which holds `src`
    and the sample's other tensors, in write order), each chunk just written is summed
    unless the helper took it; the verdict comes from `shared.finish()`.
    """
    flat = src.reshape(-1)
    step = max(chunk_bytes // max(flat.element_size(), 1), 1)
    screened = screen and flat.is_floating_point()
    sums: list[float] | None = [] if screened and shared is None else None
    for start in range(0, flat.numel(), step):
        chunk = flat[start : start + step]
        write(start, chunk)
        if sums is not None:
            sums.append(chunk.sum().item())
        elif screened:
            shared.screen_next()  # this chunk, still in cache, unless the helper has it
    if sums:
        _check_sums(sample_id, name, flat, step, sums)


class SharedScreen:
    """The NaN/Inf screen of one sample's floating CPU tensors, as chunks two threads share.

    Chunks are ordered as the put writes them (tensor by tensor, `chunk_bytes` each). The
    put's thread claims them from the front (`screen_next`, right after writing each), a
    helper thread from the back (`help`); a claim is taken under a lock, so no chunk is
    claimed twice. `finish` (the put's thread) stops the helper and sums every chunk whose
    sum is not in yet, including one the helper is still on (redone, not waited for), then
    raises IntegrityError naming the sample and the tensor if any value is NaN/Inf.
    """

    def __init__(
        self, sample_id: str, tensors: dict[str, torch.Tensor], chunk_bytes: int = CHUNK_BYTES
    ):
        self.sample_id = sample_id
        self._tensors: list[tuple[str, torch.Tensor, int, int]] = []  # name, flat, step, first
        self._chunks: list[torch.Tensor] = []
        for name, t in tensors.items():
            if not t.is_floating_point() or not t.numel():
                continue
            flat = t.reshape(-1)
            step = max(chunk_bytes // flat.element_size(), 1)
            self._tensors.append((name, flat, step, len(self._chunks)))
            self._chunks += [flat[i : i + step] for i in range(0, flat.numel(), step)]
        self.sums: list[float | None] = [None] * len(self._chunks)
        self._lock = threading.Lock()
        self._front, self._back = 0, len(self._chunks)  # unclaimed: [front, back)

    @property
    def nbytes(self) -> int:
        """Bytes of floating tensors this screen covers."""
        return sum(f.numel() * f.element_size() for _, f, _, _ in self._tensors)

    def screen_next(self) -> None:
        """The put's thread: sum the next chunk in write order, unless the helper took it."""
        with self._lock:
            i = self._front
            if i >= self._back:
                return
            self._front += 1
        self.sums[i] = self._chunks[i].sum().item()

    def help(self) -> None:
        """The helper: sum chunks from the back until none is left or `finish` began."""
        while True:
            with self._lock:
                if self._back <= self._front:
                    return
                self._back -= 1
                i = self._back
            self.sums[i] = self._chunks[i].sum().item()

    def cancel(self) -> None:
        """The put failed otherwise: the helper takes no more chunks (no verdict needed)."""
        with self._lock:
            self._back = self._front

    def finish(self) -> None:
        """Sum what the helper did not, then raise `IntegrityError` if any chunk held NaN or Inf."""
        with self._lock:
            self._back = self._front  # the helper takes no more chunks
        for i, s in enumerate(self.sums):
            if s is None:  # unclaimed, or the helper is still on it: do it here
                self.sums[i] = self._chunks[i].sum().item()
        for name, flat, step, first in self._tensors:
            n = -(-flat.numel() // step)
            _check_sums(self.sample_id, name, flat, step, self.sums[first : first + n])


def copy_into(
    sample_id: str,
    name: str,
    src: torch.Tensor,
    dst: torch.Tensor,
    *,
    screen: bool,
    shared: SharedScreen | None = None,
) -> None:
    """Copy `src` into `dst` (a flat uint8 tensor of exactly src's byte size), screened."""
    typed = dst.view(src.dtype) if src.numel() else dst

    def write(start: int, chunk: torch.Tensor) -> None:
        typed[start : start + chunk.numel()].copy_(chunk)

    copy_screened(sample_id, name, src, write, screen=screen, shared=shared)


def write_fd(
    sample_id: str,
    name: str,
    src: torch.Tensor,
    fd: int,
    *,
    screen: bool,
    shared: SharedScreen | None = None,
) -> None:
    """Write `src`'s bytes to `fd` from its current offset (short writes resumed), screened."""

    def write(_: int, chunk: torch.Tensor) -> None:
        mv = memoryview(chunk.view(torch.uint8).numpy()).cast("B")
        done = 0
        while done < len(mv):
            done += os.write(fd, mv[done:])

    copy_screened(sample_id, name, src, write, screen=screen, shared=shared)


def screen_whole(sample_id: str, name: str, t: torch.Tensor) -> None:
    """The same screen without a copy (one sum over the tensor, exact check only if needed)."""
    if t.is_floating_point() and t.numel():
        flat = t.reshape(-1)
        _check_sums(sample_id, name, flat, flat.numel(), [flat.sum().item()])


def _check_sums(
    sample_id: str, name: str, flat: torch.Tensor, step: int, sums: list[float]
) -> None:
    if all(math.isfinite(s) for s in sums):
        return
    bad = 0
    for i, s in enumerate(sums):
        if not math.isfinite(s):  # overflowed or poisoned: count exactly
            bad += int((~torch.isfinite(flat[i * step : (i + 1) * step])).sum())
    if bad:
        raise IntegrityError(f"sample {sample_id!r}: tensor {name!r} holds {bad} NaN/Inf value(s)")
