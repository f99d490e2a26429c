"""The live intake and the capture sink over real HTTP, against a real broker and a real store.

The intake runs in-process (uvicorn in a thread, its own broker connection) on a loopback port;
records come from a real `CaptureSink` or are built from tensors really put into the shm store.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import torch
from specbus.bus.connection import connect
from specbus.bus.lease import Leases
from specbus.bus.subjects import Names
from specbus.core.config import BusConfig
from specbus.producers.live.sink import Capture, CaptureSink
from specbus.producers.live.wire import (
    CONFIG_PATH,
    RECORDS_PATH,
    CaptureRecord,
    capture_decision,
    sample_id_of,
)

from tests.fixtures.live import (
    live_config,
    start_intake_thread,
    wait_until,
    write_chats,
)

TOKEN = "test-token"


@pytest.fixture
def live(tmp_path, chat_target, nats_server, run_id):
    """(cfg, store, capture config) of a fresh live run; `make_intake(**live_overrides)`."""
    made = []

    def make(**live):
        overrides = [f"live.{k}={v}" for k, v in live.items()]
        cfg, store, cap, intake = start_intake_thread(run_id, tmp_path, chat_target,
                                                      nats_server.url, TOKEN, overrides)  # fmt: skip
        made.append((intake, store))
        return cfg, store, cap, intake

    yield make
    for intake, store in made:
        intake.stop()
        store.close()


def samples_in_stream(url: str, run: str) -> int:
    async def go():
        async with await connect(BusConfig(), url) as bus:
            info = await bus.js.stream_info(Names(run).samples_stream)
            return info.state.messages

    return asyncio.run(go())


def lease_refs(url: str, run: str, n: int):
    async def go():
        async with await connect(BusConfig(), url) as bus:
            group = await Leases.join(bus, run, "trainers")
            leases = await group.fetch(n, 2.0)
            records = [lease.record for lease in leases]
            await group.close(nak_held=True)
            return records

    return asyncio.run(go())


def put_capture(store, cap, request_id: str, prompt: int = 5, generated: int = 6):
    """Tensors of one capture really put into the store, and its record (as a sink sends it)."""
    rows = prompt + generated
    g = torch.Generator().manual_seed(len(request_id))
    by_source = {
        "input_ids": torch.randint(4, 100, (rows,), generator=g),
        "loss_mask": torch.cat([torch.zeros(prompt), torch.ones(generated)]).long(),
        "aux": torch.randn(rows, len(cap.aux_layers) * cap.hidden_size, generator=g),
        "final": torch.randn(rows, cap.hidden_size, generator=g),
    }
    tensors = {d.name: by_source[d.source] for d in cap.features}
    sample_id = sample_id_of(request_id)
    specs = store.put(sample_id, tensors, 0)
    record = CaptureRecord(
        run_id=cap.run_id, request_id=request_id, sample_id=sample_id, store_uri=cap.store_uri,
        features=specs, num_tokens=rows, num_prompt_tokens=prompt,
        target_fingerprint=cap.target_fingerprint, tokenizer_fingerprint=cap.tokenizer_fingerprint,
        server_id="test", engine="hf",
    )  # fmt: skip
    return record, specs


def test_handshake_describes_the_capture_and_needs_the_token(live):
    cfg, store, cap, intake = live(sample_rate=0.25, min_num_tokens=3)
    with intake.client() as c:
        got = c.get(CONFIG_PATH)
    assert got.status_code == 200
    doc = got.json()
    assert doc["schema_version"] == 1 and doc["run_id"] == cfg.run
    assert doc["store_uri"] == store.uri and doc["store_budget_bytes"] == cfg.store.budget_bytes
    assert [f["name"] for f in doc["features"]] == [
        "input_ids",
        "loss_mask",
        "hidden_states",
        "target",
    ]
    assert [f["source"] for f in doc["features"]] == ["input_ids", "loss_mask", "aux", "final"]
    assert doc["features"][2]["shape"] == ["L", 3 * 32] and doc["dtype"] == "float32"
    assert doc["aux_layers"] == [1, 1, 0] and doc["hidden_size"] == 32
    assert (doc["sample_rate"], doc["min_num_tokens"], doc["max_num_tokens"]) == (0.25, 3, 128)
    assert doc["loss_mask"] == "generated"
    for token in ("", "wrong"):
        with intake.client(token=token) as c:
            for answer in (
                c.get(CONFIG_PATH),
                c.post(RECORDS_PATH, content=b"{}"),
                c.get("/metrics"),
            ):
                assert answer.status_code == 401
                assert answer.headers["www-authenticate"] == "Bearer"
                assert answer.json()["reason"] == "unauthenticated"
    with intake.client() as c:
        metrics = c.get("/metrics").text
    assert 'specbus_intake_records_total{code="401",reason="unauthenticated"} 6' in metrics
    assert samples_in_stream(intake.bus_url, cfg.run) == 0


def test_a_record_becomes_one_sampleref_and_a_reposted_one_is_a_duplicate(live):
    cfg, store, cap, intake = live()
    record, specs = put_capture(store, cap, "req-1")
    body = record.model_dump_json().encode()
    with intake.client() as c:
        first = c.post(RECORDS_PATH, content=body)
        again = c.post(RECORDS_PATH, content=body)
    assert first.status_code == 200 and first.json()["status"] == "accepted"
    assert again.status_code == 200 and again.json()["status"] == "duplicate"
    assert again.json()["seq"] == first.json()["seq"]
    assert samples_in_stream(intake.bus_url, cfg.run) == 1
    (ref,) = lease_refs(intake.bus_url, cfg.run, 4)
    assert ref.sample_id == sample_id_of("req-1") and ref.task_id == "live:req-1"
    assert ref.store_uri == store.uri and ref.strategy == "eagle3"
    assert ref.features == specs and ref.nbytes == sum(s.nbytes for s in specs.values())
    assert ref.num_tokens == 11 and ref.generation == 0
    assert ref.provenance.producer_id == "test" and ref.provenance.engine == "hf"
    assert store.get(ref)["loss_mask"].tolist() == [0] * 5 + [1] * 6


def _mutate(record: CaptureRecord, store, cap) -> dict:
    """Bad records: name -> (body bytes, expected status, expected reason)."""
    good = json.loads(record.model_dump_json())

    def with_(**changes) -> bytes:
        return json.dumps({**good, **changes}).encode()

    features = good["features"]
    bad_shape = {**features, "target": {**features["target"], "shape": [11, 31]}}
    bad_dtype = {**features, "target": {**features["target"], "dtype": "bfloat16"}}
    bad_bytes = {**features, "target": {**features["target"], "nbytes": 4}}
    foreign = {**features, "target": {**features["target"],
                                      "key": features["target"]["key"].replace(record.sample_id, "live-other")}}  # fmt: skip
    missing = {k: v for k, v in features.items() if k != "target"}
    ghost, _ = put_capture(store, cap, "ghost")
    store.release(ghost.features)  # its keys are gone
    return {
        "garbage": (b"\x00not json", 400, "garbage"),
        "not an object": (b"[1, 2]", 400, "garbage"),
        "newer schema": (with_(schema_version=2), 400, "schema"),
        "unknown field": (with_(tensor=[1.0, 2.0]), 422, "invalid"),
        "missing field": (json.dumps({k: v for k, v in good.items() if k != "run_id"}).encode(), 422, "invalid"),
        "oversize": (b"{" + b" " * (cap.max_record_bytes + 1) + b"}", 413, "oversize"),
        "wrong run": (with_(run_id="another"), 422, "wrong_run"),
        "wrong store": (with_(store_uri="shm://elsewhere"), 422, "wrong_store"),
        "fingerprint": (with_(target_fingerprint="other"), 422, "fingerprint"),
        "sample id": (with_(sample_id="live-0123"), 422, "sample_id"),
        "too short": (with_(num_prompt_tokens=10), 422, "too_short"),
        "too long": (with_(num_tokens=500), 422, "too_long"),
        "feature missing": (with_(features=missing), 422, "features"),
        "shape": (with_(features=bad_shape), 422, "features"),
        "dtype": (with_(features=bad_dtype), 422, "features"),
        "nbytes": (with_(features=bad_bytes), 422, "features"),
        "foreign key": (with_(features=foreign), 422, "features"),
        "keys not in store": (ghost.model_dump_json().encode(), 422, "missing_keys"),
    }  # fmt: skip


def test_bad_records_get_a_4xx_with_a_reason_and_nothing_is_published(live):
    cfg, store, cap, intake = live()
    record, _ = put_capture(store, cap, "req-good")
    cases = _mutate(record, store, cap)
    with intake.client() as c:
        for name, (body, code, reason) in cases.items():
            answer = c.post(RECORDS_PATH, content=body)
            assert (answer.status_code, answer.json()["reason"]) == (code, reason), name
            assert answer.json()["status"] == "rejected" and answer.json()["detail"], name
        metrics = c.get("/metrics").text
    assert samples_in_stream(intake.bus_url, cfg.run) == 0
    for _, (_, code, reason) in cases.items():
        assert f'specbus_intake_records_total{{code="{code}",reason="{reason}"}}' in metrics


def _sink(intake, **kw) -> CaptureSink:
    sink = CaptureSink(intake.url, TOKEN, server_id="test-sink", engine="hf", **kw).start()
    wait_until(lambda: sink.config is not None, 30, "the sink's handshake")
    return sink


def _capture(cap, request_id: str, prompt: int, generated: int) -> Capture:
    rows = prompt + generated - 1
    # rows are fed in chunks (prefill, then one per decode step), as a server hands them over
    aux = [torch.randn(prompt, 3 * cap.hidden_size)] + [torch.randn(1, 3 * cap.hidden_size)
                                                        for _ in range(rows - prompt)]  # fmt: skip
    final = [torch.randn(prompt, cap.hidden_size)] + [torch.randn(1, cap.hidden_size)
                                                      for _ in range(rows - prompt)]  # fmt: skip
    return Capture(request_id=request_id, prompt_ids=list(range(4, 4 + prompt)),
                   output_ids=list(range(10, 10 + generated)), aux=aux, final=final)  # fmt: skip


def test_sink_sampling_is_deterministic_and_min_tokens_keeps_probes_out(live):
    cfg, store, cap, intake = live(sample_rate=0.3, min_num_tokens=2)
    sink, twin = _sink(intake), _sink(intake)  # two "TP ranks" of one server
    try:
        ids = [f"req-{i}" for i in range(2000)]
        picked = [sink.wants(i) for i in ids]
        assert picked == [twin.wants(i) for i in ids]  # every rank agrees
        assert picked == [sample_id_of(i) if capture_decision(i, 0.3) else None for i in ids]
        assert 0.25 < sum(p is not None for p in picked) / len(ids) < 0.35
        # generated 1 or 2 tokens: 0 or 1 supervised row (output[:-1]), under min_num_tokens
        assert not sink.submit(_capture(cap, "probe-1", 5, 1))
        assert not sink.submit(_capture(cap, "probe-2", 5, 2))
        assert sink.submit(_capture(cap, "real-3", 5, 3))
        wait_until(sink.idle, 30, "the sink's writer")
        assert sink.counts["too_short"] == 2 and sink.counts["accepted"] == 1
        (ref,) = lease_refs(intake.bus_url, cfg.run, 4)
        assert ref.sample_id == sample_id_of("real-3") and ref.num_tokens == 7  # 5 + 3 - 1
        tensors = store.get(ref)
        assert tensors["input_ids"].tolist() == [4, 5, 6, 7, 8, 10, 11]  # prompt + output[:-1]
        assert tensors["loss_mask"].tolist() == [0] * 5 + [1] * 2
        assert store.usage().num_samples == 1
    finally:
        sink.close()
        twin.close()


def test_shed_records_get_429_and_the_sink_removes_their_keys(live):
    cfg, store, cap, intake = live(max_lag_refs=3)  # no trainer consumes: the lag only grows
    sink = _sink(intake)
    try:
        for i in range(8):
            assert sink.submit(_capture(cap, f"req-{i}", 6, 5))
        wait_until(sink.idle, 60, "the sink's writer")
        # The lag allows 3; a record accepted while the shed inputs were being polled may be
        # counted twice (the intake's conservative rule, never zero times): 2 under load.
        accepted, shed = sink.counts["accepted"], sink.counts["shed"]
        assert accepted in (2, 3) and accepted + shed == 8
        assert sink.counts["keys_removed"] == shed
        with intake.client() as c:
            metrics = c.get("/metrics").text
        assert f'specbus_intake_records_total{{code="429",reason="trainers_lag"}} {shed}' in metrics
        refs = lease_refs(intake.bus_url, cfg.run, 10)
        assert len(refs) == accepted
        usage = store.usage()
        assert usage.num_samples == accepted
        assert usage.resident_bytes == sum(r.nbytes for r in refs)
    finally:
        sink.close()


def test_sink_drops_and_removes_keys_when_the_intake_is_unreachable(live, tmp_path):
    cfg, store, cap, intake = live()
    sink = _sink(intake)
    try:
        intake.stop()
        wait_until(lambda: _refused(intake.url), 15, "the intake to be gone")
        t0 = time.monotonic()
        for i in range(3):
            sink.submit(_capture(cap, f"req-{i}", 6, 5))
        wait_until(sink.idle, 60, "the sink's writer")
        assert time.monotonic() - t0 < 30
        assert sink.counts["unreachable"] == 3 and sink.counts["keys_removed"] == 3
        assert store.usage().num_samples == 0
        # a full queue drops at once, without blocking the caller
        blocked = CaptureSink(intake.url, TOKEN, server_id="t", engine="hf", queue_size=1)
        blocked.config = cap  # handshake known, writer never started: the queue stays full
        assert blocked.submit(_capture(cap, "q-1", 6, 5))
        t1 = time.perf_counter()
        assert not blocked.submit(_capture(cap, "q-2", 6, 5))
        assert time.perf_counter() - t1 < 0.05 and blocked.counts["queue_full"] == 1
    finally:
        sink.close()


def _refused(url: str) -> bool:
    import httpx

    try:
        httpx.get(url + "/healthz", timeout=0.5)
        return False
    except httpx.HTTPError:
        return True


@pytest.mark.slow
def test_an_intake_over_tls_refuses_plain_http_and_serves_the_sink(
    tmp_path, chat_target, nats_server, run_id
):
    """`specbus intake` with live.tls_cert/tls_key: HTTPS only (plain HTTP and a client that
    does not trust the CA get no answer), the token still required, and a sink given the CA
    (what `specbus serve` builds from live.tls_ca) handshakes."""
    import httpx
    from specbus.ops.live import trusting
    from specbus.ops.services.common import free_port
    from specbus.ops.tls import issue, make_ca

    from tests.fixtures.live import LiveRun

    ca = make_ca(tmp_path / "tls")
    cert = issue(ca, tmp_path / "tls", "intake")
    tls = [f"live.tls_cert={cert.cert}", f"live.tls_key={cert.key}", f"live.tls_ca={ca.cert}"]
    cfg = live_config(run_id, tmp_path / "run", chat_target, write_chats(tmp_path / "c.jsonl"),
                      store_uri=f"shm://{run_id}", overrides=tls)  # fmt: skip
    run = LiveRun(cfg, tmp_path / "procs", nats_server.url)
    sink = None
    try:
        port = free_port()
        proc = run.start("intake", "intake", "--port", str(port))
        url, trust = f"https://127.0.0.1:{port}", trusting(ca.cert)

        def ready():
            try:
                return httpx.get(url + "/healthz", verify=trust, timeout=1.0).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(ready, 120, "the intake over https", proc, run.log_path("intake"))
        ep = run.endpoint()
        assert ep["url"] == url
        with pytest.raises(httpx.HTTPError):  # plain HTTP to the TLS port: no HTTP answer
            httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5.0)
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.get(url + "/healthz", timeout=5.0)  # the system's CAs do not know ours
        assert httpx.get(url + CONFIG_PATH, verify=trust, timeout=5.0).status_code == 401
        sink = CaptureSink(url, ep["token"], server_id="tls-test", engine="hf", verify=trust)
        assert sink.handshake() and sink.config.run_id == cfg.run
    finally:
        if sink is not None:
            sink.close()
        run.stop()
