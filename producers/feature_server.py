"""A producer's feature server (W3'): its captures, served over HTTP to the trainers.

With `store.uri: http://HOST:PORT` (a bind address; port 0 picks a free one) `specbus
produce` keeps its captures in a local store (`store.http.local`, `mem://` by default) and
serves them on HOST:PORT; its refs name `http://<store.http.advertise or HOST>:<port>/<id>`,
read by `core.store.http.HttpStore`. Loopback unless a bearer token is set. The local store's
budget is the producer's residency; trainers DELETE after their ack, and the producer releases
what the trainers' ack floor passed (`ServedStore.release_acked`: what a killed trainer left).
A producer that dies takes its features with it (trainers recapture). docs/store.md, "http://".
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import socket
import threading
import urllib.parse
from collections.abc import Callable, Iterable, Mapping

import torch
from specbus.bus.run import RunBus
from specbus.bus.subjects import TRAINERS
from specbus.core.config import StoreConfig
from specbus.core.contracts import FeatureSpec, SampleRef
from specbus.core.errors import (
    ConfigError,
    FeatureMissing,
    IntegrityError,
    RecordError,
    StoreFull,
    StoreNoSpace,
)
from specbus.core.store import open_store, stfile
from specbus.core.store.base import RefLike, StoreUsage, byte_view, sample_of, specs_of
from specbus.core.store.http import CHUNK, LAYOUT_HEADER, layout_of, resolve_token

log = logging.getLogger("specbus.producer")


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


class ServedStore:
    """The producer's store: puts and reads go to its local store, which the feature server
    serves; `uri` is the served URL the refs carry."""

    def __init__(self, local, store_id: str):
        self.local, self.store_id = local, store_id
        self.uri = ""  # set once the server listens
        self.server: FeatureServer | None = None
        self._index: dict[tuple[str, int], dict[str, FeatureSpec]] = {}
        self._lock = threading.Lock()

    # -- the index of what is served ---------------------------------------------------------
    def lookup(self, sample_id: str, gen: int) -> dict[str, FeatureSpec] | None:
        """The store id and sample of a served key, for the server's handlers."""
        with self._lock:
            return self._index.get((sample_id, gen))

    def stored(self) -> list[tuple[str, int]]:
        """The (sample id, generation) pairs held now."""
        with self._lock:
            return list(self._index)

    def _forget(self, keys: Iterable[tuple[str, int]]) -> None:
        with self._lock:
            for k in keys:
                self._index.pop(k, None)

    def _prune(self) -> None:
        """Forget what the local store no longer holds (after a sweep, gc or purge)."""
        present = {(s.sample_id, s.gen) for s in self.local._stored()}
        with self._lock:
            for k in [k for k in self._index if k not in present]:
                del self._index[k]

    # -- FeatureStore ------------------------------------------------------------------------
    def put(
        self, sample_id: str, tensors: Mapping[str, torch.Tensor], gen: int = 0
    ) -> dict[str, FeatureSpec]:
        """Put into the local store (see `FeatureStore.put`); refs name this server's URL."""
        specs = self.local.put(sample_id, tensors, gen)
        with self._lock:
            for k in [k for k in self._index if k[0] == sample_id and k[1] < gen]:
                del self._index[k]  # superseded (the local store removed them)
            self._index[(sample_id, gen)] = specs
        return specs

    def get(self, ref: RefLike, names=None, device=None) -> dict[str, torch.Tensor]:
        """Read from the local store (see `FeatureStore.get`)."""
        return self.local.get(ref, names, device)

    def release(self, ref: RefLike) -> None:
        """Release a served ref (see `FeatureStore.release`)."""
        key = sample_of(specs_of(ref), self.store_id)
        self.local.release(ref)
        self._forget([key])

    def release_sample(self, sample_id: str, gen: int) -> int:
        """Release one generation of a sample by id; returns the bytes freed."""
        specs = self.lookup(sample_id, gen)
        if specs is None:
            return 0
        self.local.release(specs)
        self._forget([(sample_id, gen)])
        return sum(s.nbytes for s in specs.values())

    def adopt(self, ref: RefLike) -> None:
        """Verify a served sample (see `FeatureStore.adopt`)."""
        self.local.adopt(ref)
        specs = specs_of(ref)
        with self._lock:
            self._index[sample_of(specs, self.store_id)] = specs

    def gc(self, live: Iterable[str] | None = None, *, min_age_s: float | None = None) -> int:
        """The local store's gc (see `FeatureStore.gc`)."""
        freed = self.local.gc(live, min_age_s=min_age_s)
        self._prune()
        return freed

    def sweep(self, done: Callable[[str], bool], *, timeout_s: float | None = None) -> int:
        """The local store's sweep (see `FeatureStore.sweep`)."""
        freed = self.local.sweep(done, timeout_s=timeout_s)
        self._prune()
        return freed

    def purge(self) -> int:
        """The local store's purge (see `FeatureStore.purge`)."""
        freed = self.local.purge()
        self._prune()
        return freed

    def usage(self) -> StoreUsage:
        """The local store's usage: the producer's residency (its backpressure reads it)."""
        return self.local.usage()

    def alloc(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The local store's alloc."""
        return self.local.alloc(shape, dtype)

    def close(self, timeout_s: float | None = None) -> None:
        """Stop the server, then close the local store."""
        if self.server is not None:
            self.server.stop()
        self.local.close(timeout_s)

    # -- what the trainers acked ---------------------------------------------------------------
    async def release_acked(self, run: RunBus, every_s: float) -> None:
        """Forever: release this producer's samples whose refs are at or below the trainers'
        ack floor on SAMPLES (see module doc). Bus errors are logged and retried."""
        swept = 0
        while True:
            await asyncio.sleep(every_s)
            try:
                floor = await run.ack_floor(TRAINERS)
                if floor <= swept or not self.stored():
                    swept = max(swept, floor)
                    continue
                freed = 0
                async for stored in run.replay(TRAINERS, swept + 1, end_seq=floor):
                    try:
                        ref = SampleRef.from_bytes(stored.data)
                    except RecordError:
                        continue
                    if ref.store_uri == self.uri:
                        freed += await asyncio.to_thread(
                            self.release_sample, ref.sample_id, ref.generation
                        )
                swept = floor
                if freed:
                    log.info("released %d bytes the trainers acked (SAMPLES <= %d)", freed, floor)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - a broker outage: try again next round
                log.debug("ack-floor release skipped: %s", e)


class FeatureServer:
    """An aiohttp server on its own thread and event loop serving one `ServedStore`."""

    def __init__(self, served: ServedStore, host: str, port: int, token: str | None, max_body: int):
        self.served, self.host, self.port, self.token = served, host, port, token
        self.max_body = max_body
        self.loop = asyncio.new_event_loop()
        self._thread: threading.Thread | None = None
        self._runner = None
        self.requests = 0

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> int:
        """Listen; returns the port (the chosen one for port 0)."""
        ready: asyncio.Future = self.loop.create_future()
        self._thread = threading.Thread(
            target=self._run, args=(ready,), name="specbus-feature-server", daemon=True
        )
        self._thread.start()
        return asyncio.run_coroutine_threadsafe(self._wait(ready), self.loop).result(30)

    async def _wait(self, ready):
        return await ready

    def _run(self, ready) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._listen(ready))
        self.loop.run_forever()

    async def _listen(self, ready) -> None:
        from aiohttp import web

        app = web.Application(client_max_size=self.max_body, middlewares=[self._auth])
        prefix = f"/{self.served.store_id}"
        sample = prefix + "/samples/{sid}/g{gen}"
        app.router.add_get(sample, self._get, allow_head=False)
        app.router.add_route("HEAD", sample, self._head)
        app.router.add_delete(sample, self._delete)
        app.router.add_put(sample, self._put)
        app.router.add_get(prefix + "/usage", self._usage)
        app.router.add_get(prefix + "/stored", self._stored)
        app.router.add_post(prefix + "/drop", self._drop)
        app.router.add_post(prefix + "/gc", self._gc)
        app.router.add_post(prefix + "/purge", self._purge)
        app.router.add_get(prefix + "/health", self._health)
        self._runner = web.AppRunner(app, access_log=None)
        try:
            await self._runner.setup()
            site = web.TCPSite(self._runner, self.host, self.port, reuse_address=True)
            await site.start()
            port = site._server.sockets[0].getsockname()[1]  # the chosen one for port 0
        except BaseException as e:
            ready.set_exception(e)
            return
        ready.set_result(port)

    def stop(self) -> None:
        """Stop serving and join the server's thread."""
        if self._thread is None or not self.loop.is_running():
            return

        async def down():
            if self._runner is not None:
                await self._runner.cleanup()

        try:
            asyncio.run_coroutine_threadsafe(down(), self.loop).result(10)
        except Exception as e:  # noqa: BLE001 - stopping anyway
            log.warning("feature server shutdown: %s", e)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)

    # -- handlers ------------------------------------------------------------------------------
    @staticmethod
    def _error(status: int, kind: str, message: str):
        from aiohttp import web

        return web.json_response({"error": kind, "message": message}, status=status)

    async def _auth_check(self, request):
        if self.token is None:
            return None
        got = request.headers.get("Authorization", "")
        if not hmac.compare_digest(got.encode(), f"Bearer {self.token}".encode()):
            return self._error(401, "denied", "missing or wrong bearer token")
        return None

    @property
    def _auth(self):
        from aiohttp import web

        @web.middleware
        async def auth(request, handler):
            self.requests += 1
            denied = await self._auth_check(request)
            return denied if denied is not None else await handler(request)

        return auth

    def _target(self, request):
        sid = urllib.parse.unquote(request.match_info["sid"])
        try:
            gen = int(request.match_info["gen"])
        except ValueError:
            return sid, -1, None
        return sid, gen, self.served.lookup(sid, gen)

    def _select(self, request, specs: dict[str, FeatureSpec]):
        names = [n for n in request.query.get("names", "").split(",") if n] or list(specs)
        missing = [n for n in names if n not in specs]
        return names, missing

    async def _tensors(self, request):
        """(names, specs, tensors) of a GET/HEAD, or an error response."""
        sid, gen, specs = self._target(request)
        if specs is None:
            return self._error(404, "missing", f"sample {sid!r} g{gen} is not here")
        names, missing = self._select(request, specs)
        if missing:
            return self._error(404, "missing", f"sample {sid!r} g{gen} has no {missing}")
        wanted = {n: specs[n] for n in names}
        try:
            if self.served.local.uri.startswith("mem://"):  # in memory: no I/O to wait for
                tensors = self.served.local.get(wanted)
            else:  # shm://, file://: a read, off the server's loop
                tensors = await asyncio.to_thread(self.served.local.get, wanted)
        except FeatureMissing as e:
            return self._error(404, "missing", str(e))
        except IntegrityError as e:
            return self._error(422, "integrity", str(e))
        return names, specs, tensors

    def _layout(self, names, specs) -> str:
        return layout_of((n, specs[n].dtype, tuple(specs[n].shape), specs[n].nbytes) for n in names)

    async def _head(self, request):
        from aiohttp import web

        got = await self._tensors(request)
        if isinstance(got, web.StreamResponse):
            return got
        names, specs, _ = got
        return web.Response(headers={LAYOUT_HEADER: self._layout(names, specs)})

    async def _get(self, request):
        from aiohttp import web

        got = await self._tensors(request)
        if isinstance(got, web.StreamResponse):
            return got
        names, specs, tensors = got
        total = sum(specs[n].nbytes for n in names)
        start, stop = 0, total
        status = 200
        headers = {
            LAYOUT_HEADER: self._layout(names, specs),
            "Content-Type": "application/octet-stream",
            "Accept-Ranges": "bytes",
        }
        rng = request.headers.get("Range")
        if rng:
            try:
                unit, _, spec = rng.partition("=")
                a, _, b = spec.partition("-")
                start, stop = int(a), (int(b) + 1 if b else total)
                if unit.strip() != "bytes" or not 0 <= start < stop <= total:
                    raise ValueError
            except ValueError:
                return web.Response(status=416, headers={"Content-Range": f"bytes */{total}"})
            status = 206
            headers["Content-Range"] = f"bytes {start}-{stop - 1}/{total}"
        headers["Content-Length"] = str(stop - start)
        resp = web.StreamResponse(status=status, headers=headers)
        await resp.prepare(request)
        at = 0
        for name in names:
            t = tensors[name]
            n = t.numel() * t.element_size()
            lo, hi = max(start - at, 0), min(stop - at, n)
            if lo < hi:
                mv = memoryview(byte_view(t.detach().cpu().contiguous()).numpy()).cast("B")
                for i in range(lo, hi, CHUNK):
                    await resp.write(mv[i : min(i + CHUNK, hi)])
            at += n
        await resp.write_eof()
        return resp

    async def _delete(self, request):
        from aiohttp import web

        sid, gen, specs = self._target(request)
        if specs is not None:
            await asyncio.to_thread(self.served.release_sample, sid, gen)
        return web.Response(status=204)

    async def _put(self, request):
        from aiohttp import web

        sid = urllib.parse.unquote(request.match_info["sid"])
        try:
            gen = int(request.match_info["gen"])
        except ValueError:
            return self._error(400, "bad_request", "generation must be an int")
        n = request.content_length
        if n is None or n > self.max_body:
            return self._error(
                400, "bad_request", f"a put needs a Content-Length <= {self.max_body}"
            )
        buf = bytearray(n)
        mv, at = memoryview(buf), 0
        async for chunk in request.content.iter_any():
            if at + len(chunk) > n:
                return self._error(400, "bad_request", "body longer than its Content-Length")
            mv[at : at + len(chunk)] = chunk
            at += len(chunk)
        if at != n:
            return self._error(400, "bad_request", f"body of {at} bytes, Content-Length {n}")
        try:
            entries, _, data = stfile.parse_header(
                bytes(buf[: min(n, 8 + stfile.MAX_HEADER_BYTES)]), n
            )
            tensors = {name: stfile.view(buf, e, data) for name, e in entries.items()}
            specs = await asyncio.to_thread(self.served.put, sid, tensors, gen)
        except StoreNoSpace as e:
            return self._error(507, "no_space", f"no space: {e}")
        except StoreFull as e:
            return self._error(507, "full", str(e))
        except IntegrityError as e:
            return self._error(422, "integrity", str(e))
        except (ValueError, TypeError) as e:
            return self._error(400, "bad_request", str(e))
        return web.json_response({k: s.model_dump(mode="json") for k, s in specs.items()})

    async def _usage(self, request):
        from aiohttp import web

        u = await asyncio.to_thread(self.served.usage)
        return web.json_response(u.__dict__)

    async def _stored(self, request):
        from aiohttp import web

        return web.json_response({"stored": [list(k) for k in self.served.stored()]})

    async def _drop(self, request):
        from aiohttp import web

        body = await request.json()
        freed = 0
        for sid, gen in body.get("samples", []):
            freed += await asyncio.to_thread(self.served.release_sample, sid, int(gen))
        return web.json_response({"freed": freed})

    async def _gc(self, request):
        from aiohttp import web

        body = await request.json()
        live = body.get("live")
        freed = await asyncio.to_thread(
            lambda: self.served.gc(live, min_age_s=body.get("min_age_s"))
        )
        return web.json_response({"freed": freed})

    async def _purge(self, request):
        from aiohttp import web

        return web.json_response({"freed": await asyncio.to_thread(self.served.purge)})

    async def _health(self, request):
        from aiohttp import web

        return web.json_response({"ok": True, "store": self.served.uri})


