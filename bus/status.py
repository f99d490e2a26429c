"""What `specbus status` shows for a run: streams, consumers, lag, KV markers, dead letters,
the capture audit's counts.

`run_status(bus, run)` returns a JSON-able dict; missing pieces (a run never declared) are
None rather than errors, so status works on a fresh broker too. `dead_letters` counts
`list_dead` entries (one per dead message), not raw DEAD stream messages. Every read rides
through a broker outage (`bus.outage`).
"""

from __future__ import annotations

from typing import Any

from specbus.bus.connection import Bus
from specbus.bus.dead import list_dead
from specbus.bus.lag import lag
from specbus.bus.outage import ride
from specbus.bus.subjects import PRODUCERS, TRAINERS, Names
from specbus.bus.topology import open_kv
from specbus.core.errors import BusNotFound


async def _stream(bus: Bus, name: str) -> dict[str, Any] | None:
    try:
        info = await ride(bus, f"reading stream {name}", lambda: bus.js.stream_info(name))
    except BusNotFound:
        return None
    s = info.state
    return {
        "messages": s.messages,
        "bytes": s.bytes,
        "first_seq": s.first_seq,
        "last_seq": s.last_seq,
        "consumers": s.consumer_count,
        "subjects": info.config.subjects,
        # retention: past either limit the oldest messages go (what replay can still reach
        # is first_seq..last_seq)
        "max_age_s": info.config.max_age,
        "max_bytes": info.config.max_bytes if info.config.max_bytes is not None else -1,
        "max_msgs": info.config.max_msgs if info.config.max_msgs is not None else -1,
    }


async def _consumer(bus: Bus, stream: str, group: str) -> dict[str, Any] | None:
    try:
        info = await ride(
            bus, f"reading consumer {stream}/{group}", lambda: bus.js.consumer_info(stream, group)
        )
    except BusNotFound:
        return None
    c = info.config
    return {
        "pending": info.num_pending,
        "ack_pending": info.num_ack_pending,
        "redelivered": info.num_redelivered,
        "waiting": info.num_waiting,
        "delivered_seq": info.delivered.stream_seq if info.delivered else 0,
        "ack_floor_seq": info.ack_floor.stream_seq if info.ack_floor else 0,
        "ack_wait_s": c.ack_wait,
        "max_deliver": c.max_deliver,
        "max_ack_pending": c.max_ack_pending,
        "deliver_policy": str(getattr(c.deliver_policy, "value", c.deliver_policy)),
        "opt_start_seq": c.opt_start_seq,
    }


async def run_status(bus: Bus, run: str) -> dict[str, Any]:
    """What `specbus status` shows for `run` as a JSON-able dict (see the module doc); pieces of a run
    never declared are None, not errors."""
    names = Names(run)
    streams = {
        n: await _stream(bus, n)
        for n in (names.tasks_stream, names.samples_stream, names.dead_stream)
    }
    consumers, lags = {}, {}
    for group in (PRODUCERS, TRAINERS):
        stream = names.stream_of(group)
        consumers[group] = await _consumer(bus, stream, group)
        lags[group] = (await lag(bus, run, group)).as_dict() if consumers[group] else None
    kv = await open_kv(bus, run)
    markers = None
    if kv is not None:
        manifest = await kv.get_manifest()
        markers = {
            "manifest": None if manifest is None else sorted(manifest.model_dump()),
            "feed_complete": await kv.feed_complete(),
            "train_complete": await kv.train_complete(),
            "checkpoint": await kv.get_checkpoint(),
        }
    audit = None
    if kv is not None:  # the capture audit (core/audit.py): counts summed over trainers
        by = await kv.audit_counts()
        audit = {"audited": sum(c["audited"] for c in by.values()),
                 "mismatches": sum(c["mismatches"] for c in by.values()), "by_trainer": by}  # fmt: skip
    dead = None if streams[names.dead_stream] is None else len(await list_dead(bus, run))
    return {
        "run": run,
        "url": bus.url,
        "declared": all(s is not None for s in streams.values()),
        "streams": streams,
        "consumers": consumers,
        "lag": lags,
        "kv": markers,
        "dead_letters": dead,
        "audit": audit,
    }
