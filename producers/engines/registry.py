"""Engine registry: `build_engine(cfg.target)` picks the engine named by `target.engine`."""

from __future__ import annotations

from collections.abc import Callable

from specbus.core.config import TargetConfig
from specbus.core.errors import ConfigError
from specbus.producers.engines.base import TargetEngine

_ENGINES: dict[str, Callable[..., TargetEngine]] = {}


def register_engine(
    name: str, factory: Callable[..., TargetEngine], *, replace: bool = False
) -> None:
    """Register `factory` under `name`; `replace=True` swaps an existing one (benchmarks build
    the target in-process, e.g. a random model of a real config, under the same name)."""
    if name in _ENGINES and not replace:
        raise ConfigError(f"target engine {name!r} is already registered")
    _ENGINES[name] = factory


def _hf(cfg: TargetConfig, **kwargs) -> TargetEngine:
    from specbus.producers.engines.hf import HFEngine

    return HFEngine(cfg, **kwargs)


register_engine("hf", _hf)


def build_engine(cfg: TargetConfig, **kwargs) -> TargetEngine:
    """Build the engine `cfg.engine`. Raises `ConfigError` for one not registered (yet)."""
    try:
        factory = _ENGINES[cfg.engine]
    except KeyError as e:
        raise ConfigError(
            f"target.engine {cfg.engine!r} is not available; registered: {sorted(_ENGINES)}"
        ) from e
    return factory(cfg, **kwargs)
