"""http:// specifics: bearer tokens, a dead producer, truncated and resumed bodies, server
errors, bind rules. (The shared contract is in test_store_api.py; W3' end to end in
test_http_pipeline.py.)"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch
from specbus.core.config import StoreConfig
from specbus.core.errors import (
    ConfigError,
    FeatureMissing,
    IntegrityError,
    StoreDenied,
    StoreUnavailable,
)
from specbus.core.store import open_store
from specbus.core.store.http import LAYOUT_HEADER, layout_of
from specbus.producers.feature_server import serve_store


@pytest.fixture
def served(store_id):
    s = serve_store(StoreConfig(uri=f"http://127.0.0.1:0/{store_id}", http={"token": "s3cret"}))
    yield s
    s.close()


def _client(uri: str, token: str | None = "s3cret", **kw):
    return open_store(StoreConfig(uri=uri, http={"token": token, "read_timeout_s": 5}, **kw))


def test_the_bearer_token_is_required_and_checked(served):
    specs = served.put("a", {"x": torch.arange(10.0)})  # the producer's own put (local)
    good = _client(served.uri)
    assert torch.equal(good.get(specs)["x"], torch.arange(10.0))
    for token in ("wrong", None):
        with pytest.raises(StoreDenied, match="bearer token"):
            _client(served.uri, token).get(specs)
    with pytest.raises(StoreDenied):
        _client(served.uri, "wrong").release(specs)
    assert served.usage().num_samples == 1  # nothing was released by the refused client


def test_unknown_keys_and_a_dead_producer_are_missing(served):
    specs = served.put("a", {"x": torch.arange(10.0), "ids": torch.arange(3)})
    client = _client(served.uri)
    other = {"x": specs["x"].model_copy(update={"key": specs["x"].key.replace("/a/", "/zz/")})}
    with pytest.raises(FeatureMissing) as e:
        client.get(other)
    assert e.value.key == other["x"].key
    gone = {"y": specs["x"].model_copy(update={"key": specs["x"].key[:-1] + "y", "name": "y"})}
    with pytest.raises(FeatureMissing):
        client.get(gone)  # a tensor the sample does not have
    served.close()  # the producer dies: its features went with it (recapture)
    with pytest.raises(FeatureMissing, match="cannot be reached"):
        client.get(specs)
    client.release(specs)  # nothing to free, no error


def test_a_cut_transfer_resumes_with_a_range_request(served):
    t = torch.randn(1 << 20)  # 4 MiB
    specs = served.put("big", {"x": t})
    fake = CuttingProxy(served.uri, cut_first_at=1 << 20)
    try:
        got = _client(fake.uri).get(specs)
        assert torch.equal(got["x"], t)
        assert fake.ranges == [None, f"bytes={1 << 20}-"]  # resumed where it was cut
    finally:
        fake.stop()


def test_a_body_cut_twice_or_short_is_an_integrity_error(served):
    specs = served.put("big", {"x": torch.randn(1 << 18)})  # 1 MiB
    cut = CuttingProxy(served.uri, cut_first_at=1000, cut_every=True)
    short = CuttingProxy(served.uri, short_by=8)
    try:
        with pytest.raises(IntegrityError, match="cut at .* twice"):
            _client(cut.uri).get(specs)
        with pytest.raises(IntegrityError, match="short read"):
            _client(short.uri).get(specs)
    finally:
        cut.stop()
        short.stop()


def test_a_layout_that_differs_from_the_spec_is_an_integrity_error(served):
    specs = served.put("a", {"x": torch.arange(12.0)})
    wrong = {"x": specs["x"].model_copy(update={"shape": (3, 4)})}
    with pytest.raises(IntegrityError, match="spec says"):
        _client(served.uri).get(wrong)


def test_server_errors_are_unavailable(served):
    specs = served.put("a", {"x": torch.arange(12.0)})
    failing = CuttingProxy(served.uri, status=503)
    try:
        with pytest.raises(StoreUnavailable, match="503"):
            _client(failing.uri).get(specs)
    finally:
        failing.stop()


def test_serving_beyond_loopback_needs_a_token(store_id, monkeypatch):
    monkeypatch.delenv("SPECBUS_STORE_TOKEN", raising=False)
    with pytest.raises(ConfigError, match="bearer token"):
        serve_store(StoreConfig(uri=f"http://0.0.0.0:0/{store_id}"))
    monkeypatch.setenv("SPECBUS_STORE_TOKEN", "from-env")
    s = serve_store(
        StoreConfig(uri=f"http://0.0.0.0:0/{store_id}", http={"advertise": "127.0.0.1"})
    )
    try:
        specs = s.put("a", {"x": torch.ones(3)})
        assert s.uri.startswith("http://127.0.0.1:")
        assert torch.equal(_client(s.uri, None).get(specs)["x"], torch.ones(3))  # env token
    finally:
        s.close()


class CuttingProxy:
    """A raw HTTP/1.1 front for a feature server that misbehaves on purpose: cuts a body
    after `cut_first_at` bytes (once, or every time), announces `short_by` bytes fewer
    than the body, or answers `status`. Records each request's Range header."""

    def __init__(self, upstream: str, *, cut_first_at=None, cut_every=False, short_by=0, status=0):
        self.upstream = upstream
        self.cut_first_at, self.cut_every, self.short_by, self.status = (
            cut_first_at, cut_every, short_by, status,
        )  # fmt: skip
        self.ranges: list[str | None] = []
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        self._thread.start()
        started.wait(10)
        store_id = upstream.rsplit("/", 1)[1]
        self.uri = f"http://127.0.0.1:{self.port}/{store_id}"

    def _run(self, started) -> None:
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(
            asyncio.start_server(self._serve, "127.0.0.1", 0)
        )
        self.port = self.server.sockets[0].getsockname()[1]
        started.set()
        self.loop.run_forever()

    async def _serve(self, reader, writer) -> None:
        import aiohttp

        head = (await reader.readuntil(b"\r\n\r\n")).decode()
        line, *rest = head.split("\r\n")
        headers = dict(h.split(": ", 1) for h in rest if h)
        path = line.split()[1]
        self.ranges.append(headers.get("Range"))
        if self.status:
            writer.write(
                f"HTTP/1.1 {self.status} Unavailable\r\nContent-Length: 0\r\n\r\n".encode()
            )
            await writer.drain()
            writer.close()
            return
        base = self.upstream.rsplit("/", 1)[0]
        fwd = {k: v for k, v in headers.items() if k in ("Authorization", "Range")}
        async with aiohttp.ClientSession() as s, s.get(base + path, headers=fwd) as resp:
            body = await resp.read()
            layout = resp.headers.get(LAYOUT_HEADER, layout_of([]))
            status = resp.status
        first = len(self.ranges) == 1
        cut = self.cut_first_at if (first or self.cut_every) else None
        length = len(body) - self.short_by
        writer.write(
            f"HTTP/1.1 {status} OK\r\nContent-Length: {length}\r\n{LAYOUT_HEADER}: {layout}\r\n"
            "Content-Type: application/octet-stream\r\n\r\n".encode()
        )
        writer.write(body[:cut] if cut is not None else body[:length])
        await writer.drain()
        writer.close()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


