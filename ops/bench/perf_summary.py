"""The table of the perf bench (`BENCH=perf bash ops/bench/gpu.sh`), merged over its device
calls: each call runs the floor probe and one stage or a few, and this reads what every call
wrote (its `$PERF` directory, or the `perf.tgz` the call returned): floor.log,
gpu_pipeline*.json, gpu_dflash*.json, step_profile.json, capture.json, stages.txt, gputests.log.

It prints one table of every pipeline row of every call: samples/s, MFU (ops/bench/flops.py),
the row's goal (issue 26) and **the floor probe of the row's own call** (machines differ by a
few per cent from call to call: a row is read against the yardstick measured beside it); the
FLOPs per sample once; the one-step profiles; the prefill per capture arm (capture.py); each
goal's best row (a disaggregated row claims only what it sustained: `sustained`); and writes
summary.json.

    python -m specbus.ops.bench.perf_summary $PERF          # one call (gpu.sh runs this)
    python -m specbus.ops.bench.perf_summary c1/perf.tgz c2/perf.tgz c3/ --out runs/perf/summary.json
    python -m specbus.ops.bench.perf_summary ... --peak-tflops 989.5   # MFU against another peak
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
import re
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from specbus.ops.bench.flops import describe, fmt_mfu


@dataclass(frozen=True)
class Goal:
    """samples/s a row must reach: `bench` (eagle3 | dflash) and `rows`, a pattern over its row
    keys (`2048/colocated`, `dspark:512-4096`); over several rows the best one counts."""

    name: str
    bench: str
    rows: str
    samples_per_s: float


# Issue 26, one H200 per sample stream. "best mode": colocated or disaggregated on one GPU.
# A row's variant (`colocated+compile`, `dspark:512-4096@compile`) is a setting users can
# choose, so it counts for its goal.
GOALS = (
    Goal("EAGLE3 2048, best mode", "eagle3", "2048/*", 9.0),
    Goal("EAGLE3 2048, colocated", "eagle3", "2048/colocated*", 8.0),
    Goal("EAGLE3 4096, best mode", "eagle3", "4096/*", 4.5),
    Goal("DSpark 512-4096", "dflash", "dspark:512-4096*", 7.5),
    Goal("DFlash 2048", "dflash", "dflash:2048-2048*", 9.0),
)


def row_goal(bench: str, key: str) -> Goal | None:
    """The goal a row is held to: an exact key's before a pattern's (the colocated 2048 row
    is held to the colocated goal; either 2048 row can meet the best-mode one)."""
    matches = [g for g in GOALS if g.bench == bench and fnmatch.fnmatchcase(key, g.rows)]
    return min(matches, key=lambda g: (g.rows.count("*"), -len(g.rows)), default=None)


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def floor_figures(out: Path) -> dict:
    """`L=2048: capture 67 ms ... | draft TTT step 96 ms | colocated floor 6.12 samples/s`."""
    figures = {}
    try:
        text = (out / "floor.log").read_text()
    except OSError:
        return figures
    pattern = r"L=(\d+): capture (\d+) ms.*?draft TTT step (\d+) ms \| colocated floor ([\d.]+)"
    for m in re.finditer(pattern, text):
        figures[m.group(1)] = {
            "capture_ms": float(m.group(2)),
            "step_ms": float(m.group(3)),
            "samples_per_s": float(m.group(4)),
        }
    return figures


def call_dir(path: Path, scratch: Path) -> Path:
    """A call's directory: `path` itself, or the `perf.tgz` it is (or holds) unpacked."""
    if path.is_dir() and (path / "perf.tgz").is_file() and not (path / "stages.txt").exists():
        path = path / "perf.tgz"
    if path.is_file():
        target = scratch / f"call{len(list(scratch.iterdir()))}"
        with tarfile.open(path) as tar:
            tar.extractall(target, filter="data")
        return target
    return path


def _floor_for(floor: dict, seq: str | None) -> tuple[float | None, bool]:
    """The call's floor samples/s at `seq`, else at 2048 (a mixed-length row); and whether it
    is at the row's own length."""
    if seq in floor:
        return floor[seq]["samples_per_s"], True
    return floor.get("2048", {}).get("samples_per_s"), False


