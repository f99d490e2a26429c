"""perf_summary merges the perf bench's device calls (ops/bench/gpu.sh, BENCH=perf: one call
per stage or two, each with its own floor probe): every row against its own call's floor,
the MFU column, the FLOPs per sample once, issue 26's goals. The calls' files are written
here in the formats the benches write (floor.py's lines, gpu_pipeline's and gpu_dflash's
JSON reports, stages.txt); and gpu.sh's plan: every stage fits a call with the floor probe."""

from __future__ import annotations

import json
import os
import re
import subprocess
import tarfile
from pathlib import Path

import pytest
from specbus.core.config import build_config
from specbus.ops.bench import flops, perf_summary
from specbus.ops.bench.random_target import QWEN3_8B

ROOT = Path(__file__).resolve().parent.parent
H200 = "NVIDIA H200"


def floor_log(figures: dict[int, tuple[float, float]]) -> str:
    """floor.py's output: `L=...: capture ... | draft TTT step ... | colocated floor ...`."""
    lines = ["target built in 9.1s, params 8.19B"]
    for seq, (tc, ts) in figures.items():
        lines.append(
            f"L={seq}: capture {tc * 1e3:.0f} ms ({seq / tc:.0f} tok/s, "
            f"{2 * 8.2e9 * seq / tc / 1e12:.0f} TFLOP/s) | draft TTT step {ts * 1e3:.0f} ms | "
            f"colocated floor {1 / (tc + ts):.2f} samples/s, capture share {tc / (tc + ts):.0%} | "
            f"peak 30.6 GiB"
        )
    return "\n".join(lines) + "\n"


def pipeline_row(
    samples_per_s: float, seq: int, flops_total: float, colocated: bool, backlog: float = 0.0
) -> dict:
    """A row as gpu_pipeline.summarize + run_mode + main write it."""
    row = {
        "steady_steps": 16, "samples_per_s": samples_per_s, "tokens_per_s": samples_per_s * seq,
        "step_ms": 1000 / samples_per_s, "data_wait_frac": 0.1, "bus_ms_per_step": 1.7,
        "trainer_peak_alloc_gib_history": 30.0, "loss_last": 9.1,
        "train_mem": {"peak_allocated_gib": 30.3, "peak_reserved_gib": 31.0}, "wall_s": 80.0,
        "mfu": flops.mfu(flops_total, samples_per_s, flops.peak_flops(H200)[0]),
    }  # fmt: skip
    if colocated:
        row["capture_frac"] = 0.3
    else:
        row["produce_mem"] = {"peak_allocated_gib": 15.5, "peak_reserved_gib": 15.7}
        row["backlog_trained"] = backlog
        row["captured_per_s"] = samples_per_s * (16 - max(0.0, backlog)) / 16
    return row


def write_eagle3(out: Path, seq: int, coloc: float, disagg: float, backlog: float = 0.0) -> dict:
    """gpu_pipeline's report of `--seqs seq` (as gpu.sh's eagle3-<seq> stage names it)."""
    strategy = build_config({"strategy": {"ttt_length": 7,
                                          "draft": {"draft_vocab_size": 32000}}}).strategy  # fmt: skip
    section = flops.flops_section(H200)
    per = section["per_sample"][str(seq)] = flops.sample_flops(strategy, QWEN3_8B, seq)
    results = {str(seq): {"colocated": pipeline_row(coloc, seq, per["total"], True),
                          "disaggregated": pipeline_row(disagg, seq, per["total"], False,
                                                        backlog),
                          "ratio_disagg_over_coloc": disagg / coloc}}  # fmt: skip
    report = {"args": {"seqs": str(seq)}, "device": H200, "torch": "2.11.0+cu130",
              "results": results, "flops": section}  # fmt: skip
    (out / f"gpu_pipeline_{seq}.json").write_text(json.dumps(report, indent=1))
    return per


