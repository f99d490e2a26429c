"""What the scale and soak benchmarks sample, and the slopes they fit.

`proc_stats(pid)` reads a process's resident memory, open file descriptors and threads from
/proc (Linux); `tree_bytes(path)` is the bytes under a directory (a `shm://` store, a broker's
store dir); `Fit` is an ordinary least-squares line `y = a + b x` with the spread of its
slope, so a series is judged by its slope and how sure that slope is (`bounded`), not by two
end points. Every benchmark prints its series' slopes through `slope_line`.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path


def proc_stats(pid: int) -> dict[str, float] | None:
    """{rss_bytes, fds, threads} of a running process; None once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    rss_kb = int(fields.get("VmRSS", "0 kB").split()[0])
    return {"rss_bytes": rss_kb * 1024.0, "fds": float(fds),
            "threads": float(fields.get("Threads", "0").strip())}  # fmt: skip


def tree_stats(pid: int) -> dict[str, float] | None:
    """`proc_stats` of a process plus its children (a `specbus serve` or `up` wrapper and
    the server it runs), summed; None once it is gone."""
    own = proc_stats(pid)
    if own is None:
        return None
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        children = []
    for child in children:
        sub = tree_stats(int(child))
        if sub is not None:
            own = {k: own[k] + sub[k] for k in own}
    return own


def tree_bytes(path: str | Path) -> int:
    """Bytes of the regular files under `path` (0 when it does not exist)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name), follow_symlinks=False).st_size
            except FileNotFoundError:  # removed while we walked
                continue
    return total


@dataclass(frozen=True)
class Fit:
    """`y = intercept + slope * x` by least squares over `n` points, with the standard error
    of the slope (`slope_se`; 0 with fewer than 3 points)."""

    intercept: float
    slope: float
    slope_se: float
    n: int

    def at(self, x: float) -> float:
        """The fitted line at `x` (an extrapolation beyond the measured range)."""
        return self.intercept + self.slope * x

    def bounded(self, limit: float) -> bool:
        """True when the slope is under `limit`, or not distinguishable from it: under
        `limit` plus two standard errors (noise on a shared machine must not fail a run whose
        series is flat; a real leak is many standard errors above the bound)."""
        return self.slope <= limit + 2 * self.slope_se


def fit(xs: list[float], ys: list[float]) -> Fit:
    """The least-squares line through (xs, ys)."""
    n = len(xs)
    if n == 0:
        return Fit(math.nan, math.nan, math.nan, 0)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if n < 2 or sxx == 0:
        return Fit(my, 0.0, 0.0, n)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    intercept = my - slope * mx
    if n < 3:
        return Fit(intercept, slope, 0.0, n)
    resid = sum((y - intercept - slope * x) ** 2 for x, y in zip(xs, ys, strict=True))
    return Fit(intercept, slope, math.sqrt(resid / (n - 2) / sxx), n)


def human(v: float, unit: str) -> str:
    """`v` for people: bytes in KiB/MiB/GiB, the rest with 3 significant digits."""
    if unit == "B":
        for name, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
            if abs(v) >= scale:
                return f"{v / scale:.2f} {name}"
        return f"{v:.0f} B"
    return f"{v:.3g} {unit}".strip()


def slope_line(name: str, f: Fit, unit: str, per: str, bound: float | None = None) -> str:
    """One line of a benchmark's report: the slope (and its error), the bound and the verdict."""
    text = f"{name:<34} slope {human(f.slope, unit)}/{per} (+- {human(f.slope_se, unit)}, {f.n} points)"
    if bound is not None:
        text += f"  bound {human(bound, unit)}/{per}: {'ok' if f.bounded(bound) else 'OVER'}"
    return text
