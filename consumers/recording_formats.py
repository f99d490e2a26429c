"""Every recording format, and `open_recording`, which picks one by what its spec names:
a specbus recording directory or a run on the broker (consumers/recording.py), a vLLM
speculators dump (consumers/speculators.py), a SpecForge dump (consumers/specforge.py). A
module above the formats, so that they build on `Recording` without a cycle."""

from __future__ import annotations

import asyncio
from pathlib import Path

from specbus.bus.connection import Bus
from specbus.consumers.recording import MARKER_FILE, BusRecording, DirRecording, Recording
from specbus.consumers.specforge import SpecForgeRecording
from specbus.consumers.speculators import SpeculatorsRecording, is_speculators_dump
from specbus.core.config import StrategyConfig, TargetConfig
from specbus.core.errors import ConfigError


async def open_recording(
    spec: str, bus: Bus | None, strategy: StrategyConfig, target: TargetConfig
) -> Recording:
    """The recording `spec` names: a directory (a specbus recording, a speculators dump or a
    SpecForge dump, read for `strategy` on `target`), else a run name on the broker. Raises `ConfigError`
    for what is neither."""
    path = Path(spec)
    if path.is_dir() or path.is_absolute() or spec.startswith("."):
        if (path / MARKER_FILE).is_file():
            return await asyncio.to_thread(DirRecording, path)
        if is_speculators_dump(path):
            return await asyncio.to_thread(SpeculatorsRecording, path, strategy, target)
        return await asyncio.to_thread(SpecForgeRecording, path, strategy, target)
    if bus is None:
        raise ConfigError(f"recording {spec!r}: a run name needs the broker (--url)")
    return await BusRecording.open(bus, spec)