def serve_store(cfg: StoreConfig) -> ServedStore:
    """The producer's store for `store.uri: http://HOST:PORT[/store_id]`: the local store
    (`store.http.local`) behind a feature server listening on HOST:PORT (see module doc)."""
    parts = urllib.parse.urlsplit(cfg.uri)
    if parts.scheme != "http" or not parts.hostname:
        raise ConfigError(f"store.uri {cfg.uri!r}: a feature server binds http://HOST:PORT")
    host, port = parts.hostname, parts.port or 0
    store_id = parts.path.strip("/") or cfg.store_id or "default"
    token = resolve_token(cfg)
    if token is None and not _loopback(host):
        raise ConfigError(
            f"store.uri {cfg.uri!r}: serving features beyond loopback needs a bearer token "
            "(store.http.token or $SPECBUS_STORE_TOKEN)"
        )
    if not cfg.http.local.startswith(("mem://", "shm://", "file://")):
        raise ConfigError(f"store.http.local {cfg.http.local!r}: mem://, shm:// or file://")
    local = open_store(cfg.model_copy(update={"uri": cfg.http.local}), store_id=store_id)
    served = ServedStore(local, store_id)
    server = FeatureServer(served, host, port, token, max_body=cfg.budget_bytes + (1 << 20))
    try:
        port = server.start()
    except BaseException:
        local.close()
        raise
    served.server = server
    served.uri = f"http://{cfg.http.advertise or host}:{port}/{store_id}"
    log.info("serving features at %s (%s behind it)", served.uri, local.uri)
    return served


def is_served(cfg: StoreConfig) -> bool:
    """Whether a producer with this store config serves its features (http://)."""
    return cfg.uri.startswith("http://")
