"""One optimizer step under torch.profiler: which collectives it ran, how many of each.

`training.profile_step: N` wraps step N of every rank (the step's forward/backward, the
gradient reduction, the lineage gather and the acks) and writes, per rank,
`step<N>-rank<r>.json` (collective name -> count, e.g. `nccl:all_reduce: 1` for a replicated
draft, `nccl:_reduce_scatter_base: 1` plus all-gathers under FSDP; gloo entries are the
control plane) and `step<N>-rank<r>.txt` (the op table by device time). This is how the
"one gradient collective per optimizer step" claim is checked on GPUs.
"""

from __future__ import annotations

import contextlib
import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import torch

_COLLECTIVE = ("nccl", "gloo", "c10d::", "allreduce", "all_reduce", "reduce_scatter",
               "allgather", "all_gather", "broadcast", "barrier")  # fmt: skip


def collective_counts(events) -> dict[str, int]:
    """Count profiler events whose name is a collective (host-side op records and kernels)."""
    counts: Counter[str] = Counter()
    for event in events:
        name = event.name
        if any(key in name.lower() for key in _COLLECTIVE):
            counts[name] += 1
    return dict(sorted(counts.items()))


@contextlib.contextmanager
def profiled_step(directory: Path, step: int, rank: int) -> Iterator[None]:
    """Profile the enclosed optimizer step on this rank: its collectives (counts by name) to
    `<dir>/step<N>-rank<r>.json`, the op table to `.txt`."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        yield
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    directory.mkdir(parents=True, exist_ok=True)
    events = prof.events()
    report = {"step": step, "rank": rank, "collectives": collective_counts(events)}
    stem = directory / f"step{step}-rank{rank}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1))
    sort = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    stem.with_suffix(".txt").write_text(prof.key_averages().table(sort_by=sort, row_limit=40))
