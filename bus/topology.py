"""The broker objects of a run, declared idempotently from the bus config.

`await ensure_run(bus, cfg, run)` makes sure the run's streams (TASKS, SAMPLES, DEAD), durable
consumers ("producers", "trainers") and KV bucket exist and returns the bucket (`RunKV`, its
typed markers); `bus.run.declare` wraps it in the run's `RunBus`. Declaring again changes
nothing; what the server can change in place is updated and logged, what it cannot raises
`BusRejected`; a consumer's start position is never touched. docs/bus.md, "Topology".
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import orjson
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    KeyValueConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.kv import KeyValue
from specbus.bus.connection import Bus
from specbus.bus.outage import ride
from specbus.bus.subjects import PRODUCERS, TRAINERS, Names
from specbus.core.config import BusConfig
from specbus.core.contracts import Manifest
from specbus.core.errors import BrokerUnavailable, BusError, BusNotFound, BusRejected

log = logging.getLogger("specbus.bus")

# Fields the server refuses to change on an existing stream / consumer.
_FIXED_STREAM = ("retention", "storage")
_MUTABLE_STREAM = ("subjects", "max_age", "max_bytes", "duplicate_window", "num_replicas",
                   "allow_direct")  # fmt: skip
_FIXED_CONSUMER = ("ack_policy",)
_MUTABLE_CONSUMER = ("ack_wait", "max_deliver", "max_ack_pending")

KEY_MANIFEST = "manifest"
KEY_FEED_COMPLETE = "feed_complete"
KEY_CHECKPOINT = "checkpoint"
KEY_TRAIN_COMPLETE = "train_complete"
KEY_RECORDING = "recording"
KEY_PROGRESS = "progress"  # rank 0's last log row (`specbus top`)
KEY_AUDIT = "audit"  # audit.<trainer>: its capture audit counts (core/audit.py)
KEY_WORLD = "world"  # the trainers' world and its formations (ops/elastic.py)


def stream_configs(names: Names, cfg: BusConfig) -> list[StreamConfig]:
    """The run's TASKS, SAMPLES and DEAD stream configs (see the module doc)."""
    common = dict(
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        num_replicas=cfg.replicas,
        duplicate_window=cfg.duplicate_window_s,
        allow_direct=True,
    )
    return [
        StreamConfig(name=names.tasks_stream, subjects=[names.tasks], max_age=cfg.tasks_max_age_s,
                     max_bytes=cfg.tasks_max_bytes, **common),
        StreamConfig(name=names.samples_stream, subjects=[names.samples],
                     max_age=cfg.samples_max_age_s, max_bytes=cfg.samples_max_bytes, **common),
        StreamConfig(name=names.dead_stream, subjects=names.dead_subjects(),
                     max_age=cfg.dead_max_age_s, max_bytes=cfg.dead_max_bytes, **common),
    ]  # fmt: skip


def consumer_config(group: str, cfg: BusConfig) -> ConsumerConfig:
    """The durable pull consumer `group`: explicit ack, `ack_wait`, `max_deliver`, `max_ack_pending`,
    deliver all."""
    return ConsumerConfig(
        name=group,
        durable_name=group,
        deliver_policy=DeliverPolicy.ALL,
        ack_policy=AckPolicy.EXPLICIT,
        ack_wait=cfg.ack_wait_s,
        max_deliver=cfg.max_deliver,
        max_ack_pending=cfg.max_ack_pending,
    )


