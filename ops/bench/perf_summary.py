"""The table of one performance call (`BENCH=perf bash ops/bench/gpu.sh`): reads what the
stages wrote under OUT (floor.log, gpu_pipeline.json, gpu_dflash.json, step_profile.json,
stages.txt, gputests.log), prints the figures the issues ask for against their goals and the
floor probe of the same call, and writes OUT/summary.json.

    python -m specbus.ops.bench.perf_summary $OUT
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

EAGLE3_GOALS = {"2048": 7.0, "4096": 3.2}  # issue 16 (colocated, one H200), and >= 1.1x floor
DSPARK_GOAL, DSPARK_SEED = 6.5, 5.7  # issue 15


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


def main(argv: list[str]) -> int:
    out = Path(argv[0] if argv else ".")
    floor = floor_figures(out)
    pipe = _json(out / "gpu_pipeline.json").get("results", {})
    dfl = _json(out / "gpu_dflash.json").get("results", {})
    prof = _json(out / "step_profile.json").get("results", {})
    summary: dict = {"floor": floor, "eagle3": {}, "dflash": {}, "profile": {}}

    print("== EAGLE3 pipeline (colocated: capture overlapped on its own stream)")
    print(f"{'seq':>5} {'mode':<14} {'samples/s':>9} {'x floor':>7} {'goal':>5} {'step ms':>8} "
          f"{'capture':>7} {'wait':>5} {'GiB':>6}")  # fmt: skip
    for seq, row in pipe.items():
        fl = floor.get(seq, {}).get("samples_per_s")
        for mode in ("colocated", "disaggregated"):
            r = row.get(mode)
            if not r:
                continue
            if "error" in r:
                print(f"{seq:>5} {mode:<14} ERROR {r['error'][-200:]}")
                continue
            mem = r.get("train_mem", {}).get("peak_allocated_gib", float("nan"))
            x = r["samples_per_s"] / fl if fl else float("nan")
            goal = EAGLE3_GOALS.get(seq) if mode == "colocated" else None
            print(f"{seq:>5} {mode:<14} {r['samples_per_s']:>9.2f} {x:>7.2f} "
                  f"{goal if goal else '':>5} {r['step_ms']:>8.1f} "
                  f"{r.get('capture_frac', float('nan')):>7.2f} {r['data_wait_frac']:>5.2f} "
                  f"{mem:>6.1f}")  # fmt: skip
            summary["eagle3"][f"{seq}/{mode}"] = {
                "samples_per_s": r["samples_per_s"], "tokens_per_s": r["tokens_per_s"],
                "x_floor": x, "goal": goal, "step_ms": r["step_ms"],
                "capture_frac": r.get("capture_frac"), "data_wait_frac": r["data_wait_frac"],
                "peak_alloc_gib": mem,
            }  # fmt: skip
        if fl:
            print(f"{seq:>5} {'floor probe':<14} {fl:>9.2f} {1.0:>7.2f}")

    print(f"\n== DFlash family colocated (seed DSpark {DSPARK_SEED}, goal {DSPARK_GOAL})")
    for key, r in dfl.items():
        if "error" in r:
            print(f"{key:<18} ERROR {r['error'][-300:]}")
            continue
        mem = r.get("train_mem", {}).get("peak_allocated_gib", float("nan"))
        print(f"{key:<18} {r['samples_per_s']:>6.2f} samples/s {r['tokens_per_s']:>8.0f} tok/s "
              f"step {r['step_ms']:.1f} ms capture {r.get('capture_frac', float('nan')):.1%} "
              f"wait {r['data_wait_frac']:.1%} peak {mem:.1f} GiB "
              f"x seed {r['samples_per_s'] / DSPARK_SEED:.2f}")  # fmt: skip
        summary["dflash"][key] = {k: r.get(k) for k in (
            "samples_per_s", "tokens_per_s", "step_ms", "capture_frac", "data_wait_frac")}  # fmt: skip
        summary["dflash"][key]["peak_alloc_gib"] = mem

    print("\n== one train step in-process (no capture): launches, GPU busy")
    for name, rows in prof.items():
        if "error" in rows:
            print(f"{name:<8} ERROR {rows['error'][-300:]}")
            continue
        for seq, r in rows.items():
            print(f"{name:<8} {seq:>5}: step {r['step_ms']:.1f} ms, kernels {r['kernel_ms']:.1f} ms "
                  f"busy {r.get('busy_frac', float('nan')):.0%}, launches {r['launches']}, "
                  f"syncs {r['syncs']}, casts {r['casts']}, peak "
                  f"{r.get('peak_alloc_gib', float('nan')):.1f} GiB")  # fmt: skip
            summary["profile"][f"{name}/{seq}"] = {
                k: r.get(k) for k in ("step_ms", "kernel_ms", "busy_frac", "launches", "syncs",
                                      "casts", "compute_ops", "peak_alloc_gib")
            }  # fmt: skip
    for extra in ("stages.txt",):
        path = out / extra
        if path.is_file():
            print("\n" + path.read_text().strip())
    tests = out / "gputests.log"
    if tests.is_file():
        last = [line for line in tests.read_text().splitlines() if line.strip()][-1:]
        print("gpu tests:", last[0] if last else "(empty)")
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
