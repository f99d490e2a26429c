"""shm:// across real processes: shared samples and usage, short reads, killed writers, owner
death, a filesystem smaller than the budget, close() from a signal handler, purge."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from specbus.core.errors import FeatureMissing, IntegrityError
from specbus.core.store import open_store, purge_store
from specbus.core.store.shm import store_dir

ROOT = Path(__file__).resolve().parent.parent


def spawn(code: str) -> subprocess.Popen:
    """A child python process running `code` (with torch single-threaded), stdout piped."""
    prelude = "import torch; torch.set_num_threads(1)\nfrom core.store import open_store\n"
    return subprocess.Popen(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_line(proc: subprocess.Popen, expected: str) -> None:
    line = proc.stdout.readline()
    if line.strip() != expected:
        proc.kill()
        raise AssertionError(f"child said {line!r}; stderr: {proc.stderr.read()}")


@pytest.fixture
def uri(store_id):
    yield f"shm://{store_id}"
    shutil.rmtree(store_dir(store_id), ignore_errors=True)  # only matters when a test failed


def test_put_in_one_process_get_in_another(uri):
    here = open_store(uri, pool_bytes=8 << 20)
    child = spawn(f"""
        s = open_store({uri!r}, pool_bytes=0)
        specs = s.put("x", {{"h": torch.arange(24, dtype=torch.float32).reshape(2, 3, 4).bfloat16(), "ids": torch.arange(5)}})
        print(specs["h"].model_dump_json(), flush=True)
        print(specs["ids"].model_dump_json(), flush=True)
        input()  # stay attached until the parent has read
        s.close()
    """)
    from specbus.core.contracts import FeatureSpec

    specs = {
        s.name: s
        for s in (FeatureSpec.model_validate_json(child.stdout.readline()) for _ in range(2))
    }
    assert here.usage().num_samples == 1  # global usage: the child's put is counted here
    got = here.get(specs)
    assert torch.equal(got["h"], torch.arange(24, dtype=torch.float32).reshape(2, 3, 4).bfloat16())
    assert torch.equal(got["ids"], torch.arange(5))
    got["ids"].fill_(-1)  # a read is a copy: mutating it does not touch the store
    assert torch.equal(here.get(specs)["ids"], torch.arange(5))
    here.release(specs)
    _, err = child.communicate("\n", timeout=30)
    assert child.returncode == 0, err
    assert here.usage().resident_bytes == 0
    here.close()
    assert not store_dir(uri.split("://")[1]).exists()  # the last one out removed the store


def test_truncated_object_is_a_short_read(uri, store_id):
    store = open_store(uri, crc=True)
    specs = store.put("x", {"h": torch.randn(1000)})
    path = store_dir(store_id) / "samples" / "x" / "g0" / "h"
    os.truncate(path, 1000)
    with pytest.raises(IntegrityError, match="short read"):
        store.get(specs)
    specs = store.put("x", {"h": torch.randn(1000)})
    with open(path, "r+b") as f:  # same size, different bytes
        f.seek(100)
        f.write(b"\x00\x01\x02\x03")
    with pytest.raises(IntegrityError, match="CRC32"):
        store.get(specs)
    store.close()


@pytest.mark.parametrize("reclaim", ["gc", "sweep"])
def test_writer_killed_mid_put_leaks_nothing_after_gc(uri, reclaim):
    # gc(live) or sweep(done) (the caller knows what is live, or what is finished): either
    # way the dead writer's half-written put goes, and the complete sample when it is not
    # live any more.
    here = open_store(uri, pool_bytes=0)
    if reclaim == "gc":
        keep, drop = (lambda: here.gc(live={"big"})), (lambda: here.gc(live=set(), min_age_s=0))
    else:
        keep, drop = (lambda: here.sweep(lambda _: False)), (lambda: here.sweep(lambda _: True))
    child = spawn(f"""
        s = open_store({uri!r}, pool_bytes=0)
        print("ready", flush=True)
        while True:  # put big samples until killed; the kill lands inside one of them
            s.put("big", {{f"t{{i}}": torch.ones(2 << 20) for i in range(16)}})
    """)
    wait_line(child, "ready")
    sample_dir = store_dir(uri.split("://")[1]) / "samples" / "big"
    deadline = time.monotonic() + 30
    while True:  # freeze the writer while a put is in flight (its tmp directory exists)
        assert time.monotonic() < deadline, "never caught the writer mid-put"
        if sample_dir.exists() and any(d.name.endswith(".tmp") for d in sample_dir.iterdir()):
            child.send_signal(signal.SIGSTOP)
            if any(d.name.endswith(".tmp") for d in sample_dir.iterdir()):
                break
            child.send_signal(signal.SIGCONT)
        time.sleep(0.001)
    child.send_signal(signal.SIGKILL)
    child.wait(10)
    assert here.usage().resident_bytes > 0  # the dead writer's reservation is still counted
    keep()  # the complete sample (if any) is live; the half-written one is not
    leftover = here.usage()
    assert leftover.resident_bytes in (0, 128 << 20) and leftover.num_samples in (0, 1)
    drop()
    assert here.usage().resident_bytes == 0 and here.usage().num_samples == 0
    samples = store_dir(uri.split("://")[1]) / "samples"
    assert not samples.exists() or not any(samples.iterdir())
    here.close()


def test_store_of_a_killed_owner_is_removed_by_the_next_open(uri, store_id):
    child = spawn(f"""
        s = open_store({uri!r}, pool_bytes=0)
        s.put("x", {{"h": torch.ones(1 << 20)}})
        print("ready", flush=True)
        input()
    """)
    wait_line(child, "ready")
    assert (store_dir(store_id) / "samples" / "x").exists()
    child.send_signal(signal.SIGKILL)
    child.wait(10)
    store = open_store(uri)  # every process attached to the store is dead: nobody will consume
    assert store.usage().resident_bytes == 0 and store.usage().num_samples == 0
    assert not (store_dir(store_id) / "samples").exists()
    store.close()
    assert not store_dir(store_id).exists()


def test_complete_samples_survive_their_writer_while_someone_is_attached(uri):
    here = open_store(uri)
    child = spawn(f"""
        s = open_store({uri!r}, pool_bytes=0)
        specs = s.put("x", {{"h": torch.ones(1 << 20)}})
        print(specs["h"].model_dump_json(), flush=True)
        input()
    """)
    from specbus.core.contracts import FeatureSpec

    spec = FeatureSpec.model_validate_json(child.stdout.readline())
    child.send_signal(signal.SIGKILL)
    child.wait(10)
    here.gc()  # the sample is complete and may be published: it stays
    assert torch.equal(here.get({"h": spec})["h"], torch.ones(1 << 20))
    here.adopt({"h": spec})
    assert here.gc(live=set(), min_age_s=0) == 4 << 20  # nobody will consume it
    with pytest.raises(FeatureMissing):
        here.get({"h": spec})
    here.close()


def test_pooled_reads_return_their_memory(uri):
    store = open_store(uri, pool_bytes=16 << 20)
    specs = store.put("x", {"h": torch.randn(1 << 20)})  # 4 MiB
    from specbus.core.store import shm

    pool = shm._recv_pool(16 << 20)
    free = pool.free_bytes()
    for _ in range(20):  # 80 MiB read through a 16 MiB pool: chunks come back as tensors die
        t = store.get(specs)["h"]
        view = t[10:20]
        del t
        assert torch.equal(view, store.get(specs)["h"][10:20])
        del view
    assert pool.free_bytes() == free
    store.close()


def test_released_files_are_recycled_within_bounds(uri):
    mib = 1 << 20
    store = open_store(uri, budget_bytes=10 * mib, recycle_bytes=6 * mib, pool_bytes=0)
    a = store.put("a", {"x": torch.randn(mib // 4 * 4), "y": torch.randn(mib // 4)})  # 4 + 1 MiB
    store.release(a)
    assert store.usage().cached_bytes == 5 * mib and store.usage().resident_bytes == 0
    b_x = torch.randn(mib // 2)  # 2 MiB, written into the recycled 4 MiB file (shrunk)
    b = store.put("b", {"x": b_x})
    assert store.usage().cached_bytes == 1 * mib
    assert torch.equal(store.get(b)["x"], b_x)
    with pytest.raises(FeatureMissing):  # a's files now hold b's bytes: a is gone, not torn
        store.get(a)
    c_x = torch.randn(2 * mib)  # 8 MiB, written into the recycled 1 MiB file (grown)
    c = store.put("c", {"x": c_x})
    assert store.usage().cached_bytes == 0 and store.usage().resident_bytes == 10 * mib
    assert torch.equal(store.get(c)["x"], c_x) and torch.equal(store.get(b)["x"], b_x)
    store.release(b)
    store.release(c)  # 2 MiB fits the 6 MiB cache, then 8 MiB does not: deleted
    assert store.usage().cached_bytes == 2 * mib and store.usage().resident_bytes == 0
    store.close()
    assert not store_dir(uri.split("://")[1]).exists()


def test_opening_any_store_sweeps_stores_of_dead_runs(uri, store_id):
    child = spawn(f"""
        s = open_store({uri!r}, pool_bytes=0)
        s.put("x", {{"h": torch.ones(1 << 20)}})
        kept = open_store({(uri + "-kept")!r}, pool_bytes=0, keep_on_close=True)
        kept.put("x", {{"h": torch.ones(10)}})
        print("ready", flush=True)
        input()
    """)
    wait_line(child, "ready")
    child.send_signal(signal.SIGKILL)
    child.wait(10)
    assert store_dir(store_id).exists()
    other = open_store(uri + "-other")  # a later run on this host, another store
    assert not store_dir(store_id).exists()  # every process of it is dead: swept
    assert store_dir(store_id + "-kept").exists()  # keep_on_close stores are left alone
    other.close()
    shutil.rmtree(store_dir(store_id + "-kept"))


def _mapped_store_files(root: Path) -> list[str]:
    """Lines of /proc/self/maps naming files of the store at `root` (this process's mappings)."""
    with open("/proc/self/maps") as f:
        return [line.strip() for line in f if str(root) in line]


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc (Linux)")
def test_writer_mappings_never_pin_deleted_files(uri, store_id):
    # Puts of >= 1 MiB copy into this process's mapping of the file (core/store/mapped.py),
    # kept for reuse when the file is recycled. A mapping of a deleted file would hold its
    # memory: gc and close must drop those, and reused files must hold the new bytes.
    mib = 1 << 20
    store = open_store(uri, budget_bytes=64 * mib, recycle_bytes=16 * mib, pool_bytes=0)
    root = store_dir(store_id)
    for i in range(4):  # 3 x 4 MiB, recycled into the same (mapped) files every round
        xs = {f"x{j}": torch.randn(mib) + i for j in range(3)}
        specs = store.put(f"s{i}", xs)
        for name, t in store.get(specs).items():
            assert torch.equal(t, xs[name])
        store.release(specs)
    assert store.usage().cached_bytes == 12 * mib
    assert len(_mapped_store_files(root)) == 3  # kept mapped for the next puts
    for f in (root / "free").iterdir():  # as another process trimming the cache would
        f.unlink()
    assert len([m for m in _mapped_store_files(root) if m.endswith("(deleted)")]) == 3
    store.gc()
    assert not _mapped_store_files(root)
    xs = {"x": torch.randn(mib)}
    assert torch.equal(store.get(store.put("again", xs))["x"], xs["x"])
    assert len(_mapped_store_files(root)) == 1
    store.close()
    assert not _mapped_store_files(root)
    assert not root.exists()


def test_concurrent_puts_while_mappings_are_evicted(uri):
    # Two threads put through one handle while the mapping cache (one 2 MiB file) evicts
    # constantly: a mapping is never unmapped under a copy, and every sample reads back.
    mib = 1 << 20
    store = open_store(uri, budget_bytes=64 * mib, recycle_bytes=2 * mib, pool_bytes=0)
    errors = []

    def work(tag: str) -> None:
        try:
            for i in range(40):
                x = torch.full((mib // 2,), float(i))  # 2 MiB
                specs = store.put(f"{tag}{i}", {"x": x})
                assert torch.equal(store.get(specs)["x"], x)
                store.release(specs)
        except Exception as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(tag,)) for tag in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    store.close()


# ---- space, signals, purge (issue 12, defect 5 and the shm half of defect 2) -------------------


class SmallFs:
    """A real 4 MiB tmpfs at `path` for a child process: mounted here when this process may
    mount (root), else inside a user + mount namespace of the child alone (`unshare -rm`).
    Children run through `spawn` and report what they saw, so both ways test the same."""

    def __init__(self, path: Path, prefix: list[str]):
        self.path = path
        self.prefix = prefix

    def spawn(self, code: str) -> subprocess.Popen:
        prelude = "import torch; torch.set_num_threads(1)\nfrom core.store import open_store\n"
        return subprocess.Popen(
            [*self.prefix, sys.executable, "-c", prelude + textwrap.dedent(code)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )


@pytest.fixture
def small_fs(tmp_path):
    path = tmp_path / "small"
    path.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(path)]
    mounted = subprocess.run(mount, capture_output=True, text=True)
    if mounted.returncode == 0:
        yield SmallFs(path, [])
        subprocess.run(["umount", "-l", str(path)], check=False)
        return
    inner = f'mount -t tmpfs -o size=4m tmpfs {path} && exec "$@"'
    prefix = ["unshare", "-rm", "sh", "-c", inner, "sh"]
    probe = subprocess.run([*prefix, "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"no small filesystem here: mount: {mounted.stderr}; unshare: {probe.stderr}")
    yield SmallFs(path, prefix)


def test_a_put_the_filesystem_cannot_hold_is_store_no_space_never_sigbus(small_fs):
    # Regression, issue 12 defect 5: a shm store on a filesystem smaller than its budget
    # (Docker's 64 MiB /dev/shm against the 4 GiB default) killed the producer with SIGBUS
    # (exit 135, empty log) at the first write through a mapping the filesystem could not
    # back. Now: a warning at open naming the directory and the sizes, then a typed
    # StoreNoSpace (a StoreFull: backpressure) naming the directory, the bytes needed and
    # free, with nothing of the put left behind; released space is used again.
    root = small_fs.path / "store"
    child = small_fs.spawn(f"""
        import json, logging, os
        from specbus.core.errors import StoreNoSpace

        said = []
        class Keep(logging.Handler):
            def emit(self, record):
                said.append(record.getMessage())
        logging.getLogger("specbus.core.store").addHandler(Keep())

        def free():
            v = os.statvfs({str(small_fs.path)!r})
            return v.f_bavail * v.f_frsize

        def debris():
            return sorted(
                os.path.relpath(os.path.join(d, n), {str(root)!r})
                for d, dirs, files in os.walk({str(root)!r} + "/samples")
                for n in dirs + files
            )

        s = open_store("shm://{root}?store_id=small", pool_bytes=0, budget_bytes=64 << 20)
        out = {{"said": said, "free0": free()}}
        try:  # 8 MiB, written through a mapping: the SIGBUS of old
            s.put("big", {{"h": torch.ones(2 << 20)}})
        except StoreNoSpace as e:
            out["big"] = [e.directory, e.needed, e.free, str(e)]
        out["after_big"] = [free(), debris(), s.usage().resident_bytes, s.usage().num_samples]
        specs = []
        while len(specs) < 10:  # 1 MiB samples until the filesystem is full
            try:
                specs.append(s.put(f"s{{len(specs)}}", {{"h": torch.ones(1 << 18)}}))
            except StoreNoSpace as e:
                out["full"] = [len(specs), e.needed, e.free]
                break
        out["debris"] = [p for p in debris() if ".tmp" in p]
        for ref in specs:
            s.release(ref)
        # 2.5 MiB: grows a recycled 1 MiB file (its new blocks are reserved too), finds no
        # room while the other cached files hold theirs, drops them and goes through
        s.put("after", {{"h": torch.ones(655360)}})
        out["after"] = s.usage().resident_bytes
        s.close()
        print(json.dumps(out), flush=True)
    """)
    stdout, stderr = child.communicate(timeout=120)
    assert child.returncode == 0, f"exit {child.returncode} (135: SIGBUS); stderr: {stderr}"
    out = json.loads(stdout)
    assert any(
        str(root) in m and "64.0 MiB" in m and "4.0 MiB" in m and "budget_bytes" in m
        for m in out["said"]
    ), out["said"]
    directory, needed, free, message = out["big"]
    assert (directory, needed) == (str(root), 8 << 20)
    assert free == out["free0"] and str(root) in message and str(8 << 20) in message
    assert out["after_big"] == [out["free0"], [], 0, 0]  # nothing of it stays
    n, needed, free = out["full"]
    assert n >= 2 and needed == 1 << 20 and free < 1 << 20
    assert out["debris"] == []
    assert out["after"] == 655360 * 4


def test_close_from_a_signal_handler_inside_a_locked_section(uri):
    # A signal handler runs on the main thread wherever it is, e.g. inside a put's locked
    # section. close() from there, of that handle or of another on the same store, must not
    # wait for the lock its own thread holds (flock on a second descriptor would, forever).
    child = spawn(f"""
        import signal, sys
        a = open_store({uri!r}, pool_bytes=0)
        b = open_store({uri!r}, pool_bytes=0)
        a.put("x", {{"h": torch.ones(10)}})

        def stop(signum, frame):
            b.close()
            a.close()
            a.close()
            print("closed", flush=True)
            sys.exit(0)

        signal.signal(signal.SIGTERM, stop)
        with a._lock:  # as in the middle of a put
            signal.raise_signal(signal.SIGTERM)
    """)
    try:
        stdout, stderr = child.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
        pytest.fail("close() in a signal handler deadlocked on its own thread's lock")
    assert child.returncode == 0 and stdout.strip() == "closed", stderr
    assert not Path(store_dir(uri.removeprefix("shm://"))).exists()  # the last one out


def test_purge_store_removes_a_kept_store_of_a_gone_run(store_id):
    # keep_on_close keeps a store after its last process (sweep_abandoned leaves it alone):
    # purge_store is how a user (or specbus) removes it once its run is gone.
    uri = f"shm://{store_id}"
    child = spawn(f"""
        s = open_store({uri!r}, pool_bytes=0, keep_on_close=True)
        s.put("kept", {{"h": torch.ones(1 << 18)}})
        s.release(s.put("cached", {{"h": torch.ones(1 << 18)}}))  # its file stays cached
        s.close()
    """)
    assert child.wait(60) == 0, child.stderr.read()
    assert (store_dir(store_id) / "samples" / "kept").exists()
    assert purge_store(uri) == 2 << 20
    assert not store_dir(store_id).exists()