def _differs(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return abs((a or 0.0) - (b or 0.0)) > 1e-6
    if isinstance(a, list) or isinstance(b, list):
        return sorted(a or []) != sorted(b or [])
    return a != b


def _reconcile(what: str, have: Any, want: Any, fixed, mutable) -> dict[str, tuple[Any, Any]]:
    """Refuse a difference in a field the server cannot change in place; apply the mutable
    differences to `have` and return them as {field: (old, new)}."""
    for field in fixed:
        if _differs(getattr(have, field), getattr(want, field)):
            raise BusRejected(
                f"{what} exists with {field}={getattr(have, field)}, the config wants "
                f"{getattr(want, field)}; the server cannot change it in place (use another run name)"
            )
    changes = {
        f: (getattr(have, f), getattr(want, f))
        for f in mutable
        if _differs(getattr(have, f), getattr(want, f))
    }
    for field, (_, new) in changes.items():
        setattr(have, field, new)
    return changes


# JetStream's "no suitable peers for placement": a replicated stream asked of a cluster whose
# nodes have not all joined JetStream yet (forming, or a node restarting). Waited out for this
# long, then refused with what it means.
NO_PEERS = 10005
PLACEMENT_WAIT_S = 60.0


async def _placed(bus: Bus, what: str, create, replicas: int):
    """`await ride(bus, what, create)`, retried while the cluster cannot place `replicas`."""
    deadline = time.monotonic() + PLACEMENT_WAIT_S
    while True:
        try:
            return await ride(bus, what, create)
        except BusRejected as e:
            if e.err_code != NO_PEERS:
                raise
            if time.monotonic() >= deadline:
                raise BusRejected(f"{what}: the broker cannot place {replicas} replica(s) (a "
                                  f"cluster with fewer nodes, or nodes not joined): {e}",
                                  code=e.code, err_code=e.err_code) from e  # fmt: skip
            await asyncio.sleep(0.5)


async def _ensure_stream(bus: Bus, want: StreamConfig) -> None:
    what = f"declaring stream {want.name}"
    stream_info = lambda: bus.js.stream_info(want.name)  # noqa: E731
    try:
        info = await ride(bus, what, stream_info)
    except BusNotFound:
        try:
            await _placed(bus, what, lambda: bus.js.add_stream(want), want.num_replicas)
            log.info("declared stream %s", want.name)
            return
        except BrokerUnavailable:
            raise
        except BusError as e:  # another process won the race: compare with what it created
            try:
                info = await ride(bus, what, stream_info)
            except BusNotFound:
                raise BusError(f"cannot create stream {want.name}: {e}", stream=want.name) from e
    have = info.config
    changes = _reconcile(f"stream {want.name}", have, want, _FIXED_STREAM, _MUTABLE_STREAM)
    if not changes:
        return
    try:
        await ride(bus, what, lambda: bus.js.update_stream(have))
    except BrokerUnavailable:
        raise
    except BusError as e:
        raise BusRejected(f"cannot update stream {want.name} ({changes}): {e}",
                          code=e.code, err_code=e.err_code, stream=want.name) from e  # fmt: skip
    log.warning(
        "updated stream %s: %s",
        want.name,
        ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changes.items()),
    )


async def _ensure_consumer(bus: Bus, stream: str, want: ConsumerConfig) -> None:
    what = f"declaring consumer {stream}/{want.durable_name}"
    try:
        info = await ride(bus, what, lambda: bus.js.consumer_info(stream, want.durable_name))
    except BusNotFound:
        try:
            await ride(bus, what, lambda: bus.js.add_consumer(stream, want))
            log.info("declared consumer %s on %s", want.durable_name, stream)
        except BrokerUnavailable:
            raise
        except BusError as e:
            raise BusError(f"cannot create consumer {want.durable_name} on {stream}: {e}",
                           code=e.code, err_code=e.err_code, stream=stream) from e  # fmt: skip
        return
    have = info.config
    changes = _reconcile(
        f"consumer {stream}/{want.durable_name}", have, want, _FIXED_CONSUMER, _MUTABLE_CONSUMER
    )
    if not changes:
        return
    try:  # create-or-update; keeps the start position
        await ride(bus, what, lambda: bus.js.add_consumer(stream, have))
    except BrokerUnavailable:
        raise
    except BusError as e:
        raise BusRejected(
            f"cannot update consumer {stream}/{want.durable_name} ({changes}): {e}",
            code=e.code, err_code=e.err_code, stream=stream,
        ) from e  # fmt: skip
    log.warning(
        "updated consumer %s/%s: %s",
        stream,
        want.durable_name,
        ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changes.items()),
    )