def _mfu(row: dict, flops: float | None, peak: float | None) -> float | None:
    """The row's MFU: against `peak` when given (`--peak-tflops`), else as the bench wrote it."""
    if peak is None:
        return row.get("mfu")
    if flops is None or "samples_per_s" not in row:
        return None
    return flops * row["samples_per_s"] / peak


def read_call(label: str, out: Path, peak: float | None) -> dict:
    """One call's rows, each with its call's floor probe, MFU and goal."""
    floor = floor_figures(out)
    call = {"label": label, "path": str(out), "floor": floor, "rows": [], "profile": [],
            "flops": {}, "device": None, "peak_source": None}  # fmt: skip
    sources = [("eagle3", p) for p in sorted(out.glob("gpu_pipeline*.json"))]
    sources += [("dflash", p) for p in sorted(out.glob("gpu_dflash*.json"))]
    for bench, path in sources:
        report = _json(path)
        call["device"] = call["device"] or report.get("device")
        section = report.get("flops") or {}
        call["peak_source"] = call["peak_source"] or section.get("peak_source")
        per_sample = section.get("per_sample") or {}
        results = report.get("results") or {}
        if bench == "eagle3":
            rows = [(f"{seq}/{mode}", seq, r) for seq, by_mode in results.items()
                    for mode, r in by_mode.items() if isinstance(r, dict)]  # fmt: skip
        else:  # `strategy:lo-hi[@variant]`: a fixed length has a floor at it
            rows = []
            for key, r in results.items():
                lo, _, hi = key.split(":", 1)[-1].split("@")[0].partition("-")
                rows.append((key, lo if lo == hi else None, r))
        for key, seq, r in rows:
            flops = per_sample.get(seq if bench == "eagle3" else key)
            if flops:
                call["flops"].setdefault(bench, {})[key.split("/")[0]] = flops
            fl, same_length = _floor_for(floor, seq)
            goal = row_goal(bench, key)
            entry = {"call": label, "bench": bench, "key": key, "file": path.name,
                     "floor_samples_per_s": fl, "floor_same_length": same_length,
                     "goal": goal.samples_per_s if goal else None}  # fmt: skip
            if "error" in r or "samples_per_s" not in r:
                entry["error"] = str(r.get("error", "no figures"))[-300:]
            else:
                sps = r["samples_per_s"]
                entry.update(
                    samples_per_s=sps, tokens_per_s=r.get("tokens_per_s"),
                    mfu=_mfu(r, flops and flops["total"], peak), step_ms=r.get("step_ms"),
                    capture_frac=r.get("capture_frac"), data_wait_frac=r.get("data_wait_frac"),
                    peak_alloc_gib=(r.get("train_mem") or {}).get("peak_allocated_gib"),
                    x_floor=sps / fl if fl else None,
                    x_goal=sps / goal.samples_per_s if goal else None,
                    goal_samples_per_s=sustained(key, r),
                )  # fmt: skip
            if r.get("warnings"):  # the run's processes' warnings (gpu_pipeline)
                entry["warnings"] = r["warnings"]
            call["rows"].append(entry)
    prof = _json(out / "step_profile.json")
    call["device"] = call["device"] or prof.get("device")
    call["peak_source"] = call["peak_source"] or (prof.get("flops") or {}).get("peak_source")
    per_step = (prof.get("flops") or {}).get("per_sample") or {}
    for name, by_seq in (prof.get("results") or {}).items():
        if "error" in by_seq:
            call["profile"].append({"call": label, "key": name, "error": by_seq["error"][-300:]})
            continue
        for seq, r in by_seq.items():
            flops = per_step.get(f"{name}/{seq}", {}).get("train_step")
            if flops:
                call["flops"].setdefault("step", {})[f"{name}/{seq}"] = {"train_step": flops}
            step = {"samples_per_s": 1000 / r["step_ms"], "mfu": r.get("mfu")}
            call["profile"].append(
                {"call": label, "key": f"{name}/{seq}", "mfu": _mfu(step, flops, peak)}
                | {k: r.get(k) for k in ("step_ms", "kernel_ms", "busy_frac", "launches",
                                         "syncs", "casts", "compute_ops", "peak_alloc_gib")}
            )  # fmt: skip
    call["capture"] = capture_rows(label, _json(out / "capture.json"))
    stages = out / "stages.txt"
    call["stages"] = stages.read_text().strip().splitlines() if stages.is_file() else []
    tests = out / "gputests.log"
    if tests.is_file():
        last = [line for line in tests.read_text().splitlines() if line.strip()][-1:]
        call["gputests"] = last[0] if last else "(empty)"
    return call