def test_the_producer_releases_what_the_trainers_acked(served, nats_server, run_id, bus_cfg):
    """What a killed trainer never released is released by the producer: its samples whose
    refs lie at or below the trainers' ack floor on SAMPLES go, the others stay."""
    from specbus.bus.lease import Leases
    from specbus.bus.publisher import Publisher
    from specbus.core.contracts import SampleRef

    from tests.fixtures.nats import make_ref, open_run

    async def scenario():
        bus, topo = await open_run(nats_server.url, bus_cfg, run_id)
        try:
            publisher = Publisher(bus)
            for i in range(6):
                specs = served.put(f"s{i}", {"hidden_states": torch.ones(4)})
                ref = make_ref(run_id, i, nbytes=16)
                ref = SampleRef.model_validate(
                    {**ref.model_dump(), "store_uri": served.uri, "features": specs}
                )
                await publisher.publish(topo.names.samples, ref)
            group = await Leases.join(bus, run_id, "trainers")
            leases = await group.fetch(4, 5.0)
            assert [lease.seq for lease in leases] == [1, 2, 3, 4]
            await group.ack_all(leases)  # trained, then the trainer died before its DELETEs
            sweeper = asyncio.create_task(served.release_acked(topo, every_s=0.1))
            deadline = time.monotonic() + 20
            while len(served.stored()) > 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            sweeper.cancel()
            await group.close()
        finally:
            await bus.close()

    asyncio.run(scenario())
    assert sorted(served.stored()) == [("s4", 0), ("s5", 0)]
    assert served.usage().num_samples == 2
