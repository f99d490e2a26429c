"""mooncake:// on a real mooncake_master + store node: processes, leases, short reads, faults."""

from __future__ import annotations

import gc
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import torch
from specbus.core.contracts import FeatureSpec
from specbus.core.errors import FeatureMissing, IntegrityError, StoreFull, StoreUnavailable
from specbus.core.store import open_store, purge_store
from specbus.ops.services.mooncake import MooncakeServices

from tests.fixtures.mooncake import CLIENT, FAST, mooncake_store_config

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.mooncake


def spawn(code: str) -> subprocess.Popen:
    prelude = "import torch; torch.set_num_threads(1)\nfrom core.store import open_store\n"
    return subprocess.Popen(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def read_specs(child: subprocess.Popen, n: int) -> dict[str, FeatureSpec]:
    specs = {}
    for _ in range(n):
        line = child.stdout.readline()
        if not line:
            child.kill()
            raise AssertionError(f"child died: {child.stderr.read()}")
        spec = FeatureSpec.model_validate_json(line)
        specs[spec.name] = spec
    return specs


def raw_client(services: MooncakeServices):
    """A plain Mooncake client, to tamper with objects behind the store's back."""
    from mooncake.store import MooncakeDistributedStore

    client = MooncakeDistributedStore()
    assert (
        client.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", services.master_address)
        == 0
    )
    return client


def wait_until(check, timeout_s: float, what: str) -> float:
    t0 = time.monotonic()
    while not check():
        assert time.monotonic() - t0 < timeout_s, f"{what} not within {timeout_s}s"
        time.sleep(0.05)
    return time.monotonic() - t0


def test_master_binds_loopback_only(mooncake_services):
    listening = [
        c.laddr
        for c in psutil.Process(mooncake_services.master.pid).net_connections()
        if c.status == "LISTEN"
    ]
    assert listening and all(addr.ip == "127.0.0.1" for addr in listening), listening


def test_put_in_one_process_get_in_another(mooncake_services, store_id):
    here = open_store(mooncake_store_config(mooncake_services, store_id))
    child = spawn(f"""
        s = open_store({here.uri + "&buffer_bytes=" + str(32 << 20)!r})
        specs = s.put("x", {{"h": torch.arange(4096.0).reshape(64, 64).bfloat16(), "m": torch.arange(9) % 2 == 0}})
        for spec in specs.values():
            print(spec.model_dump_json(), flush=True)
        input()
    """)
    specs = read_specs(child, 2)
    got = here.get(specs)
    assert torch.equal(got["h"], torch.arange(4096.0).reshape(64, 64).bfloat16())
    assert torch.equal(got["m"], torch.arange(9) % 2 == 0)
    _, err = child.communicate("\n", timeout=60)  # the writer exits: its sample stays (node-owned)
    assert child.returncode == 0, err
    # Mooncake's own glog lines ("I1202 10:00:00.1 123 client_metric.cpp:102] ...") stay out
    # of the user's console (issue 34; core/store/mooncake_client.quiet_native_log)
    assert not re.search(r"^[IWEF]\d{4} |InitGoogleLogging", err, re.M), err
    assert torch.equal(here.get(specs)["h"], got["h"])
    here.release(specs)
    with pytest.raises(FeatureMissing):
        here.get(specs)
    here.close()


def test_short_or_long_object_is_an_integrity_error(mooncake_services, store_id):
    store = open_store(mooncake_store_config(mooncake_services, store_id))
    specs = store.put("x", {"h": torch.randn(1000)})
    key = specs["h"].key
    raw = raw_client(mooncake_services)
    buf = torch.zeros(8000, dtype=torch.uint8)
    for size in (1000, 8000):  # truncated, then larger than the spec
        assert raw.remove(key, True) == 0
        assert raw.put_from(key, buf.data_ptr(), size) == 0
        with pytest.raises(IntegrityError, match="short read" if size < 4000 else "larger"):
            store.get(specs)
    raw.remove(key, True)
    raw.close()
    store.close()


def test_release_under_a_read_lease_is_retried_until_gone(mooncake_services, store_id):
    store = open_store(mooncake_store_config(mooncake_services, store_id))
    specs = store.put("x", {"h": torch.randn(1 << 20)})
    store.get(specs)  # takes a 500 ms read lease: the first remove is refused (-706)
    store.release(specs)
    assert store.usage().pending_release_bytes == 4 << 20
    with pytest.raises(FeatureMissing, match="remove pending"):
        store.get(specs)
    took = wait_until(lambda: store.usage().num_samples == 0, 5, "the retried remove")
    assert store.usage().pending_release_bytes == 0 and took < 3
    store.close()


def test_release_is_forced_when_the_lease_outlives_the_retries(tmp_path, store_id):
    services = MooncakeServices(tmp_path, segment_bytes=64 << 20, lease_ttl_ms=60_000).start()
    try:
        cfg = mooncake_store_config(services, store_id)
        store = open_store(
            cfg.model_copy(
                update={"mooncake": cfg.mooncake.model_copy(update={"force_release_after_s": 1.0})}
            )
        )
        specs = store.put("x", {"h": torch.randn(1 << 20)})
        store.get(specs)  # a 60 s lease
        store.release(specs)
        took = wait_until(lambda: store.usage().num_samples == 0, 6, "the forced remove")
        assert 0.9 < took < 5
        assert store.usage().resident_bytes == 0
        store.close()
    finally:
        services.stop()


def test_store_node_killed_raises_feature_missing_fast_then_recovers(private_mooncake, store_id):
    store = open_store(mooncake_store_config(private_mooncake, store_id))
    specs = store.put("x", {"h": torch.randn(1 << 20)})
    private_mooncake.kill_node()
    t0 = time.monotonic()
    with pytest.raises(FeatureMissing, match=store_id):
        store.get(specs)
    assert time.monotonic() - t0 < 5
    # once the master drops the dead node's segment (client TTL 2 s), puts say why they fail
    wait_until(lambda: store.usage().capacity_bytes == 0, 10, "the master dropping the segment")
    with pytest.raises(StoreUnavailable, match="no store node"):
        store.put("y", {"h": torch.randn(10)})
    with pytest.raises(FeatureMissing):
        store.get(specs)
    private_mooncake.start_node()
    new = store.put("y", {"h": torch.arange(10.0)})
    assert torch.equal(store.get(new)["h"], torch.arange(10.0))
    store.close()


@pytest.mark.slow
def test_master_restart_gives_clear_errors_then_recovers(private_mooncake, store_id):
    store = open_store(mooncake_store_config(private_mooncake, store_id))
    specs = store.put("x", {"h": torch.randn(1 << 20)})
    private_mooncake.kill_master()
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailable, match="unreachable"):
        store.put("y", {"h": torch.randn(10)})
    with pytest.raises(StoreUnavailable, match="unreachable"):
        store.get(specs)
    assert time.monotonic() - t0 < 15  # bounded: Mooncake's RPC gives up after ~4 s
    private_mooncake.restart_master()
    with pytest.raises(FeatureMissing):  # the new master knows no objects: recapture
        store.get(specs)
    new = store.put("y", {"h": torch.arange(10.0)})
    assert torch.equal(store.get(new)["h"], torch.arange(10.0))
    store.close()