def write_dflash(out: Path, runs: dict[str, float]) -> None:
    """gpu_dflash's report: one colocated row per `strategy:lo-hi`."""
    section = flops.flops_section(H200)
    results = {}
    for key, sps in runs.items():
        name, lengths = key.split(":")
        lo, hi = (int(x) for x in lengths.split("-"))
        strategy = build_config({"strategy": {"name": name, "mask_token_id": 151935}}).strategy
        per = section["per_sample"][key] = flops.mean_sample_flops(strategy, QWEN3_8B, lo, hi)
        row = pipeline_row(sps, (lo + hi) // 2, per["total"], True)
        goal = perf_summary.row_goal("dflash", key)
        row.update(vs_seed=sps / 5.7, goal_samples_per_s=goal.samples_per_s,
                   vs_goal=sps / goal.samples_per_s)  # fmt: skip
        results[key] = row
    report = {"args": {}, "device": H200, "torch": "2.11.0+cu130",
              "seed": {"samples_per_s": 5.7, "capture_frac": 0.112}, "results": results,
              "flops": section}  # fmt: skip
    (out / "gpu_dflash.json").write_text(json.dumps(report, indent=1))


def test_a_rows_variant_is_held_to_its_modes_goal():
    """`+compile` / `@compile` rows are settings users can choose: they count for the goal of
    the mode they vary, the colocated one before the best-mode one."""
    goal = perf_summary.row_goal
    assert goal("eagle3", "2048/colocated+compile").name == "EAGLE3 2048, colocated"
    assert goal("eagle3", "2048/colocated").name == "EAGLE3 2048, colocated"
    assert goal("eagle3", "2048/disaggregated+compile").name == "EAGLE3 2048, best mode"
    assert goal("eagle3", "4096/colocated+compile").name == "EAGLE3 4096, best mode"
    assert goal("dflash", "dspark:512-4096@compile").name == "DSpark 512-4096"
    assert goal("dflash", "dflash:2048-2048@compile").name == "DFlash 2048"
    assert goal("dflash", "dspark:2048-2048") is None


def test_two_calls_merge_each_row_against_its_own_floor(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(flops.PEAK_ENV, raising=False)
    # call 1: the floor probe and EAGLE3 at 2048 (a directory, as gpu.sh's $PERF)
    c1 = tmp_path / "c1"
    c1.mkdir()
    (c1 / "floor.log").write_text(floor_log({2048: (0.067, 0.094), 4096: (0.137, 0.219)}))
    per_2048 = write_eagle3(c1, 2048, coloc=8.1, disagg=9.3)
    (c1 / "stages.txt").write_text("stage floor exit 0 in 41s of 90s (total 60s)\n"
                                   "stage eagle3-2048 exit 0 in 201s of 360s (total 262s)\n")  # fmt: skip
    # call 2, on a slower machine: the floor probe, EAGLE3 at 4096 and the DFlash family,
    # returned as the call's perf.tgz
    c2 = tmp_path / "c2"
    c2.mkdir()
    (c2 / "floor.log").write_text(floor_log({2048: (0.070, 0.098), 4096: (0.140, 0.224)}))
    # its disaggregated window trained 4 of its 16 refs from a backlog captured before it
    write_eagle3(c2, 4096, coloc=4.2, disagg=4.6, backlog=4)
    report = json.loads((c2 / "gpu_pipeline_4096.json").read_text())  # a run's warning
    failed = "WARNING specbus.capture: target.cuda_graphs: capturing the prefill failed"
    report["results"]["4096"]["colocated"]["warnings"] = {"train": [failed]}
    (c2 / "gpu_pipeline_4096.json").write_text(json.dumps(report))
    write_dflash(c2, {"dspark:512-4096": 6.9, "dflash:2048-2048": 9.4})
    tgz = tmp_path / "returned" / "perf.tgz"
    tgz.parent.mkdir()
    with tarfile.open(tgz, "w:gz") as tar:
        tar.add(c2, arcname=".")

    out = tmp_path / "summary.json"
    assert perf_summary.main([str(c1), str(tgz.parent), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    summary = json.loads(out.read_text())

    floors = {c["label"]: c["floor"] for c in summary["calls"]}
    assert floors["c1"]["2048"]["samples_per_s"] == 6.21  # 1 / (0.067 + 0.094)
    assert floors["c2"]["2048"]["samples_per_s"] == 5.95
    rows = {(r["call"], r["key"]): r for c in summary["calls"] for r in c["rows"]}
    assert set(rows) == {("c1", "2048/colocated"), ("c1", "2048/disaggregated"),
                         ("c2", "4096/colocated"), ("c2", "4096/disaggregated"),
                         ("c2", "dspark:512-4096"), ("c2", "dflash:2048-2048")}  # fmt: skip
    for (call, key), r in rows.items():
        seq = key.split("/")[0] if r["bench"] == "eagle3" else "2048"
        assert r["floor_samples_per_s"] == floors[call][seq]["samples_per_s"]
        assert r["x_floor"] == pytest.approx(r["samples_per_s"] / r["floor_samples_per_s"])
        assert r["floor_same_length"] == (key != "dspark:512-4096")
        assert 0 < r["mfu"] < 1
    peak = flops.peak_flops(H200)[0]
    assert rows["c1", "2048/colocated"]["mfu"] == pytest.approx(8.1 * per_2048["total"] / peak)
    assert [rows["c1", "2048/colocated"]["goal"], rows["c1", "2048/disaggregated"]["goal"]] == [
        8.0, 9.0]  # fmt: skip

    # the printed table: each row with its call, MFU and goal, and its own call's floor
    header = next(line for line in text.splitlines() if line.startswith("call "))
    assert re.search(r"samples/s\s+MFU\s+goal", header)
    mfu_c1 = f"{rows['c1', '2048/colocated']['mfu']:.0%}"
    assert re.search(
        rf"c1\s+eagle3\s+2048/colocated\s+8\.10\s+{mfu_c1}\s+8\.0\s+1\.01\s+6\.21\s", text
    )
    assert re.search(
        r"c2\s+eagle3\s+4096/disaggregated\s+4\.60\s+\d+%\s+4\.5\s+1\.02\s+2\.75\s", text
    )
    assert re.search(r"c2\s+dflash\s+dspark:512-4096\s+6\.90\s+\d+%\s+7\.5\s+0\.92\s+5\.95\*", text)
    assert re.search(r"eagle3\s+2048\s+prefill 30\.92 TFLOP, train step 34\.44 TFLOP", text)
    assert len(re.findall(r"^eagle3\s+2048\s+prefill", text, re.M)) == 1  # once, not per row

    goals = {g["goal"]: g for g in summary["goals"]}
    assert [(g["samples_per_s_goal"], g["best"], g["call"], g["met"]) for g in summary["goals"]] == [
        (9.0, 9.3, "c1", True), (8.0, 8.1, "c1", True), (4.5, 4.2, "c2", False),
        (7.5, 6.9, "c2", False), (9.0, 9.4, "c2", True)]  # fmt: skip
    assert goals["EAGLE3 2048, best mode"]["row"] == "2048/disaggregated"
    # 4.6 trained, 3.45 captured inside the window: the colocated 4.2 is the best it sustained
    assert rows["c2", "4096/disaggregated"]["goal_samples_per_s"] == pytest.approx(3.45)
    assert goals["EAGLE3 4096, best mode"]["row"] == "4096/colocated"
    assert "DSpark 512-4096 >= 7.5: 6.90 (dspark:512-4096, call c2) missed (0.92x)" in text
    assert "EAGLE3 2048, colocated >= 8.0: 8.10 (2048/colocated, call c1) met" in text
    assert not re.search(r">= (7\.0|3\.2|6\.5)\b", text)  # issues 15/16's goals are gone
    assert "c1: stage eagle3-2048 exit 0 in 201s of 360s" in text
    assert f"c2: 4096/colocated train: {failed}" in text  # what a row's figures cannot show
    assert rows["c2", "4096/colocated"]["warnings"] == {"train": [failed]}


def test_a_disaggregated_row_without_its_backlog_claims_no_goal():
    row = pipeline_row(9.4, 2048, 65e12, False)
    assert perf_summary.sustained("2048/disaggregated", row) == 9.4
    row.update(backlog_trained=6, captured_per_s=5.8)
    assert perf_summary.sustained("2048/disaggregated", row) == 5.8
    del row["captured_per_s"]  # the first rows with a backlog: one sample a steady step
    assert perf_summary.sustained("2048/disaggregated", row) == pytest.approx(9.4 * 10 / 16)
    del row["backlog_trained"]  # a row from before gpu_pipeline counted its backlog
    assert perf_summary.sustained("2048/disaggregated", row) is None
    assert perf_summary.sustained("2048/colocated", pipeline_row(8.0, 2048, 65e12, True)) == 8.0


def test_an_mfu_against_another_peak_and_a_call_without_a_floor(tmp_path, capsys):
    c1 = tmp_path / "c1"
    c1.mkdir()
    per = write_eagle3(c1, 2048, coloc=8.0, disagg=9.0)
    perf_summary.main([str(c1), "--peak-tflops", "500", "--out", str(tmp_path / "s.json")])
    rows = json.loads((tmp_path / "s.json").read_text())["calls"][0]["rows"]
    assert rows[0]["mfu"] == pytest.approx(8.0 * per["total"] / 500e12)
    assert rows[0]["floor_samples_per_s"] is None and rows[0]["x_floor"] is None
    assert "EAGLE3 4096, best mode >= 4.5: not measured" in capsys.readouterr().out


def test_a_profile_only_call_names_the_peak_its_mfu_is_against(tmp_path, capsys, monkeypatch):
    """A call of the profile stage alone (no pipeline report) still says which peak its step
    rows' MFU is read against: the profile's own flops section."""
    monkeypatch.delenv(flops.PEAK_ENV, raising=False)
    c1 = tmp_path / "c1"
    c1.mkdir()
    section = flops.flops_section(H200)
    section["per_sample"] = {"eagle3/2048": {"train_step": 34.44e12}}
    step = {"step_ms": 82.6, "kernel_ms": 77.6, "busy_frac": 0.94, "launches": 1342,
            "syncs": 4, "casts": 186, "compute_ops": 69, "peak_alloc_gib": 14.7, "mfu": 0.42}  # fmt: skip
    (c1 / "step_profile.json").write_text(json.dumps(
        {"device": H200, "results": {"eagle3": {"2048": step}}, "flops": section}))  # fmt: skip
    perf_summary.main([str(c1), "--out", str(tmp_path / "s.json")])
    text = capsys.readouterr().out
    assert f"MFU against: {section['peak_source']}" in text
    assert re.search(r"c1\s+eagle3/2048\s+step 82\.6 ms, MFU 42%", text)


STAGES = ("profile", "gputests", "eagle3-2048", "eagle3-4096", "dflash", "mixed", "capture")


@pytest.mark.parametrize("stage", STAGES)
def test_every_stage_fits_one_call_with_the_floor_probe(stage):
    """gpu.sh's plan (PLAN=1: nothing installed or run): the floor probe and the stage, their
    limits with the set-up, kill grace and summary reserves, under the 540 s a call may take;
    gpu_pipeline's / gpu_dflash's per-run timeouts fit inside their stage's limit."""
    env = {**os.environ, "PLAN": "1", "BENCH": "perf", "STAGES": stage}
    out = subprocess.run(["bash", "ops/bench/gpu.sh"], cwd=ROOT, env=env, check=True,
                         capture_output=True, text=True).stdout  # fmt: skip
    limits = dict(re.findall(r"plan: (\S+) limit (\d+)s", out))
    assert list(limits) == ["floor", stage]
    worst = int(re.search(r"worst case (\d+)s of 540s", out).group(1))
    assert worst <= 540 and worst >= int(limits["floor"]) + int(limits[stage])
    runs = {"eagle3-2048": (2, 115 + 15, 60), "eagle3-4096": (2, 115 + 15, 60),
            "dflash": (2, 120 + 15, 0)}  # fmt: skip
    if stage in runs:  # runs x (timeout + stop) + the producer's wait, with set-up to spare
        n, per_run, wait = runs[stage]
        assert n * per_run + wait < int(limits[stage])


def test_stages_that_do_not_fit_one_call_are_refused():
    env = {**os.environ, "PLAN": "1", "BENCH": "perf", "STAGES": "eagle3-2048,eagle3-4096"}
    done = subprocess.run(["bash", "ops/bench/gpu.sh"], cwd=ROOT, env=env, capture_output=True,
                          text=True)  # fmt: skip
    assert done.returncode == 2 and "refused" in done.stdout
