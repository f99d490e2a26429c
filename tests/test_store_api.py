"""The FeatureStore contract, on every backend (mem://, shm://, mooncake:// on a real master,
file:// in a temporary directory, http:// against a feature server on loopback)."""

from __future__ import annotations

import threading

import pytest
import torch
from specbus.core.errors import ConfigError, FeatureMissing, IntegrityError, StoreError, StoreFull
from specbus.core.store import FeatureStore, open_store

from tests.fixtures.mooncake import mooncake_store_config

BACKENDS = ["mem", "shm", "mooncake", "file", "http"]


@pytest.fixture(params=BACKENDS)
def make_store(request, store_id):
    """A factory `make_store(**fields)` for a fresh store of the parametrized backend."""
    opened = []

    def make(**fields):
        if request.param == "mooncake":
            services = request.getfixturevalue("mooncake_services")
            store = open_store(mooncake_store_config(services, store_id, **fields))
        elif request.param == "file":
            root = request.getfixturevalue("tmp_path") / "files"
            store = open_store(f"file://{root}?store_id={store_id}", **fields)
        elif request.param == "http":  # a feature server (mem:// behind it) on loopback
            from specbus.core.config import StoreConfig
            from specbus.producers.feature_server import serve_store

            served = serve_store(StoreConfig(uri=f"http://127.0.0.1:0/{store_id}", **fields))
            opened.append(served)
            store = open_store(served.uri, pool_bytes=96 << 20, **fields)
        else:
            store = open_store(f"{request.param}://{store_id}", pool_bytes=96 << 20, **fields)
        opened.append(store)
        return store

    yield make
    for store in reversed(opened):  # clients before their servers
        store.close()


def _sample(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "hidden": torch.randn(2, 7, 16, generator=g).to(torch.bfloat16),
        "logits": torch.randn(7, 11, generator=g).to(torch.float16),
        "target": torch.randn(3, 5, generator=g),
        "input_ids": torch.randint(0, 1000, (7,), generator=g),
        "loss_mask": torch.rand(7, generator=g) > 0.5,
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
    }


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert torch.equal(got[name], t), name