def sustained(key: str, row: dict) -> float | None:
    """What a row may claim for a goal: its rate, except for a disaggregated row, whose
    producer can capture ahead into the store while the trainer warms up and its window then
    times the trainer on a backlog. One that reports `backlog_trained` (gpu_pipeline since
    cc93f20) claims its rate when the window trained at most one ref from a backlog, else the
    rate of what was captured inside the window (a lower bound); one without it (before) is
    unverified: None."""
    if "disagg" not in key:  # `2048/disaggregated...`, `dflash:2048-2048@compile+disagg`
        return row["samples_per_s"]
    if "backlog_trained" not in row:
        return None
    if row["backlog_trained"] <= 1:
        return row["samples_per_s"]
    if "captured_per_s" in row:
        return row["captured_per_s"]
    # the first rows with the backlog (one sample a step) did not carry the captured rate
    return row["samples_per_s"] * max(0.0, 1 - row["backlog_trained"] / row["steady_steps"])


def capture_rows(label: str, report: dict) -> list[dict]:
    """capture.py's fixed-length rows, one per (length, arm): ms, host ms, x eager, MFU."""
    out = []
    for seq, row in (report.get("fixed") or {}).items():
        for arm in report.get("arms") or ("eager", "compiled"):  # the arms before `--arms`
            out.append({"call": label, "key": f"{seq}/{arm}", "ms": row[f"{arm}_ms"],
                        "host_ms": row.get(f"{arm}_host_ms"), "mfu": row.get(f"{arm}_mfu"),
                        "x_eager": row["eager_ms"] / row[f"{arm}_ms"] if "eager_ms" in row else None})  # fmt: skip
    return out


def goal_results(rows: list[dict]) -> list[dict]:
    """Each goal's best row over all calls (None where no call measured one)."""
    out = []
    for g in GOALS:
        candidates = [r for r in rows if r["bench"] == g.bench
                      and r.get("goal_samples_per_s") is not None
                      and fnmatch.fnmatchcase(r["key"], g.rows)]  # fmt: skip
        best = max(candidates, key=lambda r: r["goal_samples_per_s"], default=None)
        figure = best and best["goal_samples_per_s"]
        out.append({"goal": g.name, "samples_per_s_goal": g.samples_per_s,
                    "best": figure, "row": best and best["key"],
                    "call": best and best["call"], "rows": len(candidates),
                    "met": None if best is None else figure >= g.samples_per_s})  # fmt: skip
    return out


def _f(value, spec: str) -> str:
    return (
        ""
        if value is None or (isinstance(value, float) and math.isnan(value))
        else format(value, spec)
    )


