"""file:// specifics: persistence, safetensors files, atomicity under kill -9 mid-write,
CRC, truncated and missing files. (The shared contract is in test_store_api.py.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from specbus.core.errors import ConfigError, FeatureMissing, IntegrityError
from specbus.core.store import open_store


def _store(root: Path, **kw):
    return open_store(f"file://{root}?store_id=rec", **kw)


def _files(root: Path, pattern: str) -> list[Path]:
    return sorted((root / "samples").glob(pattern))


def test_samples_persist_as_safetensors_files_across_processes(tmp_path):
    from safetensors.torch import load_file

    root = tmp_path / "rec"
    store = _store(root, crc=True)
    tensors = {
        "hidden_states": torch.randn(7, 12).to(torch.bfloat16),
        "input_ids": torch.arange(7),
        "loss_mask": torch.tensor([0, 0, 1, 1, 1, 1, 0]).bool(),
    }
    specs = store.put("t1-e0", tensors)
    store.close()  # nothing goes at close: the samples persist
    [path] = _files(root, "t1-e0/g0.safetensors")
    loaded = load_file(path)  # a standard safetensors file
    assert all(torch.equal(loaded[n], t) for n, t in tensors.items())
    wire = {n: spec.model_dump_json() for n, spec in specs.items()}
    code = textwrap.dedent(f"""
        from specbus.core.contracts import FeatureSpec
        from specbus.core.store import open_store
        specs = {{n: FeatureSpec.model_validate_json(s) for n, s in {wire!r}.items()}}
        store = open_store("file://{root}?store_id=rec")
        got = store.get(specs)
        assert store.usage().num_samples == 1, store.usage()
        print(float(got["hidden_states"].float().sum()))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert float(out.stdout) == float(tensors["hidden_states"].float().sum())


def test_reads_view_the_mapped_file(tmp_path):
    store = _store(tmp_path / "rec")
    specs = store.put("a", {"x": torch.arange(1 << 20, dtype=torch.float32), "b": torch.ones(3)})
    x = store.get(specs)["x"]
    # zero copy: the tensor's memory is a mapping of the file, not a heap buffer
    addr = x.data_ptr()
    maps = Path("/proc/self/maps").read_text().splitlines()
    mapped = [m for m in maps if m.endswith("g0.safetensors")]
    assert any(
        int(m.split("-")[0], 16) <= addr < int(m.split()[0].split("-")[1], 16) for m in mapped
    )
    x[0] = 42.0  # private (copy-on-write): the file keeps its bytes
    assert store.get(specs)["x"][0] == 0.0


def test_crc_truncation_and_missing_files_are_typed_errors(tmp_path):
    root = tmp_path / "rec"
    store = _store(root, crc=True)
    specs = store.put("a", {"x": torch.arange(1000.0), "ids": torch.arange(5)})
    [path] = _files(root, "a/g0.safetensors")
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF  # one flipped byte inside x
    path.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="CRC32"):
        store.get(specs)
    path.write_bytes(bytes(data[:-10]))  # a truncated file
    with pytest.raises(IntegrityError, match="truncated"):
        store.get(specs)
    path.write_bytes(b"\x05\x00")  # not even a header
    with pytest.raises(IntegrityError):
        store.get(specs)
    path.unlink()
    with pytest.raises(FeatureMissing) as e:
        store.get(specs)
    assert e.value.key in {s.key for s in specs.values()}
    wrong = {"x": specs["x"].model_copy(update={"shape": (10, 100)})}
    store.put("b", {"x": torch.arange(1000.0)})
    with pytest.raises(IntegrityError, match="spec says"):
        store.get(
            {"x": wrong["x"].model_copy(update={"key": wrong["x"].key.replace("/a/", "/b/")})}
        )


def test_relative_or_missing_directory_is_a_config_error():
    with pytest.raises(ConfigError, match="absolute"):
        open_store("file://relative")


_WRITER = """
import sys, torch
from specbus.core.store import open_store
store = open_store(sys.argv[1], screen_nonfinite=False)
big = torch.randn((64 << 20) // 4)
store.put("done", {"x": torch.ones(10)})
print("ready", flush=True)
i = 0
while True:  # puts of 64 MiB until killed
    store.put(f"s{i % 3}", {"x": big}, gen=i)
    i += 1
"""


def test_kill_9_mid_write_leaves_no_partial_sample(tmp_path):
    """A writer killed in the middle of a put leaves its tmp file only: readers see the last
    complete generations, never a partial one; gc() removes the dead writer's put and the
    counters come back to exactly what is stored."""
    root = tmp_path / "rec"
    uri = f"file://{root}?store_id=rec"
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, uri], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 60
        caught = None
        while time.monotonic() < deadline and caught is None:
            for tmp in _files(root, "*/.g*.tmp"):
                try:
                    size = tmp.stat().st_size
                except FileNotFoundError:
                    continue
                if 0 < size < 64 << 20:  # a put half written: kill it now
                    os.kill(proc.pid, signal.SIGKILL)
                    caught = tmp
                    break
        assert caught is not None, "never saw a put in progress"
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert (
        caught.exists() and caught.stat().st_size < (64 << 20) + 8 + 128
    )  # the fault landed mid-write
    store = _store(root)
    complete = _files(root, "*/g*.safetensors")
    for path in complete:  # every complete file is whole and readable
        from safetensors.torch import load_file

        assert load_file(path)["x"].numel() in (10, (64 << 20) // 4)
    before = store.usage()
    freed = store.gc()
    assert not caught.exists() and freed >= 64 << 20
    after = store.usage()
    assert after.num_samples == len(complete) == before.num_samples - 1
    assert after.resident_bytes == 40 + (len(complete) - 1) * (64 << 20)
