"""Build and run the pieces that create samples: `specbus feed` and `specbus produce`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal

import torch
from specbus.bus.connection import connect
from specbus.bus.run import declare
from specbus.bus.subjects import PRODUCERS
from specbus.core.config import RunConfig
from specbus.core.errors import ConfigError
from specbus.core.models.target import load_target_info, resolve_target_dir
from specbus.core.prometheus import Metrics
from specbus.core.store import open_store
from specbus.core.strategies.base import build_strategy
from specbus.core.telemetry import setup_tracing
from specbus.ops.metrics_http import serve_metrics
from specbus.producers.capture import CaptureStats, CaptureWorker
from specbus.producers.driven import DrivenWorker
from specbus.producers.engines.registry import build_engine
from specbus.producers.feature_server import is_served, serve_store
from specbus.producers.feeder import feed, manifest_of, prepare

log = logging.getLogger("specbus.producer")


def _not_live(cfg: RunConfig, what: str) -> None:
    if cfg.deployment.mode == "live":
        raise ConfigError(
            f"deployment.mode=live has no {what}: samples come from serving traffic "
            "(`specbus intake` + `specbus serve` or a capture-enabled server)"
        )


async def run_feeder(cfg: RunConfig, *, bus_url: str | None, on_progress=None) -> int:
    """Prepare the data and publish the run's tasks; returns the task count.
    `on_progress(published, planned, waiting)`: see `producers.feeder.feed`."""
    _not_live(cfg, "feeder")
    if cfg.telemetry.otel:
        setup_tracing(f"{cfg.telemetry.service_name}-feeder")
    progress = {"published": 0, "planned": 0, "waiting": 0}

    def on_feed(published: int, planned: int, waiting: int | None) -> None:
        progress.update(published=published, planned=planned, waiting=waiting or 0)
        if on_progress is not None:
            on_progress(published, planned, waiting)

    metrics = Metrics()
    metrics.read("specbus_feeder_published_tasks", "tasks published to TASKS",
                 lambda: progress["published"], kind="counter")  # fmt: skip
    metrics.read("specbus_feeder_planned_tasks", "tasks the feed publishes in all",
                 lambda: progress["planned"])  # fmt: skip
    metrics.read("specbus_feeder_held_back_tasks", "tasks not yet captured while the feeder "
                 "waits for the producers (0: not waiting)", lambda: progress["waiting"])  # fmt: skip
    server = serve_metrics(metrics, cfg, "feeder")  # while it runs
    try:
        prepared = await asyncio.to_thread(prepare, cfg)
        async with await connect(cfg.bus, bus_url, name="specbus-feeder") as bus:
            run = await declare(bus, cfg.bus, cfg.run)
            return await feed(
                run, prepared, manifest_of(cfg, prepared), cfg.data, on_progress=on_feed
            )
    finally:
        if server is not None:
            server.close()


def _intake_of(cfg: RunConfig, driven: bool) -> dict:
    """The intake a `sglang_server` producer asks for its captures' answers: `live.url` and
    `live.token` / $SPECBUS_INTAKE_TOKEN, else `<run_dir>/live/intake.json`."""
    if not driven:
        return {}
    from specbus.ops.intake_endpoint import read_endpoint

    known = read_endpoint(cfg) or {}
    token = cfg.live.token or os.environ.get("SPECBUS_INTAKE_TOKEN") or known.get("token")
    return {"intake_url": cfg.live.url or known.get("url"), "token": token}


async def run_producer(
    cfg: RunConfig,
    *,
    bus_url: str | None,
    producer_id: str | None = None,
    exit_when_idle: bool = False,
) -> CaptureStats:
    """Join the run's "producers" group and capture until the trainers are done."""
    _not_live(cfg, "producer")
    print(f"run {cfg.run}: producer {producer_id or os.getpid()} loading the target {cfg.target.model}; "
          "then capturing the tasks `specbus feed` publishes, until the trainers mark the run "
          "trained", flush=True)  # fmt: skip
    if cfg.telemetry.otel:
        setup_tracing(f"{cfg.telemetry.service_name}-producer")
    if os.environ.get("SPECBUS_THREADS"):
        torch.set_num_threads(int(os.environ["SPECBUS_THREADS"]))
    path = resolve_target_dir(cfg.target.model)
    info = load_target_info(path, name=cfg.target.model)
    strategy = build_strategy(cfg.strategy, info, aux_layers=cfg.target.aux_layers)
    contract = strategy.feature_contract(info)
    # the server's capture layer captures (docs/sglang.md, docs/vllm.md)
    driven = cfg.target.engine in ("sglang_server", "vllm_server")
    if driven:  # not two log lines per task (its POST, its outcome)
        logging.getLogger("httpx").setLevel(logging.WARNING)
    engine = await asyncio.to_thread(build_engine, cfg.target, **_intake_of(cfg, driven))
    served = is_served(cfg.store)  # http://: this producer serves its features (W3')
    store = serve_store(cfg.store) if served else open_store(cfg.store)
    sweeper = None
    try:
        async with await connect(cfg.bus, bus_url, name="specbus-producer") as bus:
            run = await declare(bus, cfg.bus, cfg.run)
            group = await run.join(PRODUCERS)
            if served:  # release what the trainers acked (what a killed trainer left)
                sweeper = asyncio.create_task(
                    store.release_acked(run, cfg.store.http.sweep_every_s)
                )
            worker = (DrivenWorker if driven else CaptureWorker)(
                run, group, engine, store, contract,
                capture_batch=cfg.target.capture_batch,
                producer_id=producer_id,
                exit_when_idle=exit_when_idle,
                unavailable_give_up_s=cfg.store.unavailable_give_up_s,
            )  # fmt: skip
            stop_on_sigterm(worker)
            server = serve_metrics(producer_metrics(worker, store), cfg, "producer")
            try:
                stats = await worker.run()
            finally:
                if server is not None:
                    server.close()
                if sweeper is not None:
                    sweeper.cancel()
                await group.close()
            await count_dead_letters(run, stats)
            return stats
    finally:
        store.close()
        engine.close()


