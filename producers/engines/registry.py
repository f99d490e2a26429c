"""Engine construction: `build_engine(cfg.target)` builds the engine `target.engine` names.

The names live in `core.registry.ENGINES` (so a config naming an unbuilt engine fails at
load); `register_engine` adds one (a benchmark's in-process variant, a plugin).
"""

from __future__ import annotations

from collections.abc import Callable

from specbus.core.config import TargetConfig
from specbus.core.registry import ENGINES
from specbus.producers.engines.base import TargetEngine


def register_engine(
    name: str, factory: Callable[..., TargetEngine], *, replace: bool = False
) -> None:
    """Register `factory(cfg: TargetConfig, **kw) -> TargetEngine` under `name`;
    `replace=True` swaps an existing one (benchmarks build the target in-process, e.g. a random
    model of a real config, under the same name). Raises `ConfigError` for a taken name."""
    ENGINES.register(name, factory, replace=replace)


def build_engine(cfg: TargetConfig, **kwargs) -> TargetEngine:
    """Build the engine `cfg.engine` (`kwargs` go to its factory: `tp_mesh`, `model`).
    Raises `ConfigError` for one not built."""
    return ENGINES.get(cfg.engine)(cfg, **kwargs)
