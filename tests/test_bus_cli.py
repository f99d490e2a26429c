"""`specbus up`, `specbus status`, `specbus dead` against a real broker."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys

from specbus.bus.connection import connect
from specbus.bus.lease import Leases
from specbus.bus.publisher import Publisher
from specbus.core.config import BusConfig
from specbus.ops.cli import main

from tests.fixtures.nats import make_ref, open_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is not running.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_up_then_status_and_dead_then_ctrl_c_stops_the_server(tmp_path, run_id, capsys):
    up = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "specbus.ops.cli",
            "up",
            "--port",
            "0",
            f"run={run_id}",
            f"run_dir={tmp_path}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=ROOT,
        env={**os.environ, "SPECBUS_STATE_DIR": str(tmp_path / "state")},
    )
    try:
        lines = []
        while not lines or "Ctrl-C" not in lines[-1]:
            line = up.stdout.readline()
            assert line, f"specbus up exited early: {lines}"
            lines.append(line)
        url, pid = re.search(
            r"ready at (nats://127\.0\.0\.1:\d+) \(pid (\d+)", "".join(lines)
        ).groups()
        assert (tmp_path / "nats" / "url").read_text().strip() == url

        # status finds the broker through the URL file under the run dir, and the run is declared.
        assert main(["status", f"run={run_id}", f"run_dir={tmp_path}"]) == 0
        out = capsys.readouterr().out
        assert (
            f"SPECBUS_{run_id}_SAMPLES" in out and "trainers" in out and "feed complete   no" in out
        )

        async def poison():
            cfg = BusConfig(ack_wait_s=5)
            bus = await connect(cfg, url)
            await Publisher(bus).publish(f"specbus.{run_id}.samples", make_ref(run_id, 0))
            (lease,) = await (await Leases.join(bus, run_id, "trainers")).fetch(1)
            await lease.term("bad_shape", "hidden_states is 3-d")
            await bus.close()

        asyncio.run(poison())
        assert main(["dead", "--payload", "-o", f"run={run_id}", "-o", f"run_dir={tmp_path}"]) == 0
        out = capsys.readouterr().out
        assert "1 dead letter" in out and "bad_shape" in out and "hidden_states is 3-d" in out
        assert '"sample_id":"s0"' in out  # the original payload
        assert main(["status", f"run={run_id}", f"run_dir={tmp_path}"]) == 0
        assert "dead letters     1" in capsys.readouterr().out

        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=20) == 0
        assert not _alive(int(pid)), "nats-server still running after Ctrl-C"
        # The URL stays as the store dir's pinned address: the next `up` serves there again.
        assert (tmp_path / "nats" / "url").read_text().strip() == url
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()


def test_status_of_an_undeclared_run_says_so_and_fails(nats_server, run_id, capsys):
    assert main(["status", "--url", nats_server.url, f"run={run_id}"]) == 1
    assert "not declared" in capsys.readouterr().out


def test_status_reports_lag_and_markers(nats_server, run_id, bus_cfg, capsys):
    async def setup():
        bus, topo = await open_run(nats_server.url, bus_cfg, run_id)
        await Publisher(bus).publish_many(
            topo.names.samples, [make_ref(run_id, i, 1 << 20) for i in range(3)]
        )
        await topo.kv.mark_feed_complete(3)
        await bus.close()

    asyncio.run(setup())
    assert main(["status", "--url", nats_server.url, "-o", f"run={run_id}"]) == 0
    out = capsys.readouterr().out
    assert "trainers   3 messages (3 pending + 0 in flight), 3.0 MiB of tensors (sampled)" in out
    assert "feed complete   3 tasks" in out


def test_a_bad_override_is_a_clear_error(capsys):
    assert main(["status", "bus.ack_wait_s=-1"]) == 2
    err = capsys.readouterr().err
    assert "bus.ack_wait_s" in err and "-1" in err


def test_purge_removes_every_object_of_a_gone_run_and_asks_first(tmp_path, run_id, capsys):
    import torch
    from specbus.core.store import open_store

    uri = f"shm://{tmp_path / 'shm'}"
    store = open_store(uri, keep_on_close=True)  # the run's producers are gone, their data not
    try:
        store.put("s0", {"hidden_states": torch.ones(1024)})
        store.put("s1", {"hidden_states": torch.ones(1024)}, 1)
        assert store.usage().resident_bytes == 8192
    finally:
        store.close()
    overrides = [f"run={run_id}", f"store.uri={uri}"]
    assert main(["purge", *overrides]) == 2  # refuses without --yes, removes nothing
    assert any((tmp_path / "shm").rglob("hidden_states*"))
    assert main(["purge", "--yes", *overrides]) == 0
    assert "8192 bytes freed" in capsys.readouterr().out
    assert not any((tmp_path / "shm").rglob("hidden_states*"))


def test_status_and_top_tell_live_from_last_known_values_after_the_run(
    nats_server, run_id, bus_cfg, tmp_path, capsys
):
    """Issue 34: after a run, `status` and `top` showed refs in flight, lagging refs and "55.4
    MiB resident" from the trainers' last log row while the store held far less, and nothing
    said what was stale or suggested `specbus purge`. A run as the trainers leave it: marked
    complete, its last log row 5 minutes old, 2 refs never trained, its shm store still
    holding one sample."""
    import time

    import torch
    from specbus.core.store import open_store

    uri = f"shm://{tmp_path / 'shm'}"
    store = open_store(uri, keep_on_close=True)
    try:
        store.put("s0", {"hidden_states": torch.ones(1024)})  # 4 KiB left behind
    finally:
        store.close()
    ended = time.time() - 300

    async def setup():
        bus, topo = await open_run(nats_server.url, bus_cfg, run_id)
        await Publisher(bus).publish_many(
            topo.names.samples, [make_ref(run_id, i, 1 << 20) for i in range(2)]
        )
        await topo.kv.mark_feed_complete(2)
        await topo.kv.put_progress({"step": 100, "loss": 1.5, "samples_per_s": 3.0,
                                    "store_bytes": 55.4 * 2**20, "store_peak_bytes": 60 * 2**20,
                                    "time": ended})  # fmt: skip
        await topo.kv.mark_train_complete({"steps": 100, "samples": 400, "time": ended + 5})
        await bus.close()

    asyncio.run(setup())
    args = ["--url", nats_server.url, f"run={run_id}", f"store.uri={uri}"]
    assert main(["status", *args]) == 0
    out = capsys.readouterr().out
    as_of = time.strftime("%H:%M:%S", time.localtime(ended))
    assert "streams (now)" in out and "lag (now)" in out, out
    assert f"trainers (last known, as of {as_of} (5 min ago; the run's final row" in out, out
    assert "store 55.4 MiB resident then" in out, out
    assert f"store (now)      {uri}: 4.0 KiB resident, 1 sample(s)" in out, out
    left = next(line for line in out.splitlines() if line.startswith("left over"))
    assert "2 refs were never trained" in left and "still holds 4.0 KiB" in left, left
    assert f"specbus purge --yes run={run_id} store.uri={uri}" in left, left

    assert main(["top", "--once", *args]) == 0
    out = capsys.readouterr().out
    assert f"progress   last known, as of {as_of}" in out and "training complete at" in out, out
    assert f"store      now 4.0 KiB resident in {uri}" in out, out
    assert (
        f"55.4 MiB resident (peak 60.0 MiB) at the trainers' last log row (last known, as of {as_of}"
        in out
    ), out
    assert "left over" in out and "specbus purge --yes" in out, out

    # Purged: the store holds nothing, so nothing more is suggested; the lag is explained.
    assert main(["purge", "--yes", f"run={run_id}", f"store.uri={uri}"]) == 0
    assert main(["status", *args]) == 0
    out = capsys.readouterr().out
    assert f"store (now)      {uri}: 0 B resident" in out, out
    left = next(line for line in out.splitlines() if line.startswith("left over"))
    assert "2 refs were never trained" in left and "holds none of their tensors" in left, left
    assert "purge" not in left, left


def test_retention_is_set_per_stream_and_status_shows_bytes_and_what_replay_reaches(
    nats_server, run_id, bus_cfg, capsys
):
    """Issue 31: each stream's limits come from the config (declared and updated in place);
    past a bytes limit the oldest refs go, and `specbus status` shows each stream's bytes,
    its retention and the sequences replay can still reach, and says when the latest
    checkpoint's resume would need refs that are gone."""
    limits = {"samples_max_bytes": 8192, "tasks_max_age_s": 3600.0, "dead_max_bytes": 1 << 20}

    async def setup():
        bus, topo = await open_run(nats_server.url, bus_cfg.model_copy(update=limits), run_id)
        await Publisher(bus).publish_many(
            topo.names.samples, [make_ref(run_id, i) for i in range(40)]
        )
        await topo.kv.put_checkpoint({"step": 1, "path": "x", "samples": 2, "floor": 2})
        infos = [await bus.js.stream_info(n) for n in (topo.names.tasks_stream,
                 topo.names.samples_stream, topo.names.dead_stream)]  # fmt: skip
        await bus.close()
        return infos

    tasks, samples, dead = asyncio.run(setup())
    assert (tasks.config.max_age, tasks.config.max_bytes) == (3600.0, -1)
    assert samples.config.max_bytes == 8192 and samples.state.bytes <= 8192
    assert samples.state.first_seq > 3 and samples.state.last_seq == 40  # the oldest went
    assert dead.config.max_bytes == 1 << 20
    overrides = [f"run={run_id}", *(f"bus.{k}={v}" for k, v in limits.items())]
    assert main(["status", "--url", nats_server.url, *overrides]) == 0
    out = capsys.readouterr().out
    first = samples.state.first_seq
    assert f"retention: kept until age 7 d or bytes 8.0 KiB; replay reaches seq {first}..40" in out
    assert "retention: kept until age 3600 s" in out  # TASKS (empty: nothing to reach)
    assert f"replays from seq 3, but the stream starts at {first}: {first - 3} messages" in out

    async def widen():  # a config with other limits updates the stream in place
        bus, topo = await open_run(nats_server.url, bus_cfg, run_id)
        info = await bus.js.stream_info(topo.names.samples_stream)
        await bus.close()
        return info

    assert asyncio.run(widen()).config.max_bytes == -1