def stop_on_sigterm(worker: CaptureWorker) -> None:
    """SIGTERM stops the worker after its batch (a wait for the store gives its tasks back at
    once: a stop, not backpressure); a second SIGTERM ends the process as before."""

    def handle() -> None:
        log.warning("SIGTERM: stopping after the batch in progress; send it again to exit now")
        worker.stop()
        loop.remove_signal_handler(signal.SIGTERM)

    loop = asyncio.get_running_loop()
    with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):  # not main thread
        loop.add_signal_handler(signal.SIGTERM, handle)


async def count_dead_letters(run, stats: CaptureStats, timeout_s: float = 30.0) -> None:
    """Fill `stats.run_dead_letters` / `dead_reasons` with the dead letters of the run's TASKS,
    the broker's max-deliveries ones included (left None when the broker does not answer in
    time: the summary then says so)."""
    try:
        counts = await asyncio.wait_for(run.count_dead(PRODUCERS), timeout_s)
    except Exception as e:  # noqa: BLE001 - a summary line must not fail the producer
        log.warning("could not count the run's dead letters: %s", e)
        return
    stats.run_dead_letters = sum(counts.values())
    stats.dead_reasons = {k: n for k, n in counts.items() if n}


def producer_metrics(worker, store) -> Metrics:
    """A producer's `/metrics` series: its capture worker's counts and seconds, its store's
    residency (read at scrape time)."""
    metrics = Metrics()
    stats = worker.stats
    for name, attr, doc in (("tasks", "tasks", "tasks captured (or settled)"),
                            ("samples", "samples", "samples stored and published"),
                            ("failures", "failures", "failed captures"),
                            ("dead_letters", "dead_letters", "tasks dead-lettered"),
                            ("backpressure_waits", "backpressure_waits", "waits on backpressure"),
                            ("capture_seconds", "capture_s", "seconds spent capturing"),
                            ("tokens", "tokens", "tokens captured")):  # fmt: skip
        metrics.read(f"specbus_producer_{name}", doc,
                     lambda attr=attr: getattr(stats, attr), kind="counter")  # fmt: skip

    def resident() -> float:
        try:
            return float(store.usage().resident_bytes)
        except Exception:  # noqa: BLE001 - a store that cannot answer now: unknown
            return float("nan")

    metrics.read("specbus_producer_store_resident_bytes", "the store's residency", resident)
    return metrics
