"""What is built: one registry per pluggable kind, checked when a run config loads.

A `Registry` maps a name to its factory, given as the object or as "module:attribute"
(imported on first `get`, so checking a config imports nothing heavy and names no upward
import). `RunConfig` refuses a name no registry holds, naming the key, the value and what
exists, so an unbuilt mode, engine, strategy or store fails at load, not mid-run.

A new component registers into its kind: a line in the table below for a built-in
(`("live", "specbus.ops.modes:LIVE")` in `MODES`), or `register` at import for a plugin
(before its config loads). Factories' signatures are each kind's own (see its `get` caller).
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Iterable
from typing import Any

from specbus.core.errors import ConfigError


class Registry:
    """Names of one kind of component (`key` is the config key that chooses one)."""

    def __init__(self, key: str, entries: Iterable[tuple[str, Any]] = ()):
        self.key = key
        self._entries: dict[str, Any] = {}
        self._lock = threading.Lock()
        for name, factory in entries:
            self.register(name, factory)

    def register(self, name: str, factory: Any, *, replace: bool = False) -> None:
        """Register `factory` (an object or "module:attribute") under `name`. Raises
        `ConfigError` if the name is taken, unless `replace` (a benchmark swapping a
        built-in for an in-process variant)."""
        with self._lock:
            if name in self._entries and not replace:
                raise ConfigError(f"{self.key} {name!r} is already registered")
            self._entries[name] = factory

    def unregister(self, name: str) -> None:
        """Forget `name` (a plugin unloading, a test cleaning up); no-op if absent."""
        with self._lock:
            self._entries.pop(name, None)

    def names(self) -> list[str]:
        """The registered names, sorted."""
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def check(self, name: str) -> str:
        """`name` if it is built; else `ConfigError` naming the key, the value and what is."""
        if name not in self._entries:
            raise ConfigError(
                f"{self.key} {name!r} is not registered; built: {', '.join(self.names()) or 'none'}"
            )
        return name

    def get(self, name: str) -> Any:
        """The factory of `name`, imported on first use. Raises `ConfigError` as `check`."""
        factory = self._entries[self.check(name)]
        if isinstance(factory, str):
            module, _, attr = factory.partition(":")
            factory = getattr(importlib.import_module(module), attr)
            with self._lock:
                self._entries[name] = factory
        return factory


# deployment.mode -> an `ops.modes.Mode` (how trainer ranks get their data)
MODES = Registry(
    "deployment.mode",
    [
        ("disaggregated", "specbus.ops.modes:DISAGGREGATED"),
        ("colocated", "specbus.ops.modes:COLOCATED"),
        ("live", "specbus.ops.modes:LIVE"),
    ],
)
# target.engine -> `(TargetConfig, **kw) -> TargetEngine` (producers/engines)
ENGINES = Registry(
    "target.engine",
    [
        ("hf", "specbus.producers.engines.hf:HFEngine"),
        ("sglang", "specbus.producers.engines.sglang:SGLangEngine"),
        ("sglang_server", "specbus.producers.engines.sglang_server:SGLangServerEngine"),
        ("vllm_server", "specbus.producers.engines.vllm_server:VLLMServerEngine"),
    ],
)
# strategy.name -> `(StrategyConfig, TargetInfo, *, heads, aux_layers) -> Strategy`
STRATEGIES = Registry(
    "strategy.name",
    [
        ("eagle3", "specbus.core.strategies.eagle3:Eagle3Strategy"),
        ("dflash", "specbus.core.strategies.dflash:DFlashFamilyStrategy"),
        ("domino", "specbus.core.strategies.dflash:DominoStrategy"),
        ("dspark", "specbus.core.strategies.dflash:DSparkStrategy"),
        ("peagle", "specbus.core.strategies.peagle:PEagleStrategy"),
    ],
)
# store.uri scheme -> `(StoreConfig, store_id, path, query) -> FeatureStore` (core/store)
STORES = Registry(
    "store.uri scheme",
    [
        ("mem", "specbus.core.store.mem:open_mem"),
        ("shm", "specbus.core.store.shm:open_shm"),
        ("mooncake", "specbus.core.store.mooncake:open_mooncake"),
        ("file", "specbus.core.store.file:open_file"),
        ("http", "specbus.core.store.http:open_http"),
    ],
)
