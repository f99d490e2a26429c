"""What `specbus status` and `specbus top` add to the broker's numbers: which values are live
and which are last known, whether the run is over, and what it left behind.

- Live (read now): the broker's streams, consumer groups, lag and KV markers; the store's
  residency where this host can read it without opening the store (`store_now`: the counters
  of a `shm://` or `file://` store directory; nothing is created or attached).
- Last known: the trainers' numbers (step, loss, rates, the store residency rank 0 saw) come
  from their last log row in the run's KV; they are shown "as of" its time, with its age, and
  as the final row once the run is marked complete.
- Left over: a run marked complete whose store still holds bytes (or whose trainers still
  have refs not trained: a partial last window, a stop at `training.max_steps` /
  `max_minutes`) gets the `specbus purge` that frees them.
"""

from __future__ import annotations

import os
import time
from typing import Any

from specbus.core.config import StoreConfig

STALE_S = 120.0  # a log row older than this, with the run not complete: trainers not running?


def store_now(store: StoreConfig) -> dict[str, Any] | None:
    """The residency of a `shm://` / `file://` store read now from its directory's counters
    (`bytes`, `samples`, `uri`): `{"bytes": 0}` when the directory is gone; None for a store
    this host cannot read that way (mooncake://, http://, mem://)."""
    from specbus.core.store import parse_uri
    from specbus.core.store.shm_dir import STATS, store_dir

    try:
        scheme, store_id, path, _ = parse_uri(store.uri)
    except Exception:  # noqa: BLE001 - a display helper: unknown, not an error
        return None
    if scheme not in ("shm", "file") or (scheme == "file" and not path):
        return None
    root = path if path else store_dir(store_id or store.store_id or "default")
    # The store keeps resident bytes and samples as the first int64s of `<root>/.lock`
    # (core/store/shm_dir.py); read without the lock: a display value, not a decision.
    try:
        with open(os.path.join(root, ".lock"), "rb") as f:
            data = f.read(STATS.size)
    except OSError:
        return {"uri": store.uri, "bytes": 0, "samples": 0}
    if len(data) != STATS.size:
        return {"uri": store.uri, "bytes": 0, "samples": 0}
    resident, samples, _, _ = STATS.unpack(data)
    return {"uri": store.uri, "bytes": max(resident, 0), "samples": max(samples, 0)}


def size(n: float | None) -> str:
    """Bytes for people (B, KiB, MiB, GiB, TiB); '?' when unknown."""
    if n is None or n != n:  # NaN: unknown
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def ago(seconds: float) -> str:
    """An age for people: 12 s, 4 min, 2.5 h."""
    seconds = max(seconds, 0.0)
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def clock(t: float) -> str:
    """A wall time as HH:MM:SS (with the date when not today)."""
    fmt = "%H:%M:%S" if time.strftime("%Y%m%d", time.localtime(t)) == time.strftime("%Y%m%d") else "%Y-%m-%d %H:%M:%S"  # fmt: skip
    return time.strftime(fmt, time.localtime(t))


def finished(s: dict[str, Any]) -> dict[str, Any] | None:
    """The run's train-complete marker (None while training is not marked complete)."""
    return (s.get("kv") or {}).get("train_complete")


def row_label(s: dict[str, Any], now: float) -> str:
    """How fresh the trainers' last log row is: 'as of HH:MM:SS, N ago' plus what that means
    (final row of a complete run; old enough that the trainers may not be running)."""
    p = s.get("progress") or {}
    if "time" not in p:
        return "last known"
    age = now - p["time"]
    label = f"last known, as of {clock(p['time'])} ({ago(age)} ago"
    if finished(s) is not None:
        return label + "; the run's final row: training is complete)"
    if age > STALE_S:
        return label + "; no newer row: are the trainers running?)"
    return label + ")"


def leftover(s: dict[str, Any], store: dict[str, Any] | None, purge: str) -> str | None:
    """What a complete run left behind and, where the store still holds bytes, the command
    that frees them; None when nothing is left (or the run is not complete). A store read now
    (`store_now`) decides; one this host cannot read (mooncake://, http://) is suspected of
    holding the tensors of refs never trained."""
    if finished(s) is None:
        return None
    lag = (s.get("lag") or {}).get("trainers") or {}
    never = lag.get("messages") or 0
    refs = (f"{never} refs were never trained (the run stopped before them: training.max_steps "
            "or max_minutes; `specbus train --resume` with a larger one trains them)") if never else ""  # fmt: skip
    frees = f"`{purge}` frees it once no process of the run runs"
    if store is None:
        if not never:
            return None
        return (f"the run is complete and {refs}; if its store still holds their tensors "
                f"({size(lag.get('bytes'))} by their refs), {frees}")  # fmt: skip
    if store["uri"].startswith("file://") or not store["bytes"]:
        # a recording is kept by design; an empty store needs nothing
        return f"the run is complete and {refs}; its store holds none of their tensors" if never else None  # fmt: skip
    held = f"{store['uri']} still holds {size(store['bytes'])} ({store['samples']} sample(s)) now"
    return f"the run is complete{'; ' + refs if never else ''}; {held}: {frees}"


def purge_command(args: Any) -> str:
    """`specbus purge --yes` with this command's config and overrides."""
    words = ["specbus purge --yes"]
    if getattr(args, "config", None):
        words.append(f"--config {args.config}")
    words += list(getattr(args, "overrides", []) or [])
    return " ".join(words)


def world_lines(world: dict[str, Any] | None, shown: int = 5) -> list[str]:
    """The trainers' world (the KV's `world`: written by rank 0 at each world's first step,
    ops/elastic.py) and its last `shown` re-formations: sizes, the step resumed from, the
    seconds from the previous world's end to the new world's first step, steps trained
    again. [] before the first world's first step."""
    if not world:
        return []
    lines = [f"world      {world['world']} rank(s) (formation {world['formation']}, training "
             f"from step {world['from_step']} since {clock(world['at'])})"]  # fmt: skip
    changes = [h for h in world.get("history", []) if h.get("previous_world") is not None]
    for i, h in enumerate(changes[-shown:]):
        since = "?" if h.get("since_end_s") is None else f"{h['since_end_s']:.1f}s"
        retrained = "?" if h.get("retrained") is None else h["retrained"]
        head = "re-formed " if i == 0 else " " * 10
        lines.append(
            f"{head} {h['previous_world']} -> {h['world']} at step {h['from_step']} "
            f"({clock(h['at'])}): first step {since} after the last world ended "
            f"({h.get('cause') or 'cause unknown'}), {retrained} step(s) retrained"
        )
    return lines