def print_summary(calls: list[dict], goals: list[dict]) -> None:
    print("== calls (each with its own floor probe: 2048 / 4096 samples/s)")
    for c in calls:
        fl = " / ".join(_f(c["floor"].get(s, {}).get("samples_per_s"), ".2f") or "-"
                        for s in ("2048", "4096"))  # fmt: skip
        print(f"{c['label']}: {c['path']} ({c['device'] or 'device unknown'}), floor {fl}")
    print("\n== pipeline rows (x floor: the row's call's floor probe at its length; "
          "* at 2048 for mixed lengths)")  # fmt: skip
    print(f"{'call':<5} {'bench':<7} {'row':<32} {'samples/s':>9} {'MFU':>5} {'goal':>5} "
          f"{'x goal':>6} {'floor':>6} {'x floor':>7} {'tokens/s':>8} {'step ms':>7} "
          f"{'capture':>7} {'wait':>5} {'GiB':>5}")  # fmt: skip
    for c in calls:
        for r in c["rows"]:
            head = f"{r['call']:<5} {r['bench']:<7} {r['key']:<32}"
            if "error" in r:
                print(f"{head} ERROR {r['error'][-200:]}")
                continue
            floor = _f(r["floor_samples_per_s"], ".2f") + ("" if r["floor_same_length"] else "*")
            print(f"{head} {r['samples_per_s']:>9.2f} {fmt_mfu(r['mfu']):>5} "
                  f"{_f(r['goal'], '.1f'):>5} {_f(r['x_goal'], '.2f'):>6} {floor:>6} "
                  f"{_f(r['x_floor'], '.2f'):>7} {_f(r['tokens_per_s'], '.0f'):>8} "
                  f"{_f(r['step_ms'], '.1f'):>7} {_f(r['capture_frac'], '.2f'):>7} "
                  f"{_f(r['data_wait_frac'], '.2f'):>5} {_f(r['peak_alloc_gib'], '.1f'):>5}")  # fmt: skip
    print("\n== FLOPs per sample (ops/bench/flops.py; once per configuration)")
    seen = {}
    for c in calls:
        for bench, by_key in c["flops"].items():
            for key, f in by_key.items():
                seen.setdefault((bench, key), f)
    for (bench, key), f in seen.items():
        print(f"{bench:<7} {key:<32} {describe(f)}")
    sources = {c["peak_source"] for c in calls if c["peak_source"]}
    print("MFU against: " + ("; ".join(sorted(sources)) if sources else "no peak recorded"))
    profile = [p for c in calls for p in c["profile"]]
    if profile:
        print("\n== one train step in-process (no capture)")
        for p in profile:
            if "error" in p:
                print(f"{p['call']:<5} {p['key']:<14} ERROR {p['error'][-200:]}")
                continue
            print(f"{p['call']:<5} {p['key']:<14} step {_f(p['step_ms'], '.1f')} ms, MFU "
                  f"{fmt_mfu(p['mfu'])}, kernels {_f(p['kernel_ms'], '.1f')} ms, busy "
                  f"{_f(p['busy_frac'], '.0%')}, launches {p['launches']}, syncs {p['syncs']}, "
                  f"peak {_f(p['peak_alloc_gib'], '.1f')} GiB")  # fmt: skip
    capture = [r for c in calls for r in c.get("capture", [])]
    if capture:
        print("\n== the prefill alone (capture.py), per arm")
        for r in capture:
            print(f"{r['call']:<5} {r['key']:<22} {_f(r['ms'], '.1f')} ms, host "
                  f"{_f(r['host_ms'], '.1f')} ms, {_f(r['x_eager'], '.3f')}x eager, MFU "
                  f"{fmt_mfu(r['mfu'])}")  # fmt: skip
    print("\n== goals (issue 26): the best row over all calls")
    for g in goals:
        if g["best"] is None:
            print(f"{g['goal']} >= {g['samples_per_s_goal']}: not measured")
            continue
        verdict = "met" if g["met"] else f"missed ({g['best'] / g['samples_per_s_goal']:.2f}x)"
        print(f"{g['goal']} >= {g['samples_per_s_goal']}: {g['best']:.2f} ({g['row']}, call "
              f"{g['call']}) {verdict}")  # fmt: skip
    for c in calls:
        for line in c["stages"]:
            print(f"{c['label']}: {line}")
        if "gputests" in c:
            print(f"{c['label']}: gpu tests: {c['gputests']}")
        for r in c["rows"]:
            for role, lines in (r.get("warnings") or {}).items():
                for line in lines:
                    print(f"{c['label']}: {r['key']} {role}: {line[:300]}")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("calls", nargs="*", type=Path, default=[Path(".")],
                    help="each call's $PERF directory or perf.tgz (or a folder holding it)")  # fmt: skip
    ap.add_argument("--out", type=Path, default=None,
                    help="summary.json (default: in the call's directory for one call, else "
                    "./perf_summary.json)")  # fmt: skip
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="recompute every MFU against this peak (TFLOP/s dense bf16)")  # fmt: skip
    args = ap.parse_args(argv)
    peak = args.peak_tflops * 1e12 if args.peak_tflops else None
    with tempfile.TemporaryDirectory(prefix="specbus-perf-") as scratch:
        dirs = [call_dir(p, Path(scratch)) for p in args.calls]
        calls = [read_call(f"c{i + 1}", d, peak) for i, d in enumerate(dirs)]
        for c, given in zip(calls, args.calls, strict=True):
            c["path"] = str(given)
    goals = goal_results([r for c in calls for r in c["rows"]])
    print_summary(calls, goals)
    out = args.out or (
        dirs[0] / "summary.json" if len(dirs) == 1 and dirs[0] == args.calls[0]
        else Path("perf_summary.json")
    )  # fmt: skip
    summary = {"calls": calls, "goals": goals,
               "peak_override_tflops": args.peak_tflops}  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=1, default=str))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
