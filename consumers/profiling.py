"""One optimizer step under torch.profiler: which collectives it ran, how many of each.

`training.profile_step: N` wraps step N of every rank (the step's forward/backward, the
gradient reduction, the lineage gather and the acks) and writes, per rank,
`step<N>-rank<r>.json` (collective name -> count, e.g. `nccl:all_reduce: 1` for a replicated
draft, `nccl:_reduce_scatter_base: 1` plus all-gathers under FSDP; gloo entries are the
control plane; and `timeline`, below), `step<N>-rank<r>.txt` (the op table by device time)
and `step<N>-rank<r>.trace.json.gz` (the Chrome/Perfetto trace). This is how the "one
gradient collective per optimizer step" claim is checked on GPUs.

`timeline` says how busy the GPU was over the step and what ran beside it: the device time of
each CUDA stream's kernels and copies, their union, the time two streams ran at once, and
the step's wall time. In colocated mode the next window's capture runs on a stream of its own
(producers/colocated.py): the overlap is the part of it hidden behind the step.
"""

from __future__ import annotations

import contextlib
import gzip
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


_DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def union_ms(spans: list[tuple[float, float]]) -> float:
    """Total length of the union of `(start, end)` spans (microseconds in, as the profiler's
    times are; milliseconds out)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total / 1000


def device_timeline(trace: dict) -> dict:
    """GPU activity in a Chrome trace (`torch.profiler`'s export): per stream its device ms
    (`streams`, kernels + copies + memsets), `busy_ms` (their union: the GPU doing anything),
    `overlap_ms` (sum over streams less the union: time two or more streams ran at once),
    `wall_ms` (first to last event of any kind) and `busy_frac` = busy / wall. A trace without
    device events (the CPU) gives zeros."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    device = [e for e in events if e.get("cat") in _DEVICE_CATEGORIES]
    by_stream: dict[str, list[tuple[float, float]]] = {}
    for e in device:
        stream = str((e.get("args") or {}).get("stream", e.get("tid")))
        by_stream.setdefault(stream, []).append((float(e["ts"]), float(e["ts"]) + float(e["dur"])))
    streams = {s: union_ms(spans) for s, spans in sorted(by_stream.items())}
    busy = union_ms([span for spans in by_stream.values() for span in spans])
    if events:
        wall = (max(float(e["ts"]) + float(e["dur"]) for e in events)
                - min(float(e["ts"]) for e in events)) / 1000  # fmt: skip
    else:
        wall = 0.0
    return {
        "streams": streams,
        "busy_ms": busy,
        "overlap_ms": sum(streams.values()) - busy,
        "wall_ms": wall,
        "busy_frac": busy / wall if wall > 0 else 0.0,
    }


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
    stem = directory / f"step{step}-rank{rank}"
    trace = stem.with_suffix(".trace.json.gz")
    prof.export_chrome_trace(str(trace))
    with gzip.open(trace, "rt") as f:
        timeline = device_timeline(json.load(f))
    report = {"step": step, "rank": rank, "collectives": collective_counts(events),
              "timeline": timeline}  # fmt: skip
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1))
    sort = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    stem.with_suffix(".txt").write_text(prof.key_averages().table(sort_by=sort, row_limit=40))