def test_killed_writer_leaks_nothing_after_gc(private_mooncake, store_id):
    store = open_store(mooncake_store_config(private_mooncake, store_id))
    assert store.usage().resident_bytes == 0
    child = spawn(f"""
        s = open_store({store.uri + "&buffer_bytes=" + str(48 << 20)!r})
        s.put("done", {{"h": torch.ones(1 << 20)}})
        print("ready", flush=True)
        s.put("busy", {{"h": torch.ones(8 << 20)}})
        print("busy", flush=True)
        while True:  # put until killed: the kill may land mid-put
            s.put("busy", {{"h": torch.ones(8 << 20)}})
    """)
    for line in ("ready", "busy"):  # a put done, then the put loop under way
        assert child.stdout.readline().strip() == line, child.stderr.read() if child.poll() else ""
    child.send_signal(signal.SIGKILL)
    child.wait(10)
    assert store.usage().resident_bytes > 0

    def reclaimed():
        store.gc(live=set(), min_age_s=0)  # nothing was published: nobody will consume
        return store.usage().resident_bytes == 0  # a half-done put is dropped by the master

    wait_until(reclaimed, 10, "resident bytes back to 0")
    assert store.usage().num_samples == 0
    store.close()


def test_rejected_puts_leave_no_bytes_resident(private_mooncake, store_id):
    # The screen runs beside the transfer (in-place TCP puts of 1 MiB and more) or before it
    # (small ones): either way a refused sample's objects are removed before put() raises,
    # on an idle cluster exactly: resident bytes back where they were, nothing pending. A
    # refused re-put of a sample leaves no value under its keys, neither old nor new.
    store = open_store(mooncake_store_config(private_mooncake, store_id))
    kept = store.put("kept", {"h": torch.randn(1 << 20)})
    before = store.usage()
    for n in (1000, 1 << 20, 4 << 20):
        bad = torch.randn(n).to(torch.bfloat16)
        bad[n // 3] = float("inf")
        with pytest.raises(IntegrityError, match=r"'bad'.*'x'.*1 NaN/Inf"):
            store.put("bad", {"ids": torch.arange(3), "x": bad})
        after = store.usage()
        assert (after.resident_bytes, after.num_samples) == (
            before.resident_bytes,
            before.num_samples,
        )
        assert after.pending_release_bytes == 0
    ok = store.put("again", {"x": torch.ones(1 << 20)})
    bad = torch.ones(1 << 20)
    bad[7] = float("nan")
    with pytest.raises(IntegrityError, match=r"'again'.*'x'"):
        store.put("again", {"x": bad})
    with pytest.raises(FeatureMissing):
        store.get(ok)
    assert store.usage().resident_bytes == before.resident_bytes
    store.release(kept)
    store.close()


def test_full_segment_is_store_full(tmp_path, store_id):
    services = MooncakeServices(tmp_path, segment_bytes=32 << 20, **FAST).start()
    try:
        store = open_store(mooncake_store_config(services, store_id))
        kept = [store.put(f"s{i}", {"h": torch.ones(2 << 20)}) for i in range(3)]  # 24 MiB
        with pytest.raises(StoreFull, match="full"):
            store.put("s3", {"h": torch.ones(4 << 20)})  # 16 MiB more
        store.release(kept[0])
        store.put("s3", {"h": torch.ones(1 << 20)})
        store.close()
    finally:
        services.stop()


def test_http_metadata_server_on_loopback(tmp_path, store_id):
    services = MooncakeServices(tmp_path, segment_bytes=32 << 20, metadata="http", **FAST).start()
    try:
        listening = [
            c.laddr
            for c in psutil.Process(services.metadata_server.pid).net_connections()
            if c.status == "LISTEN"
        ]
        assert listening and all(addr.ip == "127.0.0.1" for addr in listening), listening
        store = open_store(mooncake_store_config(services, store_id))
        assert "metadata=http" in store.uri
        specs = store.put("x", {"h": torch.arange(100)})
        assert torch.equal(store.get(specs)["h"], torch.arange(100))
        store.close()
    finally:
        services.stop()


def test_start_mooncake_for_specbus_up(tmp_path):
    from specbus.core.config import MooncakeConfig, StoreConfig
    from specbus.ops.services.mooncake import start_mooncake

    mc = MooncakeConfig(segment_bytes=32 << 20, buffer_bytes=16 << 20)
    cfg = StoreConfig(uri="mooncake://", store_id="run1", budget_bytes=64 << 20, mooncake=mc)
    services, store_cfg = start_mooncake(cfg, tmp_path)
    try:
        assert store_cfg.uri.startswith("mooncake://run1?master=127.0.0.1%3A")
        store = open_store(store_cfg)
        specs = store.put("x", {"h": torch.arange(8)})
        other = open_store(store.uri)  # the URI alone reaches the same store
        assert torch.equal(other.get(specs)["h"], torch.arange(8))
        assert store.usage().capacity_bytes == 32 << 20 and store.usage().budget_bytes == 64 << 20
        store.close()
        other.close()
    finally:
        services.stop()


def test_the_budget_is_the_segment_so_the_masters_refusal_is_exact(tmp_path, store_id):
    """`specbus store` sizes the node's segment to `store.budget_bytes` (issue 33): the
    master's own refusal bounds every writer, whatever each one's sampled count says. Two
    writers whose counts are stale (each sees only its own puts) put 24 MiB into a 16 MiB
    budget: the master refuses what does not fit (StoreFull), and nothing beyond the budget
    is ever resident. Before, the segment was 1 GiB and both counts let every put through."""
    from specbus.core.config import StoreConfig
    from specbus.ops.services.mooncake import start_mooncake

    budget = 16 << 20
    cfg = StoreConfig(uri=f"mooncake://{store_id}", budget_bytes=budget)
    services, store_cfg = start_mooncake(cfg, tmp_path, **FAST)
    try:
        stale = store_cfg.mooncake.model_copy(update={**CLIENT, "usage_refresh_s": 3600.0})
        writers = [open_store(store_cfg.model_copy(update={"mooncake": stale})) for _ in range(2)]
        assert writers[0].usage().capacity_bytes == budget
        refused = 0
        for i in range(12):
            for w, store in enumerate(writers):
                try:
                    store.put(f"w{w}-{i}", {"h": torch.ones(1 << 18)})  # 1 MiB
                except StoreFull as e:
                    assert "full (code -200)" in str(e)
                    refused += 1
                assert store.usage().resident_bytes <= budget
        assert refused >= 8  # 24 MiB offered, at most 16 taken
        for store in writers:
            store.purge()
            store.close()
    finally:
        services.stop()


def test_tcp_puts_send_caller_memory_and_unregister_it(mooncake_services, store_id):
    # Over TCP a put sends a tensor from its own memory, registered for that put only (no
    # staging copy); memory Mooncake will not register (overlapping another put's tensor) is
    # staged through the pool instead. Nothing stays registered, every byte round-trips.
    store = open_store(mooncake_store_config(mooncake_services, store_id))
    base = torch.randn(3 << 20)  # 12 MiB
    overlapping = {"a": base[: 2 << 20], "b": base[1 << 20 :]}  # second one: refused, staged
    specs = store.put("s", overlapping)
    got = store.get(specs)
    assert all(torch.equal(got[n], t) for n, t in overlapping.items())
    assert store._conn._held == {}
    bad = base.clone()
    bad[-1] = float("nan")
    with pytest.raises(IntegrityError, match=r"'bad'.*'x'"):
        store.put("bad", {"x": bad})  # screened beside the transfer, then removed
    with pytest.raises(FeatureMissing):
        store.get(
            {"x": specs["a"].model_copy(update={"key": specs["a"].key.replace("/s/", "/bad/")})}
        )
    assert store._conn._held == {}
    store.release(specs)
    store.close()


def test_staged_puts_screen_while_copying(mooncake_services, store_id):
    # Where memory cannot be sent in place (RDMA), tensors are staged through the registered
    # pool and screened chunk by chunk during that copy. Forced here on TCP.
    store = open_store(mooncake_store_config(mooncake_services, store_id))
    store._in_place = False
    x = torch.randn(3 << 20).to(torch.bfloat16)
    specs = store.put("ok", {"x": x, "ids": torch.arange(5)})
    assert torch.equal(store.get(specs)["x"], x)
    gc.collect()  # views of the shared pool that earlier tests left in cycles return now, not mid-test
    free = store._pool.free_bytes()
    x[12345] = float("inf")
    with pytest.raises(IntegrityError, match=r"'bad'.*'x'.*1 NaN/Inf"):
        store.put("bad", {"ids": torch.arange(5), "x": x})
    assert store._pool.free_bytes() == free  # the staging chunks went back to the pool
    store.release(specs)
    store.close()


# ---- releases that outlive their process (issue 12, defect 2) ---------------------------------

SAMPLE = 1048632  # bytes of the sample below: 1 MiB of float32 + 7 int64


def _with_client(cfg, **mc):
    return cfg.model_copy(update={"mooncake": cfg.mooncake.model_copy(update=mc)})


@pytest.fixture
def long_lease_mooncake(tmp_path):
    """Private services whose read lease (60 s) outlives any test: only a forced remove or
    the lease's owner could free a read object in time."""
    services = MooncakeServices(
        tmp_path / "mooncake", segment_bytes=64 << 20, **{**FAST, "lease_ttl_ms": 60_000}
    ).start()
    yield services
    services.stop()


def _trainer_killed_with_pending_releases(store) -> list[str]:
    """A child puts, reads and releases samples the way a trainer does (the reads' leases
    make Mooncake refuse every release, so they wait in the child's memory), puts one more it
    never trains, and is killed -9 before its retrier is due. Returns the trained ids."""
    trained = [f"t{i}" for i in range(8)]
    child = spawn(f"""
        import sys
        s = open_store({store.uri + "&buffer_bytes=" + str(16 << 20) + "&release_retry_s=60"!r})
        t = {{"h": torch.randn(1 << 18), "ids": torch.arange(7)}}
        for sid in {trained!r}:
            specs = s.put(sid, t)
            s.get(specs)  # takes the read lease
            s.release(specs)  # refused (-706): pending in this process only
        s.put("untrained", t)
        print(s.usage().pending_release_bytes, flush=True)
        sys.stdin.read()  # killed here
    """)
    line = child.stdout.readline()
    assert line.strip() == str(8 * SAMPLE), (
        child.stderr.read() if child.poll() is not None else line
    )
    child.send_signal(signal.SIGKILL)
    child.wait(10)
    return trained


def test_releases_a_killed_trainer_left_pending_are_swept_by_the_next(
    long_lease_mooncake, store_id
):
    # Regression, issue 12 defect 2: the releases died with the process; the samples are in
    # its checkpoint, so nothing would ever remove them. The next process's sweep with the
    # same record of trained samples does, leases overridden once force_release_after_s has
    # passed (the dead reader's lease would hold 60 s here), and leaves the rest.
    cfg = _with_client(
        mooncake_store_config(long_lease_mooncake, store_id), force_release_after_s=1.0
    )
    store = open_store(cfg)
    trained = _trainer_killed_with_pending_releases(store)
    leaked = store.usage()
    assert (leaked.num_samples, leaked.resident_bytes) == (9, 9 * SAMPLE)  # the fault landed
    assert store.sweep(set(trained).__contains__) == 8 * SAMPLE
    after = store.usage()
    assert (after.num_samples, after.resident_bytes) == (1, SAMPLE)
    assert after.pending_release_bytes == 0
    assert store.sweep(lambda _: True) == SAMPLE  # the end of the run: nothing is left
    assert store.usage().resident_bytes == 0  # bytes allocated at the master
    store.close()


def test_purge_store_removes_a_gone_runs_objects_at_once(long_lease_mooncake, store_id):
    # A run that is gone (its processes killed, leases still held): every object of its
    # store id goes at once, leases overridden; other store ids stay.
    cfg = mooncake_store_config(long_lease_mooncake, store_id)
    other = open_store(cfg, store_id=store_id + "-other")
    kept = other.put("kept", {"h": torch.ones(10)})
    store = open_store(cfg)
    _trainer_killed_with_pending_releases(store)
    assert purge_store(cfg) == 9 * SAMPLE
    assert store.usage().num_samples == 0
    store.close()
    assert torch.equal(other.get(kept)["h"], torch.ones(10))
    other.purge()
    assert other.usage().resident_bytes == 0
    other.close()


def test_close_in_a_sigterm_handler_flushes_releases(mooncake_services, store_id):
    # What a trainer's SIGTERM handler does: close() from inside the handler flushes the
    # releases Mooncake refused (here only close can: the retrier is not due for 30 s).
    store = open_store(mooncake_store_config(mooncake_services, store_id))
    child = spawn(f"""
        import signal, sys
        s = open_store({store.uri + "&buffer_bytes=" + str(16 << 20) + "&release_retry_s=30"!r})
        specs = s.put("x", {{"h": torch.randn(1 << 18)}})
        s.get(specs)  # a 500 ms lease: the release is refused
        s.release(specs)

        def stop(signum, frame):
            s.close()
            s.close()  # idempotent
            sys.exit(0)

        signal.signal(signal.SIGTERM, stop)
        print(s.usage().pending_release_bytes, flush=True)
        sys.stdin.read()
    """)
    assert child.stdout.readline().strip() == str(1 << 20), child.stderr.read()
    child.send_signal(signal.SIGTERM)
    assert child.wait(15) == 0, child.stderr.read()
    assert store.usage().num_samples == 0
    store.close()


def test_close_without_a_master_is_bounded_and_says_what_it_left(
    private_mooncake, store_id, caplog
):
    cfg = _with_client(mooncake_store_config(private_mooncake, store_id), release_retry_s=30)
    store = open_store(cfg)
    specs = store.put("x", {"h": torch.randn(1 << 18)})
    store.get(specs)
    store.release(specs)
    assert store.usage().pending_release_bytes == 1 << 20
    private_mooncake.kill_master()
    t0 = time.monotonic()
    store.close()
    store.close()
    assert time.monotonic() - t0 < 3
    assert "still refused at close" in caplog.text and str(1 << 20) in caplog.text


def test_a_put_rides_out_a_store_node_restart(private_mooncake, store_id, caplog):
    """Regression (chaos, store-node kill on Mooncake): puts that fail while the node restarts
    are waited out, the lease kept alive, instead of failing the task toward max_deliver."""
    import asyncio
    import logging

    from specbus.core.store.retry import while_unavailable

    store = open_store(mooncake_store_config(private_mooncake, store_id))
    private_mooncake.kill_node()
    wait_until(lambda: store.usage().capacity_bytes == 0, 10, "the master dropping the segment")
    beats = []

    async def keepalive():
        beats.append(time.monotonic())

    async def body():
        put = asyncio.create_task(
            while_unavailable(
                lambda: store.put("y", {"h": torch.arange(10.0)}),
                what="putting y", give_up_s=60, keepalive=keepalive,
            )
        )  # fmt: skip
        while not beats:  # the put failed at least once: the store is known to be down
            assert not put.done(), put
            await asyncio.sleep(0.05)
        await asyncio.to_thread(private_mooncake.start_node)
        return await asyncio.wait_for(put, 60)

    with caplog.at_level(logging.WARNING, logger="specbus.store"):
        specs = asyncio.run(body())
    assert torch.equal(store.get(specs)["h"], torch.arange(10.0))
    lines = [r.getMessage() for r in caplog.records if r.name == "specbus.store"]
    assert any("store unavailable while putting y" in m for m in lines)
    assert any("store back after" in m for m in lines)
    store.close()