class RunKV:
    """The run's KV bucket: manifest (a `Manifest` record), feed-complete marker (task count),
    train-complete marker, latest checkpoint pointer, recording marker (`specbus capture`),
    the trainers' last log row (`progress`), each trainer's capture audit counts (`audit.<name>`),
    their world and its formations (`world`) (JSON values).

    `get_*` return None when the key was never written. Every put overwrites (history 5), so
    a put retried after a lost answer writes the same value again. Reads and writes ride
    through broker outages; `BrokerUnavailable` after `bus.outage_give_up_s`, `BusError` for
    any other failure.
    """

    def __init__(self, kv: KeyValue, bus: Bus):
        self.kv = kv
        self.bus = bus

    async def _put_bytes(self, key: str, data: bytes) -> int:
        return await ride(self.bus, f"writing KV key {key!r}", lambda: self.kv.put(key, data))

    async def _get_bytes(self, key: str) -> bytes | None:
        try:
            entry = await ride(self.bus, f"reading KV key {key!r}", lambda: self.kv.get(key))
        except BusNotFound:
            return None
        return entry.value or None

    async def _put(self, key: str, value: Any) -> int:
        return await self._put_bytes(key, orjson.dumps(value))

    async def _get(self, key: str) -> Any:
        data = await self._get_bytes(key)
        return None if data is None else orjson.loads(data)

    async def put_manifest(self, manifest: Manifest) -> int:
        """Write the run's manifest (overwrites; the feeder refuses another plan before calling it)."""
        return await self._put_bytes(KEY_MANIFEST, manifest.to_bytes())

    async def get_manifest(self) -> Manifest | None:
        """The run's manifest; None before the feeder wrote it. Raises `RecordError` for one
        of another schema version (a run fed by another specbus)."""
        data = await self._get_bytes(KEY_MANIFEST)
        return None if data is None else Manifest.from_bytes(data)

    async def wait_manifest(
        self,
        timeout_s: float,
        stopped: Callable[[], bool],
        waiting: Callable[[float], None],
        poll_s: float = 0.2,
    ) -> Manifest | None:
        """The run's manifest once its writer put it; None when `stopped()` first. `waiting
        (seconds left)` is told at once and then once a minute; `TimeoutError` after
        `timeout_s` without one."""
        deadline, said = time.monotonic() + timeout_s, -math.inf
        while (manifest := await self.get_manifest()) is None:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no manifest after {timeout_s:.0f}s")
            if time.monotonic() - said >= 60:
                waiting(deadline - time.monotonic())
                said = time.monotonic()
            if stopped():
                return None
            await asyncio.sleep(poll_s)
        return manifest

    async def mark_feed_complete(self, task_count: int) -> int:
        """The feeder is done: `task_count` tasks were published for this run."""
        return await self._put(KEY_FEED_COMPLETE, {"task_count": int(task_count)})

    async def feed_complete(self) -> int | None:
        """The published task count once the feeder finished, else None."""
        value = await self._get(KEY_FEED_COMPLETE)
        return None if value is None else int(value["task_count"])

    async def mark_train_complete(self, summary: dict[str, Any]) -> int:
        """Training finished (`summary`: steps, samples, final checkpoint...); producers stop."""
        return await self._put(KEY_TRAIN_COMPLETE, summary)

    async def clear_train_complete(self) -> None:
        """A resumed run trains again: producers must not stop on the old marker."""
        if await self.train_complete() is None:
            return
        await ride(
            self.bus,
            f"deleting KV key {KEY_TRAIN_COMPLETE!r}",
            lambda: self.kv.delete(KEY_TRAIN_COMPLETE),
        )

    async def train_complete(self) -> dict[str, Any] | None:
        """The trainers' summary once they marked the run complete, else None."""
        return await self._get(KEY_TRAIN_COMPLETE)

    async def mark_recording_complete(self, marker: dict[str, Any]) -> int:
        """The run is a complete recording (`specbus capture`): its SAMPLES are final."""
        return await self._put(KEY_RECORDING, marker)

    async def recording(self) -> dict[str, Any] | None:
        """The recording marker (sample count, last sequence, store, features), else None."""
        return await self._get(KEY_RECORDING)

    async def put_checkpoint(self, pointer: dict[str, Any]) -> int:
        """Point at the latest durable checkpoint."""
        return await self._put(KEY_CHECKPOINT, pointer)

    async def get_checkpoint(self) -> dict[str, Any] | None:
        """The latest checkpoint pointer, None when none was written."""
        return await self._get(KEY_CHECKPOINT)

    async def add_audit(self, name: str, *, audited: int, mismatches: int) -> int:
        """Add to the capture audit counts of trainer `name` (`audit.<name>`; read-modify-write
        by its only writer, so a restarted rank goes on from its counts)."""
        key = f"{KEY_AUDIT}.{name}"
        counts = await self._get(key) or {"audited": 0, "mismatches": 0}
        counts = {"audited": counts["audited"] + audited,
                  "mismatches": counts["mismatches"] + mismatches}  # fmt: skip
        return await self._put(key, counts)

    async def audit_counts(self) -> dict[str, dict[str, int]]:
        """The capture audit counts of every trainer that audited ({} before any)."""
        try:
            keys = await ride(self.bus, "listing KV keys", lambda: self.kv.keys())
        except Exception:  # noqa: BLE001 - nats-py raises NoKeysError on an empty bucket
            return {}
        out = {}
        for key in keys:
            if key.startswith(KEY_AUDIT + "."):
                value = await self._get(key)
                if value is not None:
                    out[key[len(KEY_AUDIT) + 1 :]] = value
        return out

    async def put_progress(self, row: dict[str, Any]) -> int:
        """The trainers' last log row (rank 0, each log interval), with its wall time."""
        return await self._put(KEY_PROGRESS, row)

    async def put_world(self, world: dict[str, Any]) -> int:
        """The trainers' world as its rank 0 saw it at its first step, with past formations."""
        return await self._put(KEY_WORLD, world)

    async def get_world(self) -> dict[str, Any] | None:
        """The trainers' world and its formations (None before the first world's first step)."""
        return await self._get(KEY_WORLD)

    async def get_progress(self) -> dict[str, Any] | None:
        """The trainers' last log row, None before the first."""
        return await self._get(KEY_PROGRESS)


