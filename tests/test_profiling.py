"""`consumers/profiling.device_timeline`: the GPU activity of a profiled step, read from the
Chrome trace torch.profiler exports (what `training.profile_step` writes), and what the
profiled step writes on this machine."""

from __future__ import annotations

import gzip
import json

import pytest
import torch
from specbus.consumers.profiling import device_timeline, profiled_step


def kernel(stream: int, ts: float, dur: float, cat: str = "kernel") -> dict:
    return {"ph": "X", "cat": cat, "name": "k", "ts": ts, "dur": dur, "args": {"stream": stream}}


def test_streams_their_union_and_their_overlap():
    # stream 7 (the step): [0, 100) and [150, 250) us; stream 13 (the capture): [50, 200) us,
    # and a copy on stream 7 at [260, 270); a CPU op spans [-10, 300) (the step's wall)
    trace = {"traceEvents": [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": -10, "dur": 310},
        kernel(7, 0, 100), kernel(7, 150, 100), kernel(13, 50, 150),
        kernel(7, 260, 10, cat="gpu_memcpy"),
        {"ph": "i", "cat": "kernel", "name": "instant", "ts": 400},  # no duration: ignored
    ]}  # fmt: skip
    t = device_timeline(trace)
    assert t["streams"] == {"13": pytest.approx(0.15), "7": pytest.approx(0.21)}
    assert t["busy_ms"] == pytest.approx(0.26)  # [0, 250) and [260, 270)
    assert t["overlap_ms"] == pytest.approx(0.10)  # [50, 100) and [150, 200)
    assert t["wall_ms"] == pytest.approx(0.31)
    assert t["busy_frac"] == pytest.approx(0.26 / 0.31)


def test_a_trace_without_device_activity_is_all_zeros():
    trace = {"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": 5, "dur": 20}]}
    t = device_timeline(trace)
    assert t == {"streams": {}, "busy_ms": 0.0, "overlap_ms": 0.0, "wall_ms": 0.02,
                 "busy_frac": 0.0}  # fmt: skip
    assert device_timeline({})["wall_ms"] == 0.0


def test_the_profiled_step_writes_its_trace_and_timeline(tmp_path):
    x = torch.randn(64, 64, requires_grad=True)
    with profiled_step(tmp_path, 3, 0):
        (x @ x).sum().backward()
    report = json.loads((tmp_path / "step3-rank0.json").read_text())
    assert report["step"] == 3 and report["rank"] == 0
    timeline = report["timeline"]
    assert timeline["wall_ms"] > 0
    if not torch.cuda.is_available():
        assert timeline["busy_ms"] == 0.0 and timeline["streams"] == {}
    with gzip.open(tmp_path / "step3-rank0.trace.json.gz", "rt") as f:
        names = {e.get("name") for e in json.load(f)["traceEvents"]}
    assert "aten::mm" in names
    assert "aten::mm" in (tmp_path / "step3-rank0.txt").read_text()
