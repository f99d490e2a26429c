"""Build and run the pieces that create samples: `specbus feed` and `specbus produce`."""

from __future__ import annotations

import asyncio
import logging
import os

import torch
from specbus.bus.connection import connect
from specbus.bus.lease import Leases
from specbus.bus.subjects import PRODUCERS
from specbus.bus.topology import declare
from specbus.core.config import RunConfig
from specbus.core.errors import ConfigError
from specbus.core.models.target import load_target_info, resolve_target_dir
from specbus.core.store import open_store
from specbus.core.strategies.base import build_strategy
from specbus.core.telemetry import setup_tracing
from specbus.producers.capture import CaptureStats, CaptureWorker
from specbus.producers.engines.registry import build_engine
from specbus.producers.feeder import feed, prepare

log = logging.getLogger("specbus.producer")


def _not_live(cfg: RunConfig, what: str) -> None:
    if cfg.deployment.mode == "live":
        raise ConfigError(
            f"deployment.mode=live has no {what}: samples come from serving traffic "
            "(`specbus intake` + `specbus serve` or a capture-enabled server)"
        )


async def run_feeder(cfg: RunConfig, *, bus_url: str | None) -> int:
    """Prepare the data and publish the run's tasks; returns the task count."""
    _not_live(cfg, "feeder")
    prepared = await asyncio.to_thread(prepare, cfg)
    async with await connect(cfg.bus, bus_url, name="specbus-feeder") as bus:
        topo = await declare(bus, cfg.bus, cfg.run)
        return await feed(bus, topo.kv, cfg, prepared)


async def run_producer(
    cfg: RunConfig,
    *,
    bus_url: str | None,
    producer_id: str | None = None,
    exit_when_idle: bool = False,
) -> CaptureStats:
    """Join the run's "producers" group and capture until the trainers are done."""
    _not_live(cfg, "producer")
    if cfg.telemetry.otel:
        setup_tracing(f"{cfg.telemetry.service_name}-producer")
    if os.environ.get("SPECBUS_THREADS"):
        torch.set_num_threads(int(os.environ["SPECBUS_THREADS"]))
    path = resolve_target_dir(cfg.target.model)
    info = load_target_info(path, name=cfg.target.model)
    strategy = build_strategy(cfg.strategy, info, aux_layers=cfg.target.aux_layers)
    contract = strategy.feature_contract(info)
    engine = await asyncio.to_thread(build_engine, cfg.target)
    store = open_store(cfg.store)
    try:
        async with await connect(cfg.bus, bus_url, name="specbus-producer") as bus:
            topo = await declare(bus, cfg.bus, cfg.run)
            group = await Leases.join(bus, cfg.run, PRODUCERS)
            worker = CaptureWorker(
                cfg,
                bus,
                topo.kv,
                group,
                engine,
                store,
                contract,
                producer_id=producer_id,
                exit_when_idle=exit_when_idle,
            )
            try:
                return await worker.run()
            finally:
                await group.close()
    finally:
        store.close()
        engine.close()