async def open_kv(
    bus: Bus, run: str, *, create: bool = False, cfg: BusConfig | None = None
) -> RunKV | None:
    """The run's KV bucket; None if it does not exist and `create` is False."""
    names = Names(run)
    what = f"opening KV bucket {names.kv_bucket}"
    open_bucket = lambda: bus.js.key_value(names.kv_bucket)  # noqa: E731
    try:
        return RunKV(await ride(bus, what, open_bucket), bus)
    except BusNotFound:
        if not create:
            return None
    cfg = cfg or bus.cfg
    kv_cfg = KeyValueConfig(
        bucket=names.kv_bucket,
        history=5,
        storage=StorageType.FILE,
        replicas=cfg.replicas,
        direct=True,
        description=f"specbus run {run}",
    )
    try:
        create = lambda: bus.js.create_key_value(kv_cfg)  # noqa: E731
        return RunKV(await _placed(bus, what, create, kv_cfg.replicas), bus)
    except BrokerUnavailable:
        raise
    except BusError as e:
        try:  # created concurrently by another process (or by this one, the answer lost)
            return RunKV(await ride(bus, what, open_bucket), bus)
        except BusNotFound:
            raise BusError(f"cannot create KV bucket {names.kv_bucket}: {e}") from e


async def ensure_run(bus: Bus, cfg: BusConfig | None, run: str) -> RunKV:
    """Declare the run's streams, consumers and KV bucket (idempotent; see module doc) and
    return the bucket. Raises `BusRejected` for an existing object the server cannot change
    in place, `BrokerUnavailable` after an outage of `bus.outage_give_up_s`."""
    cfg = cfg or bus.cfg
    names = Names(run)
    for stream in stream_configs(names, cfg):
        await _ensure_stream(bus, stream)
    for group in (PRODUCERS, TRAINERS):
        await _ensure_consumer(bus, names.stream_of(group), consumer_config(group, cfg))
    kv = await open_kv(bus, run, create=True, cfg=cfg)
    assert kv is not None
    return kv
