"""The soak benchmark (ops/bench/soak.py): its verdict on synthetic series, and a 2-minute soak
of a real live run (intake, serve, trainer, traffic, nats-server as processes) in the slow
tier."""

from __future__ import annotations

import pytest
from specbus.ops.bench import soak

MIB = 1 << 20


def rows_of(minutes: int, **series) -> list[dict]:
    """One row a minute; each series a function of the minute."""
    return [{"t": 60.0 * m, **{k: f(m) for k, f in series.items()}} for m in range(minutes + 1)]


def test_the_verdict_fails_a_leak_and_passes_flat_and_warming_series():
    flat = rows_of(60, **{"rss_bytes.trainer-0": lambda m: 400 * MIB + (m % 3) * MIB,
                          "fds.intake": lambda m: 9.0, "threads.serve": lambda m: 4.0})  # fmt: skip
    assert soak.analyse(flat, 0.25)["ok"]
    # the first quarter's warm-up (RSS rising 60 MiB) is left out of the fit
    warm = rows_of(60, **{"rss_bytes.trainer-0": lambda m: 400 * MIB + min(m, 10) * 6 * MIB})
    assert soak.analyse(warm, 0.25)["ok"]
    # 32 MiB/h: over the 16 MiB/h bound, and 24 MiB over the fitted 45 minutes
    leak = rows_of(60, **{"rss_bytes.trainer-0": lambda m: 400 * MIB + m * MIB * 32 / 60})
    out = soak.analyse(leak, 0.25)
    assert not out["ok"] and not out["series"]["rss_bytes.trainer-0"]["ok"], out["lines"]
    fds = rows_of(60, **{"fds.intake": lambda m: 9.0 + m // 6})  # a socket leaked every 6 min
    assert not soak.analyse(fds, 0.25)["ok"]


@pytest.mark.slow
def test_a_short_soak_of_a_live_run_keeps_every_series_bounded(tmp_path):
    """2 minutes of traffic sampled every 10 s (the benchmark's hour, shortened to keep the
    slow tier's time): every process lives, refs are trained, no series grows past its bound."""
    args = soak.parse(["--minutes", "2", "--sample-s", "10", "--qps", "1",
                       "--work", str(tmp_path)])  # fmt: skip
    out = soak.run(args)
    assert out["trained"] > 0, out["rows"][-1]
    for name in ("intake", "serve", "trainer-0", "traffic", "nats-server"):
        for kind in ("rss_bytes", "fds", "threads"):
            assert out["series"][f"{kind}.{name}"]["points"] >= 8, sorted(out["series"])
    for key in ("store_bytes", "stream_bytes.samples", "lag_refs"):
        assert key in out["series"], sorted(out["series"])
    assert out["ok"], "\n".join(out["lines"])