def test_round_trip_every_dtype(make_store):
    store = make_store()
    assert isinstance(store, FeatureStore)
    tensors = _sample()
    specs = store.put("a", tensors)
    assert {n: (s.shape, s.dtype) for n, s in specs.items()} == {
        n: (tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in tensors.items()
    }
    assert all(s.key == f"{store.store_id}/a/g0/{n}" for n, s in specs.items())
    _assert_same(store.get(specs), tensors)
    assert set(store.get(specs, names=["hidden", "loss_mask"])) == {"hidden", "loss_mask"}
    usage = store.usage()
    assert usage.resident_bytes >= sum(s.nbytes for s in specs.values()) and usage.num_samples == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_round_trip_64mb(make_store, dtype):
    store = make_store()
    big = torch.randn((64 << 20) // torch.finfo(dtype).bits * 8).to(dtype)
    specs = store.put("big", {"hidden": big})
    assert specs["hidden"].nbytes == 64 << 20
    _assert_same(store.get(specs), {"hidden": big})
    store.release(specs)


def test_missing_sample_names_the_key(make_store):
    store = make_store()
    specs = store.put("a", {"x": torch.ones(3)})
    store.release(specs)
    store.release(specs)  # idempotent
    with pytest.raises(FeatureMissing) as e:
        store.get(specs)
    assert e.value.key == specs["x"].key and specs["x"].key in str(e.value)


def test_generation_supersedes_older(make_store):
    store = make_store()
    old = store.put("a", {"x": torch.zeros(4)}, gen=0)
    new = store.put("a", {"x": torch.ones(4)}, gen=1)
    assert new["x"].key.endswith("/a/g1/x")
    with pytest.raises(FeatureMissing):
        store.get(old)
    assert torch.equal(store.get(new)["x"], torch.ones(4))
    assert store.usage().num_samples == 1


def test_rewriting_a_key_replaces_the_value(make_store):
    store = make_store()
    store.put("a", {"x": torch.zeros(4)})
    specs = store.put("a", {"x": torch.arange(6.0)})
    assert torch.equal(store.get(specs)["x"], torch.arange(6.0))
    assert store.usage().num_samples == 1


def test_budget_refuses_a_put_that_would_not_fit(make_store):
    store = make_store()
    # mooncake budgets count the whole cluster (shared by this session's tests): leave room
    # for what is there now, then ask for more than the room.
    base = store.usage().resident_bytes
    store = make_store(budget_bytes=base + (1 << 20))
    kept = store.put("fits", {"x": torch.zeros(128 << 10)})  # 512 KiB
    with pytest.raises(StoreFull, match="budget"):
        store.put("too-big", {"x": torch.zeros(256 << 10)})  # +1 MiB > budget
    with pytest.raises(FeatureMissing):  # nothing of the refused sample was written
        store.get(
            {"x": kept["x"].model_copy(update={"key": kept["x"].key.replace("fits", "too-big")})}
        )
    store.release(kept)
    store.put("now-fits", {"x": torch.zeros(200 << 10)})


def test_nan_and_inf_rejected_at_put(make_store):
    store = make_store()
    for bad in (float("nan"), float("inf"), float("-inf")):
        t = torch.ones(5, 3)
        t[2, 1] = bad
        with pytest.raises(IntegrityError, match=r"'a'.*'hidden'"):
            store.put("a", {"ids": torch.arange(3), "hidden": t.to(torch.bfloat16)})
    large = torch.zeros(4 << 20)  # 16 MiB: screened beside the write, then rolled back
    large[-1] = float("nan")
    with pytest.raises(IntegrityError, match=r"'c'.*'hidden'"):
        store.put("c", {"hidden": large})
    assert store.usage().num_samples == 0
    big_but_finite = torch.full((1000,), 60000.0, dtype=torch.float16)  # its fp16 sum overflows
    store.put("b", {"x": big_but_finite})


def test_screen_covers_every_chunk_without_false_rejections(make_store):
    # shm and staged Mooncake puts screen chunk by chunk while copying (core/store/chunked.py):
    # a NaN/Inf anywhere, including a short last chunk, is found; chunks whose fp16 sum
    # overflows but hold only finite values pass.
    store = make_store()
    n = (3 << 20) // 2 + 5  # 3 MiB of bf16 and a bit: three full chunks and a short one
    for where, bad in ((n // 2, float("nan")), (n - 1, float("-inf")), (0, float("inf"))):
        t = torch.randn(n).to(torch.bfloat16)
        t[where] = bad
        with pytest.raises(IntegrityError, match=r"'s'.*'hidden'.*1 NaN/Inf"):
            store.put("s", {"ids": torch.arange(3), "hidden": t})
    assert store.usage().num_samples == 0
    loud = torch.full((3 << 20,), 60000.0, dtype=torch.float16)  # every chunk's sum overflows
    specs = store.put("loud", {"x": loud})
    assert torch.equal(store.get(specs)["x"], loud)


def test_screen_beside_the_write_rejects_and_leaves_nothing(make_store):
    # Samples with 1 MiB or more of floating CPU data are screened on the store's screen
    # worker while the put writes them (shm: the copy into the mapping; Mooncake: the
    # transfer from the caller's memory). A NaN/Inf in any tensor still refuses the sample
    # with the tensor's name and leaves nothing of it (no sample, its keys missing, no bytes
    # resident); a good sample's CRC is still recorded and checked; the worker is one thread
    # for the handle's life, not one per put.
    store = make_store(crc=True)
    g = torch.Generator().manual_seed(1)
    good = {
        "ids": torch.arange(7),
        "hidden": torch.randn(1 << 20, generator=g).to(torch.bfloat16),  # 2 MiB
        "target": torch.randn(1 << 18, generator=g),  # 1 MiB
    }
    specs = store.put("ok", good)
    screeners = _screen_threads()
    for name, where in (("hidden", -1), ("target", 0), ("hidden", 12345)):
        before = store.usage()
        bad = {n: t.clone() for n, t in good.items()}
        bad[name][where] = float("nan")
        with pytest.raises(IntegrityError, match=rf"'bad'.*'{name}'.*1 NaN/Inf"):
            store.put("bad", bad)
        after = store.usage()
        assert (after.num_samples, after.resident_bytes) == (
            before.num_samples,
            before.resident_bytes,
        )
        for spec in specs.values():
            with pytest.raises(FeatureMissing):
                store.get(
                    {spec.name: spec.model_copy(update={"key": spec.key.replace("/ok/", "/bad/")})}
                )
        store.put(f"again{where}", good)  # the worker still serves puts after a rejection
    assert _screen_threads() == screeners
    _assert_same(store.get(specs), good)
    tampered = {"hidden": specs["hidden"].model_copy(update={"crc32": specs["hidden"].crc32 ^ 1})}
    with pytest.raises(IntegrityError, match="CRC32"):
        store.get(tampered)


def test_shared_screen_splits_chunks_and_never_waits_for_its_helper():
    # chunked.SharedScreen: the helper claims chunks from the back, the put's thread from
    # the front as it writes; finish() sums whatever has no sum yet (unclaimed, or claimed
    # by a helper that has not reported) instead of waiting, and names the bad tensor.
    from specbus.core.store.chunked import SharedScreen

    x = torch.randn(5 << 18)  # 5 MiB of fp32: five 1 MiB chunks
    y = x.clone()
    y[-1] = float("inf")  # in the very last chunk: a helper's first
    both = {"ids": torch.arange(3), "x": x, "y": y}
    helped = SharedScreen("s", both)
    helped.help()  # a helper that runs to the end takes every chunk
    assert None not in helped.sums
    with pytest.raises(IntegrityError, match=r"'s'.*'y'.*1 NaN/Inf"):
        helped.finish()
    alone = SharedScreen("s", both)
    alone.screen_next()  # the put's thread wrote and summed the first chunk; no helper ran
    assert alone.sums[0] is not None and alone.sums[1] is None
    with pytest.raises(IntegrityError, match=r"'s'.*'y'"):
        alone.finish()
    stalled = SharedScreen("s", {"x": x})
    stalled._back -= 1  # the last chunk claimed by a helper that never reports back
    stalled.finish()  # returns: the chunk is summed here
    assert None not in stalled.sums
    y[-1] = 0.0
    raced = SharedScreen("s", {"x": x, "y": y})  # a real helper thread racing the front
    worker = threading.Thread(target=raced.help)
    worker.start()
    for _ in range(4):
        raced.screen_next()
    raced.finish()
    worker.join()


def _screen_threads() -> int:
    return sum(t.name.startswith("nan-screen") for t in threading.enumerate())


def test_crc_mismatch_raises(make_store):
    store = make_store(crc=True)
    specs = store.put("a", {"x": torch.arange(10.0)})
    assert specs["x"].crc32 is not None
    store.get(specs)
    tampered = {"x": specs["x"].model_copy(update={"crc32": (specs["x"].crc32 + 1) % 2**32})}
    with pytest.raises(IntegrityError, match="CRC32"):
        store.get(tampered)


def test_gc_reclaims_samples_nobody_will_consume(make_store):
    store = make_store()
    keep = store.put("keep", {"x": torch.ones(1000)})
    store.put("orphan", {"x": torch.ones(1000)})
    store.gc(live={"keep"}, min_age_s=3600)  # the orphan is too young yet
    assert store.usage().num_samples == 2
    assert store.gc(live={"keep"}, min_age_s=0) >= 4000
    assert store.usage().num_samples == 1
    store.get(keep)


def test_sweep_removes_every_finished_sample_and_only_those(make_store):
    # The sweeper a trainer runs after a resume (and at the end of a run) with its record of
    # finished samples: every stored generation of those goes, whoever put or released it;
    # on Mooncake even one a read lease holds (its remove is refused, then retried until
    # the lease lapses); the rest stays. `done` is asked once per sample id.
    store = make_store()
    t = {"h": torch.ones(1000), "ids": torch.arange(7)}  # 4056 B
    a = store.put("a", t)
    b = store.put("b", t, gen=2)
    c = store.put("c", t)
    store.get(a)  # Mooncake: a read lease, so the first remove of "a" is refused
    asked = []

    def done(sample_id: str) -> bool:
        asked.append(sample_id)
        return sample_id in {"a", "b"}

    assert store.sweep(done) == 2 * 4056
    assert sorted(asked) == ["a", "b", "c"]
    usage = store.usage()
    assert usage.num_samples == 1 and usage.pending_release_bytes == 0
    for ref in (a, b):
        with pytest.raises(FeatureMissing):
            store.get(ref)
    _assert_same(store.get(c), t)
    assert store.sweep(done) == 0


def test_purge_removes_everything_of_the_store(make_store):
    # For a run that is gone: every sample of every generation, leases overridden.
    store = make_store()
    specs = [store.put(f"s{i}", {"h": torch.ones(1000)}, gen=i) for i in range(3)]
    store.get(specs[0])  # Mooncake: a read lease, overridden
    assert store.purge() == 3 * 4000
    assert store.usage().num_samples == 0
    for ref in specs:
        with pytest.raises(FeatureMissing):
            store.get(ref)
    _assert_same(store.get(store.put("again", {"h": torch.ones(3)})), {"h": torch.ones(3)})


def test_close_is_idempotent(make_store):
    store = make_store()
    specs = store.put("a", {"h": torch.ones(1000)})
    store.get(specs)
    store.release(specs)  # Mooncake: refused under the read lease, flushed by close
    store.close()
    store.close()  # a second close (another thread, a signal handler) returns at once
    with pytest.raises(StoreError, match="closed"):
        store.sweep(lambda _: True)
    assert make_store().usage().num_samples == 0


def test_bad_uris_and_ids_are_config_errors():
    with pytest.raises(ConfigError, match="scheme"):
        open_store("redis://x")
    with pytest.raises(ConfigError, match="store id"):
        open_store("mem://.hidden")
    store = open_store("mem://ok")
    with pytest.raises(ValueError, match="sample id"):
        store.put("../escape", {"x": torch.ones(1)})


def test_alloc_then_put(make_store):
    store = make_store()
    t = store.alloc((3, 1000), torch.bfloat16)
    t.copy_(torch.randn(3, 1000))
    want = t.clone()
    specs = store.put("a", {"hidden": t, "ids": torch.arange(4)})
    del t  # the store does not depend on the caller keeping its tensor
    _assert_same(store.get(specs), {"hidden": want, "ids": torch.arange(4)})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("scheme", ["mem", "shm"])
def test_cuda_tensors_are_screened_on_their_device(scheme, store_id):
    # Tensors on an accelerator are screened there (their host copies are written unscreened):
    # they round-trip, and NaN/Inf is still refused with the tensor's name.
    store = open_store(f"{scheme}://{store_id}", pool_bytes=16 << 20)
    ok = torch.randn(3 << 20, device="cuda").to(torch.bfloat16)
    specs = store.put("ok", {"h": ok, "ids": torch.arange(4)})
    assert torch.equal(store.get(specs)["h"].cpu(), ok.cpu())
    bad = ok.clone()
    bad[-1] = float("nan")
    with pytest.raises(IntegrityError, match=r"'bad'.*'h'"):
        store.put("bad", {"ids": torch.arange(4), "h": bad})
    assert store.usage().num_samples == 1
    store.close()
