"""The H200 benchmarks' code paths on the CPU (`--tiny`): a device call costs minutes of a
30-minute budget, so a script that cannot start, or reports nothing, must fail here first.
And the compile limit the GPU runs rely on (core/models/kernels.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _bench(module: str, *args: str, timeout: float = 180) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", f"specbus.ops.bench.{module}", *args], cwd=ROOT,
                   env=env, check=True, timeout=timeout, capture_output=True)  # fmt: skip


def test_mixed_lengths_probe_reports_every_phase(tmp_path):
    out = tmp_path / "mixed.json"
    phases = "new,seen,fixed,new@torchsdpa,new@bucket"
    _bench("mixed_lengths", "--tiny", "--n", "2", "--phases", phases, "--out", str(out))
    rows = json.loads(out.read_text())["results"]["dspark"]
    assert list(rows) == phases.split(",")
    for row in rows.values():
        assert row["n"] == 2 and len(row["prefill_ms"]) == len(row["step_ms"]) == 2
        assert row["prefill_ms_mean"] > 0 and row["step_ms_mean"] > 0 and row["samples_per_s"] > 0


def test_attention_kernel_bench_reports_every_kernel_it_can_run(tmp_path):
    """On the CPU only the math kernel and the matrix yardstick run; the rows are there."""
    out = tmp_path / "attention.json"
    _bench("attention_kernels", "--seqs", "64", "--reps", "1", "--out", str(out))
    (rows,) = json.loads(out.read_text())["rows"]
    assert rows["seq"] == 64
    for name in ("fwd math gqa", "fwd math repeated", "fwd+bwd math repeated"):
        assert rows[name]["ms"] > 0, name
    assert rows["fwd math repeated"]["max_rel_diff"] < 1e-5  # repeated heads = GQA
    assert rows["matmul L x 4096 x 12288"]["tflops"] >= 0


def test_step_profile_reports_each_strategy(tmp_path):
    out = tmp_path / "profile.json"
    _bench("step_profile", "--tiny", "--strategies", "dspark,eagle3", "--seqs", "64",
           "--reps", "1", "--warmup", "1", "--out", str(out))  # fmt: skip
    report = json.loads(out.read_text())
    results = report["results"]
    assert sorted(results) == ["dspark", "eagle3"]
    for by_seq in results.values():
        (row,) = by_seq.values()
        assert row["step_ms"] > 0 and row["ops"] > 0
        assert "mfu" in row  # None: no peak is known for a CPU (ops/bench/flops.py)
    # the FLOPs per step, once per configuration, with the convention they follow
    assert sorted(report["flops"]["per_sample"]) == ["dspark/64", "eagle3/64"]
    assert all(f["train_step"] > 0 for f in report["flops"]["per_sample"].values())
    assert "model FLOPs" in report["flops"]["convention"]


def test_capture_bench_times_every_arm_on_the_same_weights(tmp_path, capsys):
    out = tmp_path / "capture.json"
    arms = "eager,compiled,graphs,compiled+graphs,fp8"
    _bench("capture", "--tiny", "--reps", "1", "--warmup", "1", "--new", "2", "--arms", arms,
           "--out", str(out))  # fmt: skip
    report = json.loads(out.read_text())
    assert sorted(report["fixed"], key=int) == ["64", "128"]  # 2048, 4096 scaled for --tiny
    for row in report["fixed"].values():
        assert row["eager_ms"] > 0 and row["compiled_ms"] > 0 and row["compiled_over_eager"] > 0
        assert 0 <= row["max_rel_diff"] < 0.05  # bf16 weights: at most a few roundings apart
        for arm in ("graphs", "compiled+graphs"):  # the CPU: bucketed, maskless, no graph
            assert row[f"{arm}_over_eager"] > 0 and 0 <= row[f"{arm}_max_rel_diff"] < 0.05
        assert all(row[f"{arm}_host_ms"] > 0 for arm in ("eager", "compiled", "graphs"))
        # target.quantize fp8 on its own copy of the weights: near, not equal (random weights)
        assert row["fp8_ms"] > 0 and 1e-3 < row["fp8_rel_err"] < 0.15, row["fp8_rel_err"]
        assert row["compiled_rel_err"] < 0.05
    assert len(report["new"]["lengths"]) == 2 and report["new"]["compiled_ms_mean"] > 0
    assert report["new"]["compiled+graphs_ms_mean"] > 0
    # the perf summary of a capture-only call (gpu.sh STAGES=capture): a line per length and arm
    from specbus.ops.bench import perf_summary

    assert perf_summary.main([str(tmp_path), "--out", str(tmp_path / "summary.json")]) == 0
    text = capsys.readouterr().out
    for seq in ("64", "128"):
        for arm in ("eager", "compiled", "graphs", "compiled+graphs"):
            line = re.search(rf"^c1\s+{re.escape(f'{seq}/{arm}')}\s+[\d.]+ ms, "
                             rf"host [\d.]+ ms, [\d.]+x eager", text, re.M)  # fmt: skip
            assert line, (seq, arm, text)
    first = report["fixed"]["64"]
    assert first["compiled_graphs"] >= 1 and first["eager_graphs"] == 0


def test_the_compile_limit_is_raised_above_dynamos_default():
    """Size-range guards recompile the dynamic kernels now and then; at Dynamo's default of 8
    graphs a function would run eagerly for good (docs/benchmarks.md, "Mixed lengths")."""
    import torch._dynamo.config as dynamo
    from specbus.core.models.kernels import RECOMPILE_LIMIT, raise_recompile_limit

    before = dynamo.recompile_limit
    try:
        dynamo.recompile_limit = 8
        raise_recompile_limit()
        assert dynamo.recompile_limit == RECOMPILE_LIMIT >= 32
    finally:
        dynamo.recompile_limit = before


@pytest.mark.slow
def test_long_context_bench_reports_every_length_and_the_check(tmp_path):
    """The sweep (long paths and checkpointing below their GPU thresholds), the check of the
    long paths against the plain one, and the memory slope, on the tiny target."""
    out = tmp_path / "long.json"
    _bench("long_context", "--tiny", "--stages", "sweep", "--seqs", "128,256", "--check", "128",
           "--chunk-tokens", "64", "--checkpoint-tokens", "256", "--ttt", "2", "--profile", "256",
           "--out", str(out))  # fmt: skip
    sweep = json.loads(out.read_text())["sweep"]
    assert sweep["check"]["loss_rel"] < 1e-5 and sweep["check"]["grad_rel_max"] < 1e-4
    assert [sweep[s]["checkpointed"] for s in ("128", "256")] == [False, True]
    assert all(sweep[s]["chunked"] and sweep[s]["tokens_per_s"] > 0 for s in ("128", "256"))
    profiled = sweep["256"]["profile"]  # the phases' wall times (no device kernels on a CPU)
    assert set(profiled["wall_ms"]) == {"capture", "step"}
    for phase in ("capture", "step"):
        assert profiled["wall_ms"][phase] > 0
        assert profiled[phase]["busy_ms"] + profiled[phase]["idle_ms"] == pytest.approx(
            profiled["wall_ms"][phase], abs=0.2
        )


def test_busy_time_is_the_union_of_overlapping_kernels():
    from specbus.ops.bench.long_context import busy_ms

    ms = 1_000_000
    assert busy_ms([]) == 0
    # two streams overlapping, one span inside another, a gap, a span touching the last one
    spans = [(0, 4 * ms), (2 * ms, 6 * ms), (3 * ms, 5 * ms), (8 * ms, 9 * ms), (9 * ms, 10 * ms)]
    assert busy_ms(spans) == 8


def test_a_kernel_seen_in_both_profiler_lists_counts_once():
    from specbus.ops.bench.long_context import distinct

    work = [("gemm", 1000, 5000), ("gemm", 1400, 5400), ("gemm", 9000, 9500), ("exp", 1000, 2000)]
    assert distinct(work) == [("exp", 1000, 2000), ("gemm", 1000, 5000), ("gemm", 9000, 9500)]


@pytest.mark.slow
def test_long_context_bench_runs_dflash_in_both_modes_and_times_other_sdpa_orders(tmp_path):
    """Issue 25's other rows: DFlash's sweep, each SDPA order's capture of the same sample, and
    the pipeline colocated and disaggregated (a producer process, the shm store) on the tiny
    target."""
    out = tmp_path / "long.json"
    _bench("long_context", "--tiny", "--strategy", "dflash", "--stages", "sweep,pipeline",
           "--seqs", "128", "--pipeline-seqs", "128", "--modes", "colocated,disaggregated",
           "--capture-orders", "default;math", "--out", str(out), timeout=300)  # fmt: skip
    report = json.loads(out.read_text())
    assert "check" not in report["sweep"]  # the chunked-path check is EAGLE3's
    row = report["sweep"]["128"]
    assert row["tokens_per_s"] > 0 and not row["chunked"] and not row["checkpointed"]
    assert sorted(row["capture_s_by_order"]) == ["default", "math"]
    assert all(s > 0 for s in row["capture_s_by_order"].values())
    for mode in ("colocated", "disaggregated"):
        run = report["pipeline"][mode]["128"]
        assert "error" not in run, run.get("error")
        assert run["samples_per_s"] > 0 and run["steady_steps"] >= 1
    assert report["flops"]["per_sample"]["128"]["train_step"] > 0


@pytest.mark.slow
def test_pipeline_bench_runs_a_compiled_capture_and_profiles_a_step(tmp_path):
    """gpu_pipeline's `+compile` mode (target.compile in the trainer's own capture),
    `+fp8` (target.quantize), `+graphs` (on the CPU the bucketed maskless prefill, with its warning kept in the row),
    `+overlap` (training.overlap_steps, the CUDA default, forced on the CPU) and
    `--profile-step` (the step's timeline in the row, its trace kept beside the report; a
    step of the measured window is refused)."""
    out = tmp_path / "gpu_pipeline_128.json"
    mode = "colocated+compile+graphs+overlap+fp8"
    refused = subprocess.run(
        [sys.executable, "-m", "specbus.ops.bench.gpu_pipeline", "--tiny", "--warmup", "2",
         "--profile-step", "3"], capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert refused.returncode == 2 and "lies in the measured window" in refused.stderr
    _bench("gpu_pipeline", "--tiny", "--seqs", "128", "--modes", mode,
           "--steps", "6", "--warmup", "3", "--log-every", "1", "--colocated-prefetch", "1",
           "--profile-step", "1", "--timeout", "200", "--out", str(out), timeout=300)  # fmt: skip
    row = json.loads(out.read_text())["results"]["128"][mode]
    assert "error" not in row, row.get("error")
    assert row["samples_per_s"] > 0 and row["steady_steps"] == 3 and row["capture_frac"] > 0
    assert row["timeline"]["wall_ms"] > 0  # no device events on a CPU: busy 0
    assert row["profile_trace"] == f"trace_128_{mode}.json.gz"
    assert (tmp_path / row["profile_trace"]).stat().st_size > 0
    assert any("target.cuda_graphs" in line for line in row["warnings"]["train"]), row["warnings"]
