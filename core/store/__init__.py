"""Feature stores: `open_store(cfg_or_uri)` builds the backend a URI names.

    mem://<store_id>                                   in-process (colocated)
    shm://<store_id>   or   shm:///abs/dir?store_id=x  shared memory on one host, no server
                                                       (a query may set StoreConfig fields:
                                                       shm://x?recycle_bytes=0)
    mooncake://<store_id>?master=H:P&metadata=P2P&admin=H:P&protocol=tcp
    file:///abs/dir[?store_id=x]                       persistent safetensors files (recordings)
    http://host:port/<store_id>                        features a producer serves (W3')

A store's `uri` is canonical: `open_store(store.uri)` in another process reaches the same
samples (that is what SampleRef.store_uri records). See core/store/base.py for the contract.
`purge_store(uri)` removes every object of a store whose run is gone.
"""

from __future__ import annotations

import urllib.parse
from typing import Any

from specbus.core.config import StoreConfig
from specbus.core.errors import ConfigError
from specbus.core.registry import STORES
from specbus.core.store.base import FeatureStore, StoreUsage, check_store_id

__all__ = ["FeatureStore", "StoreUsage", "open_store", "parse_uri", "purge_store"]


def parse_uri(uri: str) -> tuple[str, str | None, str | None, dict[str, str]]:
    """`(scheme, store_id or None, absolute dir or None, query)`; raises ConfigError for a
    scheme no store is built for (`core.registry.STORES`)."""
    parts = urllib.parse.urlsplit(uri)
    if parts.scheme not in STORES:
        raise ConfigError(
            f"store.uri {uri!r}: scheme must be one of {', '.join(s + '://' for s in STORES.names())}"
        )
    query = dict(urllib.parse.parse_qsl(parts.query))
    path = parts.path or None
    if parts.scheme == "http":  # the netloc is an address; the path names the store
        return parts.scheme, path.strip("/") or query.pop("store_id", None), None, query
    if path is not None and parts.scheme not in ("shm", "file"):
        raise ConfigError(f"store.uri {uri!r}: only shm:// and file:// take a directory path")
    return parts.scheme, parts.netloc or query.pop("store_id", None), path, query


def open_store(cfg_or_uri: StoreConfig | str, **kw: Any) -> FeatureStore:
    """Build a store from a StoreConfig or a URI.

    Keyword arguments override StoreConfig fields (`budget_bytes=...`, `mooncake=...`) and
    `store_id=` names the store when the URI does not. For mooncake://, the URI's query
    (master, metadata, admin, protocol) overrides `cfg.mooncake`.
    """
    if isinstance(cfg_or_uri, str):
        parse_uri(cfg_or_uri)  # a ConfigError naming the scheme, before pydantic's
        cfg = StoreConfig(uri=cfg_or_uri)
    else:
        cfg = cfg_or_uri
    store_id_kw = kw.pop("store_id", None)
    if kw:
        try:
            cfg = StoreConfig.model_validate({**cfg.model_dump(), **kw})
        except Exception as e:
            raise ConfigError(f"open_store: invalid store option(s) {sorted(kw)}: {e}") from e
    scheme, uri_id, path, query = parse_uri(cfg.uri)
    store_id = check_store_id(store_id_kw or uri_id or cfg.store_id or "default")
    return STORES.get(scheme)(cfg, store_id, path, query)


def query_options(cfg: StoreConfig, query: dict[str, str]) -> StoreConfig:
    """`cfg` with the URI query's StoreConfig fields applied (`shm://id?recycle_bytes=0` tunes
    this handle). Raises `ConfigError` for a field that is not one."""
    if not query:
        return cfg
    unknown = set(query) - (set(StoreConfig.model_fields) - {"uri", "mooncake", "store_id", "http"})
    if unknown:
        raise ConfigError(f"store.uri {cfg.uri!r}: unknown option(s) {sorted(unknown)}")
    return StoreConfig.model_validate({**cfg.model_dump(), **query})


def purge_store(cfg_or_uri: StoreConfig | str, **kw: Any) -> int:
    """Remove every object of a store id whose run no longer exists: every generation of
    every sample, puts in progress and (shm) cached files and the directory itself when no
    live process has the store open; Mooncake objects are removed forced (no read lease
    protects a reader of a run that is gone). Returns the bytes freed. Arguments as for
    `open_store`. The caller asserts the run is gone: a reader still running would get
    FeatureMissing (and recapture), a writer still running a failed put.

    For mem:// this only reaches this process's samples (they live and die with it)."""
    kw.setdefault("keep_on_close", False)  # shm: the last one out takes the directory too
    store = open_store(cfg_or_uri, **kw)
    try:
        return store.purge()
    finally:
        store.close(timeout_s=0)
