"""`specbus top`: a live view of a run, refreshed in place.

Each refresh reads the broker (`bus.status.run_status`: streams, consumer groups, lag, markers,
dead letters: live) and the trainers' last log row from the run's KV (step, loss, steps/s,
samples/s, data wait, store residency as rank 0 saw it: last known, shown "as of" its time),
plus the store's residency read now where this host can (ops/runview.py), for a run marked
complete what it left and the `specbus purge` that frees it, and the served acceptance of the
run's serving servers (`--serve URL`, else the ones `specbus serve` announced in the run dir:
`ops/served.py`). On a terminal the view is redrawn in place (rich `Live`); otherwise one
block of plain lines per refresh. `--once` prints one.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

from specbus.bus.connection import Bus
from specbus.bus.status import run_status
from specbus.bus.topology import open_kv
from specbus.core.config import StoreConfig
from specbus.ops.observe import samples_rate
from specbus.ops.runview import clock, leftover, row_label, size, store_now, world_lines


async def snapshot(bus: Bus, run: str, servers: tuple[str, ...] = ()) -> dict[str, Any]:
    """`run_status` plus the trainers' last log row (`progress`, None before the first), their
    world (`world`: size and re-formations, None before the first step) and the served
    acceptance of `servers` (`served`: URL -> `ops.served.Served` or None)."""
    status = await run_status(bus, run)
    kv = await open_kv(bus, run)
    status["progress"] = None if kv is None else await kv.get_progress()
    status["world"] = None if kv is None else await kv.get_world()
    if servers:
        from specbus.ops.served import scrape

        status["served"] = {u: await asyncio.to_thread(scrape, u) for u in servers}
    return status


def _trainers_lines(s: dict[str, Any], now: float) -> list[str]:
    p = s.get("progress")
    if p is None:
        return ["progress   no trainer log row yet"]
    parts = [f"step {int(p.get('step', 0))}"]
    for key, fmt in (("loss", "loss {:.3f}"), ("sim_accept_len", "tau {:.2f}"),
                     ("steps_per_s", "{:.2f} steps/s"), ("samples_per_s", None),
                     ("tokens_per_s", "{:.0f} tok/s"), ("data_wait_frac", "wait {:.0%}")):  # fmt: skip
        if key in p:
            parts.append(fmt.format(p[key]) if fmt else samples_rate(p))
    return [f"progress   {row_label(s, now)}:", "           " + " | ".join(parts)]


def render(
    s: dict[str, Any], now: float | None = None, purge: str = "specbus purge --yes"
) -> list[str]:
    """The view's lines for one `snapshot` (plus `store_now`, the store read now, when the
    caller added it): the broker's numbers are live, the trainers' last log row is shown
    "as of" its time (ops/runview.py)."""
    now = time.time() if now is None else now
    lines = [f"specbus top - run {s['run']} @ {s['url']}  {time.strftime('%H:%M:%S', time.localtime(now))}"]  # fmt: skip
    if not s["declared"]:
        lines.append("  not declared on this broker yet")
    kv, p = s.get("kv") or {}, s.get("progress")
    feed = kv.get("feed_complete")
    done = kv.get("train_complete")
    if done is None:
        training = "running (or not started)"
    else:
        training = "complete" + (f" at {clock(done['time'])}" if "time" in done else "")
    lines.append(
        f"run        feed {'complete, ' + str(feed) + ' tasks' if feed is not None else 'in progress'}"
        f" | training {training}"
    )
    lines += _trainers_lines(s, now)
    lines += world_lines(s.get("world"), shown=3)
    lines.append(f"{'group':<10} {'lag':>7} {'pending':>8} {'in flight':>10} "
                 f"{'redelivered':>12} {'ack floor':>10} {'lag bytes':>11}")  # fmt: skip
    for group, c in s["consumers"].items():
        lag = (s["lag"] or {}).get(group)
        if c is None:
            lines.append(f"{group:<10} missing")
            continue
        lines.append(
            f"{group:<10} {lag['messages'] if lag else 0:>7} {c['pending']:>8} "
            f"{c['ack_pending']:>10} {c['redelivered']:>12} {c['ack_floor_seq']:>10} "
            f"{size(lag['bytes'] if lag else 0):>11}"
        )
    store = s.get("store_now")
    if store is not None:
        lines.append(f"store      now {size(store['bytes'])} resident in {store['uri']} "
                     f"({store['samples']} sample(s))")  # fmt: skip
    if p is not None and "store_bytes" in p:
        lines.append(
            f"store      {size(p['store_bytes'])} resident (peak {size(p.get('store_peak_bytes'))}) "
            f"at the trainers' last log row ({row_label(s, now).split(' (')[0]})"
        )
    elif store is None:
        lines.append("store      residency unknown (no trainer log row yet)")
    dead = s.get("dead_letters")
    lines.append(
        f"dead       {'?' if dead is None else dead}" + (" (specbus dead)" if dead else "")
    )
    for url, served in (s.get("served") or {}).items():
        lines.append(served.line() if served else f"served     {url}: not answering")
    if hint := leftover(s, store, purge):
        lines.append(f"left over  {hint}")
    return lines


async def watch(bus: Bus, run: str, *, interval_s: float, once: bool, out=None,
                store: StoreConfig | None = None, purge: str = "specbus purge --yes",
                servers: tuple[str, ...] = ()) -> int:  # fmt: skip
    """Refresh the view every `interval_s` until Ctrl-C (or once); `store`: the run's store,
    read now each refresh where this host can (`runview.store_now`); `servers`: serving
    servers whose served acceptance is shown. Returns the exit code: 1 when the run is not
    declared on a single refresh, else 0."""
    out = out or sys.stdout
    live = None if once else _live(out)

    async def lines() -> tuple[dict[str, Any], str]:
        s = await snapshot(bus, run, servers)
        s["store_now"] = store_now(store) if store is not None else None
        return s, "\n".join(render(s, purge=purge))

    if live is None:  # plain lines: one block per refresh
        while True:
            s, text = await lines()
            print(text, file=out, flush=True)
            if once:
                return 0 if s["declared"] else 1
            print(file=out)
            await asyncio.sleep(interval_s)
    from rich.text import Text

    with live:
        while True:
            live.update(Text((await lines())[1]), refresh=True)
            await asyncio.sleep(interval_s)


def _live(out):
    """A rich `Live` redrawing in place on a terminal; None otherwise (or without rich)."""
    if not out.isatty():
        return None
    try:
        from rich.console import Console
        from rich.live import Live
    except ImportError:
        return None
    return Live(console=Console(file=out), auto_refresh=False)
