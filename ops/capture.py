"""`specbus capture`: capture a dataset once into a `file://` store, as a recording (W1).

    specbus capture --config run.yaml store.uri=file:///data/rec1

Feeds the run's tasks (resumable, as `specbus feed`), runs a producer in this process until
the feed is complete and no task is pending or in capture, then finalizes the recording. More
producers may join with `specbus produce`, the same store and a `store.budget_bytes` that
holds the whole recording (a producer's backpressure counts the refs nobody consumes).
Finalizing:
- the final refs of SAMPLES (per sample, its last generation; `consumers.recording.final_refs`)
  must account for every fed task (or its dead letter);
- the store's files are flushed to stable storage (`FileStore.sync`);
- `refs.jsonl` (one final ref per line, recorded order) and `recording.json` (the marker below
  plus the run's manifest) are written atomically into the store's directory: the directory is
  a self-contained recording (`specbus train --from-recording /data/rec1`);
- the run's KV gets the recording marker (samples, first/last SAMPLES sequence, store URI,
  feature spec, plan hash, dead letters): `specbus train --from-recording rec1` replays the
  recorded SAMPLES from the broker. The train-complete marker is set too, which releases any
  producer still waiting.
Nothing releases the features: no trainer consumes the run's SAMPLES, so its refs stay
pending, and the stream keeps them (`bus.samples_max_age_s = 0` here).

Running it again on a complete recording changes nothing and prints the marker; on an
interrupted one it goes on (the feeder resumes, redelivered tasks are captured again into the
same keys, duplicate refs are dropped by dedup or by `final_refs`).

Defaults for a recording, unless the config sets them: `store.crc: true` (every tensor's CRC32
is recorded in its ref and its file, and checked on read) and `store.budget_bytes` = what the
store's filesystem can hold (the producer's backpressure then stops at 90 % of the disk).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from specbus.bus.connection import connect
from specbus.bus.run import RunBus, declare
from specbus.bus.subjects import PRODUCERS, TRAINERS
from specbus.consumers.recording import FORMAT, MARKER_FILE, REFS_FILE, final_refs
from specbus.core.config import RunConfig
from specbus.core.contracts import SampleRef
from specbus.core.errors import ConfigError, RecordError
from specbus.core.models.target import load_target_info, resolve_target_dir
from specbus.core.store.file import FileStore

log = logging.getLogger("specbus.capture")


def recording_config(cfg: RunConfig) -> RunConfig:
    """The run config a recording is captured with (see module doc)."""
    if not cfg.store.uri.startswith("file://"):
        raise ConfigError(
            f"specbus capture records into a file:// store, not store.uri={cfg.store.uri!r} "
            "(store.uri=file:///abs/dir)"
        )
    store = cfg.store
    probe = store.build()
    try:
        room = probe.usage().capacity_bytes
    finally:
        probe.close()
    update: dict[str, Any] = {}
    if "crc" not in store.model_fields_set:
        update["crc"] = True
    if "budget_bytes" not in store.model_fields_set and room:
        update["budget_bytes"] = room
    return cfg.model_copy(
        update={
            "store": store.model_copy(update=update),
            "bus": cfg.bus.model_copy(update={"samples_max_age_s": 0.0}),
        }
    )


def run_capture(
    cfg: RunConfig, *, bus_url: str | None, feed: bool = True, produce: bool = True
) -> dict[str, Any]:
    """Feed, capture and finalize the recording of `cfg.run`; returns its marker."""
    cfg = recording_config(cfg)
    return asyncio.run(_capture(cfg, bus_url, feed, produce))


async def _capture(cfg: RunConfig, bus_url: str | None, feed: bool, produce: bool) -> dict:
    from specbus.ops.produce import run_feeder, run_producer

    async with await connect(cfg.bus, bus_url, name="specbus-capture") as bus:
        run = await declare(bus, cfg.bus, cfg.run)
        marker = await run.kv.recording()
        if marker is not None:
            log.info(
                "run %s is a complete recording already (%d samples)", cfg.run, marker["samples"]
            )
            return marker
    if feed:
        count = await run_feeder(cfg, bus_url=bus_url)
        log.info("run %s: %d tasks fed", cfg.run, count)
    if produce:
        stats = await run_producer(cfg, bus_url=bus_url, exit_when_idle=True)
        log.info("captured %d samples (%d failures)", stats.samples, stats.failures)
    async with await connect(cfg.bus, bus_url, name="specbus-capture") as bus:
        run = await declare(bus, cfg.bus, cfg.run)
        await _wait_idle(run)
        return await finalize(run, cfg)


async def _wait_idle(run: RunBus, report_s: float = 30.0) -> None:
    """Until the producers' group is drained (`RunBus.drained`: the feed complete, no task
    pending) and no task is in capture either (other producers)."""
    t0 = reported = time.monotonic()
    while True:
        drained = await run.drained(PRODUCERS)
        if drained.done and not drained.ack_pending:
            return
        now = time.monotonic()
        if now - reported >= report_s:
            reported = now
            log.info("waiting %.0fs for the capture: %s", now - t0,
                     drained.waiting_for or f"{drained.ack_pending} tasks in capture")  # fmt: skip
        await asyncio.sleep(0.5)


async def finalize(run: RunBus, cfg: RunConfig) -> dict[str, Any]:
    """Check the recording is whole, flush it, write its directory files and its marker.
    Raises `ConfigError` for an incomplete recording or a store that is not `file://`."""
    kv = run.kv
    records = []
    async for stored in run.replay(TRAINERS, 1):
        try:
            records.append((stored.seq, SampleRef.from_bytes(stored.data)))
        except RecordError as e:
            log.warning("SAMPLES seq %d is not a SampleRef, left out: %s", stored.seq, e)
    final = final_refs(records)
    feed_count = await kv.feed_complete()
    dead = [d for d in await run.dead_letters() if d.stream == run.names.tasks_stream]
    if feed_count is None or len(final) + len(dead) < feed_count:
        raise ConfigError(
            f"recording {cfg.run!r} is incomplete: {len(final)} samples and {len(dead)} dead "
            f"letters for {feed_count} fed tasks"
        )
    if not final:
        raise ConfigError(f"recording {cfg.run!r} holds no sample")
    store = cfg.store.build()
    try:
        if not isinstance(store, FileStore):
            raise ConfigError(f"a recording needs a file:// store, not {cfg.store.uri!r}")
        await asyncio.to_thread(store.sync)
        root, store_id = store.root, store.store_id
    finally:
        store.close()
    path = resolve_target_dir(cfg.target.model)
    info = load_target_info(path, name=cfg.target.model)
    contract = cfg.strategy.build(info, aux_layers=cfg.target.aux_layers).feature_contract(info)
    manifest = await kv.get_manifest()
    first_ref = final[0][1]
    marker = {
        "format": FORMAT,
        "run": cfg.run,
        "samples": len(final),
        "first_seq": final[0][0],
        "last_seq": max(seq for seq, _ in records),
        "store_uri": first_ref.store_uri,
        "store_id": store_id,
        "strategy": contract.strategy,
        "features": {
            f.name: {"shape": list(f.shape), "dtype": first_ref.features[f.name].dtype}
            for f in contract.fields
        },
        "aux_layers": list(contract.aux_layers),
        "plan_hash": manifest.plan_hash if manifest else None,
        "fed_tasks": feed_count,
        "dead_letters": len(dead),
        "bytes": sum(ref.nbytes for _, ref in final),
        "crc": first_ref.features[contract.fields[0].name].crc32 is not None,
        "created_at": time.time(),
    }
    _write_atomic(root / REFS_FILE, b"".join(ref.to_bytes() + b"\n" for _, ref in final))
    manifest_json = manifest.model_dump(mode="json") if manifest else None
    _write_atomic(
        root / MARKER_FILE, json.dumps({**marker, "manifest": manifest_json}, indent=1).encode()
    )
    await kv.mark_recording_complete(marker)
    await kv.mark_train_complete({"recording": True, "samples": len(final)})  # producers stop
    log.info(
        "recording %s complete: %d samples (%d dead letters), %.1f MiB in %s",
        cfg.run, len(final), len(dead), marker["bytes"] / 2**20, root,
    )  # fmt: skip
    return marker


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, path)
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
