"""`http://host:port/<store_id>`: features a producer serves from its own store (W3').

A client of one producer's feature server (`producers/feature_server.py`): one pooled
`aiohttp` session per producer address per process, on a background loop shared by every
handle; a get streams the body into preallocated tensors. Errors: 404 and an unreachable
producer are `FeatureMissing` (the trainer recaptures), 401 `StoreDenied`, a body that does
not match its spec `IntegrityError`, 507 `StoreFull`, other 5xx `StoreUnavailable`. The
protocol, the token and the errors in full: docs/store.md, "http://".
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import os
import threading
import urllib.parse
from collections.abc import Iterable, Mapping

import orjson
import torch
from specbus.core.config import StoreConfig
from specbus.core.contracts import FeatureSpec
from specbus.core.errors import (
    ConfigError,
    FeatureMissing,
    IntegrityError,
    StoreDenied,
    StoreError,
    StoreFull,
    StoreNoSpace,
    StoreUnavailable,
)
from specbus.core.store import stfile
from specbus.core.store.base import (
    RefLike,
    StoreBase,
    Stored,
    StoreUsage,
    as_cpu_contiguous,
    as_feature,
    byte_view,
    parse_key,
    sample_of,
    specs_of,
    to_device,
)
from specbus.core.store.pool import BufferPool

log = logging.getLogger(__name__)

TOKEN_ENV = "SPECBUS_STORE_TOKEN"
LAYOUT_HEADER = "X-Specbus-Layout"
CHUNK = 1 << 20


def resolve_token(cfg: StoreConfig) -> str | None:
    """The bearer token: `store.http.token`, else `$SPECBUS_STORE_TOKEN`, else None."""
    return cfg.http.token or os.environ.get(TOKEN_ENV) or None


def layout_of(specs: Iterable[tuple[str, str, tuple[int, ...], int]]) -> str:
    """`name:dtype:shape:nbytes,...` (shape as `AxBxC`, empty for a scalar)."""
    return ",".join(
        f"{name}:{dtype}:{'x'.join(str(d) for d in shape)}:{nbytes}"
        for name, dtype, shape, nbytes in specs
    )


def parse_layout(text: str) -> list[tuple[str, str, tuple[int, ...], int]]:
    """The `(name, dtype, shape, nbytes)` entries of a `layout_of` string."""
    out = []
    for item in filter(None, text.split(",")):
        name, dtype, shape, nbytes = item.split(":")
        out.append((name, dtype, tuple(int(d) for d in shape.split("x") if d), int(nbytes)))
    return out


# ---- the process's client loop and sessions ------------------------------------------------


class _Client:
    """A daemon thread running an event loop, and one aiohttp session per (address, pool
    size): every HttpStore handle of the process shares them."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="specbus-http", daemon=True
        )
        self._thread.start()
        self._sessions: dict[tuple[str, int], object] = {}
        self._pid = os.getpid()

    def call(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def session(self, address: str, connections: int):
        import aiohttp

        key = (address, connections)
        s = self._sessions.get(key)
        if s is None or s.closed:
            connector = aiohttp.TCPConnector(limit=connections, keepalive_timeout=30)
            s = self._sessions[key] = aiohttp.ClientSession(
                connector=connector, auto_decompress=False, raise_for_status=False
            )
        return s

    def close(self) -> None:
        async def close_all():
            for s in self._sessions.values():
                await s.close()

        if self.loop.is_running():
            with contextlib.suppress(Exception):  # exiting anyway
                self.call(close_all(), timeout=5)
            self.loop.call_soon_threadsafe(self.loop.stop)


_client: _Client | None = None
_client_lock = threading.Lock()
_pool: BufferPool | None = None


def client() -> _Client:
    """This process's shared HTTP client (a new one after a fork)."""
    global _client
    with _client_lock:
        if _client is None or _client._pid != os.getpid():
            _client = _Client()
        return _client


@atexit.register
def _close_client() -> None:
    if _client is not None and _client._pid == os.getpid():
        _client.close()


def _recv(nbytes: int, pool_bytes: int) -> torch.Tensor:
    global _pool
    if pool_bytes > 0 and nbytes:
        with _client_lock:
            if _pool is None:
                _pool = BufferPool(pool_bytes)
        off = _pool.alloc(nbytes)
        if off is not None:
            return _pool.tensor(off, nbytes)
    return torch.empty(nbytes, dtype=torch.uint8)


class _Sink:
    """Copies a body's chunks into the preallocated byte views of several tensors."""

    def __init__(self, views: list[memoryview]):
        self.views = views
        self.total = sum(len(v) for v in views)
        self.got = 0
        self._i, self._at = 0, 0  # current view, offset in it

    def seek(self, offset: int) -> None:
        self.got, self._i, self._at = offset, 0, offset
        while self._i < len(self.views) and self._at >= len(self.views[self._i]):
            self._at -= len(self.views[self._i])
            self._i += 1

    def write(self, chunk: bytes) -> None:
        if self.got + len(chunk) > self.total:
            raise IntegrityError(f"body longer than the {self.total} bytes the specs announce")
        mv = memoryview(chunk)
        while mv:
            while len(self.views[self._i]) == self._at:
                self._i, self._at = self._i + 1, 0
            view = self.views[self._i]
            n = min(len(mv), len(view) - self._at)
            view[self._at : self._at + n] = mv[:n]
            self._at += n
            mv = mv[n:]
        self.got += len(chunk)


# ---- the store ---------------------------------------------------------------------------


class HttpStore(StoreBase):
    """A client of one producer's feature server (see module doc)."""

    def __init__(self, cfg: StoreConfig, store_id: str, uri: str):
        parts = urllib.parse.urlsplit(uri)
        if not parts.hostname:
            raise ConfigError(f"store.uri {uri!r}: an http:// store needs a host and port")
        self.cfg = cfg
        self.store_id = store_id
        self.address = f"{parts.scheme}://{parts.netloc}"
        self.uri = f"{self.address}/{store_id}"
        self.base = self.uri
        token = resolve_token(cfg)
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._client = client()
        self._usage: StoreUsage | None = None
        h = cfg.http
        self._timeout_s = h.connect_timeout_s + h.read_timeout_s

    # -- plumbing ----------------------------------------------------------------------------
    def _call(self, coro):
        return self._client.call(coro, timeout=self._timeout_s * 4 + 5)

    def _session(self):
        return self._client.session(self.address, self.cfg.http.connections)

    def _timeout(self):
        import aiohttp

        h = self.cfg.http
        return aiohttp.ClientTimeout(
            total=None, connect=h.connect_timeout_s, sock_read=h.read_timeout_s
        )

    def _sample_url(self, sample_id: str, gen: int) -> str:
        return f"{self.base}/samples/{urllib.parse.quote(sample_id, safe='')}/g{gen}"

    async def _error(self, resp, key: str) -> StoreError:
        """The typed error of a non-2xx answer."""
        try:
            body = await resp.json(content_type=None)
            message = body.get("message", "")
        except Exception:  # noqa: BLE001 - not our server, or a cut answer
            message = (await resp.text(errors="replace"))[:200] if resp.content else ""
        where = f"{self.uri}: {resp.method} {resp.url.path}: {resp.status}"
        if resp.status == 404:
            return FeatureMissing(key, f"{where}: {message}")
        if resp.status in (401, 403):
            return StoreDenied(
                f"{where}: the feature server refused the bearer token (store.http.token or "
                f"${TOKEN_ENV} must match the producer's)"
            )
        if resp.status == 422:
            return IntegrityError(f"{where}: {message}")
        if resp.status == 507:
            if "space" in message:
                return StoreNoSpace(f"{where}: {message}", directory=self.uri, needed=0, free=0)
            return StoreFull(f"{where}: {message}")
        if resp.status >= 500:
            return StoreUnavailable(f"{where}: {message}")
        return StoreError(f"{where}: {message}")

    def _unreachable(self, key: str, e: Exception) -> FeatureMissing:
        return FeatureMissing(
            key,
            f"the producer serving {self.uri} cannot be reached ({type(e).__name__}: {e}); "
            "its features are gone with it",
        )

    async def _request(self, method: str, url: str, key: str, **kw):
        """(status, json body) of a small request; typed errors for the rest."""
        import aiohttp

        try:
            async with self._session().request(
                method, url, headers=self._headers, timeout=self._timeout(), **kw
            ) as resp:
                if resp.status >= 300:
                    raise await self._error(resp, key)
                if resp.status == 204:
                    return None
                return await resp.json(content_type=None)
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as e:
            raise self._unreachable(key, e) from e

    # -- get ---------------------------------------------------------------------------------
    def get(
        self, ref: RefLike, names: Iterable[str] | None = None, device=None
    ) -> dict[str, torch.Tensor]:
        """The tensors, streamed into preallocated memory (see `FeatureStore.get` and the module
        doc for the errors)."""
        self._check_open()
        specs = specs_of(ref, names)
        if not specs:
            return {}
        sample_id, gen = sample_of(specs, self.store_id)
        flats = {n: _recv(s.nbytes, self.cfg.pool_bytes) for n, s in specs.items()}
        self._call(self._fetch(sample_id, gen, specs, flats))
        return to_device({name: as_feature(spec, flats[name]) for name, spec in specs.items()},
                         device)  # fmt: skip

    async def _fetch(self, sample_id, gen, specs: dict[str, FeatureSpec], flats) -> None:
        import aiohttp

        key = next(iter(specs.values())).key
        names = [parse_key(s.key, self.store_id).name for s in specs.values()]
        views = [memoryview(flats[n].numpy()).cast("B") if s.nbytes else memoryview(b"")
                 for n, s in specs.items()]  # fmt: skip
        sink = _Sink(views)
        url = self._sample_url(sample_id, gen)
        params = {"names": ",".join(names)}
        tries = 0
        while True:
            headers = dict(self._headers)
            if sink.got:
                headers["Range"] = f"bytes={sink.got}-"
            started = sink.got
            try:
                async with self._session().get(
                    url, params=params, headers=headers, timeout=self._timeout()
                ) as resp:
                    if resp.status not in (200, 206):
                        raise await self._error(resp, key)
                    if started and resp.status != 206:
                        sink.seek(0)  # the server ignored the range: the whole body again
                    if not started:
                        self._check_layout(resp.headers.get(LAYOUT_HEADER, ""), specs)
                    length = resp.content_length
                    if length is not None and sink.got + length != sink.total:
                        raise IntegrityError(
                            f"feature {key!r}: the server sends {length} bytes from offset "
                            f"{sink.got}, the specs announce {sink.total} (short read)"
                        )
                    async for chunk in resp.content.iter_any():
                        sink.write(chunk)
                if sink.got == sink.total:
                    return
                raise aiohttp.ClientPayloadError(f"body ended at {sink.got} of {sink.total}")
            except (
                aiohttp.ClientConnectionError,
                aiohttp.ClientPayloadError,
                asyncio.TimeoutError,
            ) as e:
                if sink.got == 0 and started == 0 and not isinstance(e, aiohttp.ClientPayloadError):
                    raise self._unreachable(key, e) from e
                tries += 1
                if tries > 1:
                    raise IntegrityError(
                        f"feature {key!r}: transfer from {self.uri} cut at {sink.got} of "
                        f"{sink.total} bytes, twice (short read): {e}"
                    ) from e
                log.info(
                    "transfer of %s cut at %d of %d bytes, resuming: %s",
                    key,
                    sink.got,
                    sink.total,
                    e,
                )

    def _check_layout(self, text: str, specs: dict[str, FeatureSpec]) -> None:
        try:
            got = parse_layout(text)
        except ValueError as e:
            raise IntegrityError(f"{self.uri}: unreadable {LAYOUT_HEADER} {text!r}") from e
        want = [(parse_key(s.key).name, s.dtype, tuple(s.shape), s.nbytes) for s in specs.values()]
        if got != want:
            raise IntegrityError(
                f"{self.uri}: stored {layout_of(got)!r}, the spec says {layout_of(want)!r}"
            )

    # -- put ---------------------------------------------------------------------------------
    def put(
        self, sample_id: str, tensors: Mapping[str, torch.Tensor], gen: int = 0
    ) -> dict[str, FeatureSpec]:
        """Upload a sample (a safetensors body) into the producer's store. Producers put into
        their own store directly; this is for other writers (and the contract tests)."""
        self._check_open()
        kept = {name: as_cpu_contiguous(name, t) for name, t in tensors.items()}
        head, order = stfile.header_bytes(kept)

        async def body():
            yield head
            for name in order:
                mv = memoryview(byte_view(kept[name]).numpy()).cast("B")
                for at in range(0, len(mv), CHUNK):
                    yield mv[at : at + CHUNK]

        size = len(head) + sum(t.numel() * t.element_size() for t in kept.values())
        got = self._call(self._put(sample_id, gen, body(), size))
        return {n: FeatureSpec.model_validate_json(orjson.dumps(s)) for n, s in got.items()}

    async def _put(self, sample_id, gen, body, size):
        import aiohttp

        key = f"{self.store_id}/{sample_id}/g{gen}"
        headers = {**self._headers, "Content-Length": str(size),
                   "Content-Type": "application/octet-stream"}  # fmt: skip
        try:
            async with self._session().put(
                self._sample_url(sample_id, gen), data=body, headers=headers,
                timeout=self._timeout(),
            ) as resp:  # fmt: skip
                if resp.status >= 300:
                    raise await self._error(resp, key)
                return await resp.json(content_type=None)
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as e:
            raise StoreUnavailable(f"{self.uri}: cannot put {key}: {e}") from e

    # -- the rest of the API -----------------------------------------------------------------
    def release(self, ref: RefLike) -> None:
        """DELETE one generation of a sample at its producer (idempotent; best effort when the
        producer is gone)."""
        sample_id, gen = sample_of(specs_of(ref), self.store_id)
        with contextlib.suppress(FeatureMissing):  # gone with its producer: nothing to free
            self._call(self._request("DELETE", self._sample_url(sample_id, gen), ""))

    def adopt(self, ref: RefLike) -> None:
        """HEAD the sample at its producer: present, with the spec's layout (see
        `FeatureStore.adopt`)."""
        specs = specs_of(ref)
        sample_id, gen = sample_of(specs, self.store_id)
        names = [parse_key(s.key).name for s in specs.values()]
        key = next(iter(specs.values())).key

        async def head():
            import aiohttp

            try:
                async with self._session().head(
                    self._sample_url(sample_id, gen), params={"names": ",".join(names)},
                    headers=self._headers, timeout=self._timeout(),
                ) as resp:  # fmt: skip
                    if resp.status >= 300:
                        raise await self._error(resp, key)
                    return resp.headers.get(LAYOUT_HEADER, "")
            except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as e:
                raise self._unreachable(key, e) from e

        self._check_layout(self._call(head()), specs)

    def usage(self) -> StoreUsage:
        """The producer's store usage; the last one seen (or zeros) when it cannot be reached
        (a log row must not fail because a producer died)."""
        try:
            got = self._call(self._request("GET", f"{self.base}/usage", ""))
            self._usage = StoreUsage(**got)
        except (FeatureMissing, StoreUnavailable) as e:
            log.debug("usage of %s unknown: %s", self.uri, e)
            if self._usage is None:
                return StoreUsage(0, 0, 0, self.cfg.budget_bytes)
        return self._usage

    def gc(self, live: Iterable[str] | None = None, *, min_age_s: float | None = None) -> int:
        """The producer's gc (see `FeatureStore.gc`); returns the bytes freed."""
        payload = {"live": None if live is None else sorted(live), "min_age_s": min_age_s}
        return self._call(self._request("POST", f"{self.base}/gc", "", json=payload))["freed"]

    def alloc(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An empty tensor in this process's memory."""
        return torch.empty(shape, dtype=dtype)

    def _stored(self) -> list[Stored]:
        got = self._call(self._request("GET", f"{self.base}/stored", ""))
        return [Stored(sid, int(gen)) for sid, gen in got["stored"]]

    def _drop(self, stored: list[Stored], force: bool) -> int:
        if not stored:
            return 0
        payload = {"samples": [[s.sample_id, s.gen] for s in stored], "force": force}
        return self._call(self._request("POST", f"{self.base}/drop", "", json=payload))["freed"]

    def _purge_rest(self) -> int:
        return self._call(self._request("POST", f"{self.base}/purge", ""))["freed"]


def open_http(
    cfg: StoreConfig, store_id: str, path: str | None, query: dict[str, str]
) -> HttpStore:
    """`http://host:port/<store_id>` (`core.registry.STORES`): a client of that producer's
    feature server; a query may set StoreConfig fields."""
    from specbus.core.store import query_options

    cfg = query_options(cfg, query)
    return HttpStore(cfg, store_id, cfg.uri)
