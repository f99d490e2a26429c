"""The broker's lifecycle as a user lives it, with real processes (`python -m specbus.ops.cli up`,
`specbus demo`) and a real nats-server / mooncake_master: a restart after kill -9 comes back
on the same port at once, a store dir serves one broker, nothing outlives its parent, signals
stop every child, and the Mooncake store outlives the broker. Readiness is read from the
processes' output and from the OS (psutil, /dev/shm), never slept for.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from pathlib import Path

import psutil
import pytest
from specbus.ops.cli import main

ROOT = Path(__file__).resolve().parents[1]
READY = "Ctrl-C to stop"


def _env(tmp_path: Path) -> dict[str, str]:
    # The announced-broker file goes to the test's own state dir, not the user's.
    return {**os.environ, "SPECBUS_STATE_DIR": str(tmp_path / "state"), "OMP_NUM_THREADS": "1"}


class Proc:
    """A `python -m specbus.ops.cli ...` process whose output lines are read by a thread."""

    def __init__(self, tmp_path: Path, *argv: str):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "specbus.ops.cli", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            cwd=ROOT,
            env=_env(tmp_path),
        )
        self.pid = self.proc.pid
        self.lines: list[str] = []
        self._q: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self._q.put(line)
        self._q.put(None)

    def expect(self, pattern: str, timeout_s: float = 120.0) -> re.Match:
        """The first line from now on matching `pattern`; fails if the process ends first."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self._q.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no {pattern!r} after {timeout_s}s: {self.lines}") from None
            if line is None:
                self.proc.wait()
                raise AssertionError(
                    f"exited with {self.proc.returncode} before {pattern!r}: {''.join(self.lines)}"
                )
            self.lines.append(line)
            if m := re.search(pattern, line):
                return m

    def wait(self, timeout_s: float = 60.0) -> int:
        rc = self.proc.wait(timeout=timeout_s)
        while (line := self._q.get(timeout=10)) is not None:
            self.lines.append(line)
        return rc

    def kill(self) -> None:
        """kill -9, unless it already exited (Popen never signals a reaped pid)."""
        self.proc.kill()
        self.proc.wait()


def start_up(tmp_path: Path, *args: str, run: str = "lc") -> tuple[Proc, str, psutil.Process]:
    """`specbus up` on `<tmp_path>/run`; returns it with the URL and its nats-server."""
    up = Proc(tmp_path, "up", f"run={run}", f"run_dir={tmp_path / 'run'}", *args)
    url, pid = up.expect(r"ready at (nats://127\.0\.0\.1:\d+) \(pid (\d+)").groups()
    up.expect(READY)
    return up, url, psutil.Process(int(pid))


def gone(procs, timeout_s: float = 20.0) -> list[psutil.Process]:
    """Wait until none of `procs` runs (zombies count as gone); return the ones left."""
    deadline = time.monotonic() + timeout_s
    left = list(procs)
    while left and time.monotonic() < deadline:
        left = [p for p in left if _running(p)]
        if left:
            time.sleep(0.05)
    return left


def _running(proc: psutil.Process) -> bool:
    """psutil.Process remembers the start time: a reused pid is not this process."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _reap(procs) -> None:
    """Test cleanup: kill -9 whatever a failed test left running (never a reused pid)."""
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            if _running(proc):
                proc.kill()


def _port(url: str) -> int:
    return urllib.parse.urlsplit(url).port


def _time_wait_on(port: int) -> bool:
    return any(
        c.status == psutil.CONN_TIME_WAIT and c.laddr and c.laddr.port == port
        for c in psutil.net_connections(kind="tcp4")
    )


def _crash(up: Proc, server: psutil.Process, port: int) -> None:
    """kill -9 of `specbus up` and of its nats-server while a client is connected: the
    server's side of that connection is left in TIME_WAIT, as after a real crash."""
    client = socket.create_connection(("127.0.0.1", port), timeout=10)
    assert client.recv(4096).startswith(b"INFO")
    up.kill()
    with contextlib.suppress(psutil.NoSuchProcess):
        server.kill()
    assert not gone([server])
    assert client.recv(4096) == b""  # the server closed first ...
    client.close()
    assert _time_wait_on(port), "no TIME_WAIT socket on the port: the fault did not land"


def test_up_comes_back_on_its_port_at_once_after_kill_9(tmp_path):
    up, url, server = start_up(tmp_path, "--port", "0")
    seen = [server]
    try:
        port = _port(url)
        dead_wrapper = up.pid
        _crash(up, server, port)

        # Restarted by hand on the same port (TIME_WAIT sockets there) and store dir: at once.
        lock = tmp_path / "run" / "nats" / "broker.lock"
        stale = json.loads(lock.read_text()) if lock.exists() else {}
        up, url2, server = start_up(tmp_path, "--port", str(port))
        seen.append(server)
        assert url2 == url
        # The dead wrapper's lock file was left behind with its record: it did not block.
        assert stale["pid"] == dead_wrapper
        _crash(up, server, port)

        # Without --port it comes back where it was: running processes retry that URL.
        up, url3, server = start_up(tmp_path)
        seen.append(server)
        assert url3 == url

        # A server that dies under a live `specbus up` is restarted there by it.
        server.kill()
        url4, pid = up.expect(r"restarted at (nats://\S+) \(pid (\d+)").groups()
        restarted = psutil.Process(int(pid))
        seen.append(restarted)
        assert url4 == url and restarted.pid != server.pid
        up.proc.send_signal(signal.SIGTERM)
        assert up.wait() == 0
        assert not gone([restarted])
    finally:
        up.kill()
        _reap(seen)


def test_a_second_up_on_a_store_dir_in_use_is_refused(tmp_path, monkeypatch, capsys):
    up, url, server = start_up(tmp_path, "--port", "0")
    try:
        second = Proc(tmp_path, "up", "--port", "0", "run=lc", f"run_dir={tmp_path / 'run'}")
        try:
            rc = second.wait(timeout_s=60)
        except subprocess.TimeoutExpired:
            started = psutil.Process(second.pid).children(recursive=True)
            second.kill()
            _reap(started)
            raise AssertionError("a second `specbus up` serves the same store dir") from None
        assert rc == 1
        out = "".join(second.lines)
        assert "is in use" in out and "not starting a second nats-server" in out, out
        assert f"pid {up.pid}" in out and f"server pid {server.pid}" in out and url in out, out

        # Another run's commands do not use it (it serves run lc), but name it (issue 34).
        monkeypatch.setenv("SPECBUS_STATE_DIR", str(tmp_path / "state"))
        assert main(["status", "run=other", f"run_dir={tmp_path / 'other'}"]) == 2
        err = capsys.readouterr().err
        assert "no broker for run 'other'" in err and f"{url} (`specbus up` of run 'lc'" in err
    finally:
        up.proc.send_signal(signal.SIGINT)
        assert up.wait() == 0
        _reap([server])


def test_kill_9_of_up_leaves_no_nats_server(tmp_path):
    up, _, server = start_up(tmp_path, "--port", "0")
    try:
        assert _running(server)
        up.kill()
        assert not gone([server]), "nats-server outlived its `specbus up` (orphan)"
    finally:
        _reap([server])


def test_sigterm_to_up_stops_the_server_and_frees_the_store_dir(tmp_path):
    up, url, server = start_up(tmp_path, "--port", "0")
    seen = [server]
    try:
        up.proc.send_signal(signal.SIGTERM)
        assert up.wait() == 0
        assert not gone([server])
        # The store dir is free and the port pinned: the next start is on the same URL.
        up, url2, server = start_up(tmp_path)
        seen.append(server)
        assert url2 == url
        up.proc.send_signal(signal.SIGTERM)
        assert up.wait() == 0
        assert not gone([server])
    finally:
        up.kill()
        _reap(seen)


def test_sigterm_to_demo_stops_every_child_and_removes_its_shm(tmp_path, tiny_target, run_id):
    from tests.fixtures.pipeline import write_tokenised_data

    data = write_tokenised_data(tmp_path / "data.jsonl", 2000)  # more than it trains on here
    config = tmp_path / "demo.yaml"
    config.write_text(
        f"run: {run_id}\nrun_dir: {tmp_path / 'run'}\n"
        f"store: {{uri: 'shm://{run_id}', budget_bytes: 67108864}}\n"
        f"target: {{model: '{tiny_target}', capture_batch: 4}}\n"
        "strategy: {ttt_length: 2, draft: {draft_vocab_size: 64}}\n"
        f"data: {{source: '{data}', max_length: 64, holdout: 8}}\n"
        "training: {micro_batch: 2, accumulation: 1, total_steps: 100000, checkpoint_every: 100000}\n"
        "bus: {ack_wait_s: 4.0, heartbeat_s: 1.0, fetch_timeout_s: 0.2}\n"
    )
    shm = Path("/dev/shm") / f"specbus-{run_id}"
    demo = Proc(tmp_path, "demo", "--config", str(config), "--trainers", "1", "--producers", "1")
    children: list[psutil.Process] = []
    try:
        demo.expect(r"^embedded nats-server on")
        # Signal once the children hold the shm store (a producer or trainer opened it).
        deadline = time.monotonic() + 300
        while not (shm.is_dir() and any((shm / "procs").glob("*"))):
            assert time.monotonic() < deadline and demo.proc.poll() is None, demo.lines
            time.sleep(0.05)
        children = psutil.Process(demo.pid).children(recursive=True)
        names = {c.name() for c in children if _running(c)}
        assert "nats-server" in names, names
        demo.proc.send_signal(signal.SIGTERM)
        assert demo.wait(timeout_s=120) == 128 + signal.SIGTERM
        assert not gone(children), "children outlived `specbus demo` after SIGTERM"
        assert not shm.exists(), f"{shm} left behind"
    finally:
        demo.kill()
        _reap(children)


@pytest.mark.mooncake
def test_a_broker_restart_keeps_the_mooncake_store_and_its_objects(tmp_path, store_id):
    pytest.importorskip("mooncake.store")
    import torch
    from specbus.core.config import MooncakeConfig
    from specbus.core.store import open_store

    store_args = (
        "--store",
        "mooncake",
        "-o",
        f"store.uri=mooncake://{store_id}",
        "-o",
        f"store.mooncake.segment_bytes={64 << 20}",
    )
    up, url, server = start_up(tmp_path, "--port", "0", *store_args)
    # `specbus store` (the supervisor), mooncake_master and the store node.
    store_procs = [c for c in psutil.Process(up.pid).children(recursive=True) if c != server]
    seen = [server, *store_procs]
    store = None
    try:
        # The interpreter's process name is python, python3 or python3.12 by install.
        names = {re.sub(r"^python[\d.]*$", "python", c.name()) for c in store_procs}
        assert {"mooncake_master", "python"} <= names, store_procs
        line = next(x for x in up.lines if "mooncake store ready" in x)
        uri = re.search(r"store\.uri=(\S+)", line).group(1)
        store = open_store(uri, mooncake=MooncakeConfig(buffer_bytes=16 << 20))
        specs = store.put("s0", {"h": torch.arange(1000)})

        # kill -9 of nats-server: `specbus up` restarts it; the store is not touched.
        server.kill()
        url2, pid = up.expect(r"restarted at (nats://\S+) \(pid (\d+)").groups()
        server = psutil.Process(int(pid))
        seen.append(server)
        assert url2 == url
        assert torch.equal(store.get(specs)["h"], torch.arange(1000))

        # kill -9 of `specbus up` (and so of its server): the store lives on, and the next
        # `specbus up --store mooncake` adopts it with the same store.uri.
        up.kill()
        assert not gone([server])
        assert all(_running(p) for p in store_procs), "the store died with the broker"
        up, url3, server = start_up(tmp_path, *store_args)
        seen.append(server)
        assert url3 == url
        line = next(x for x in up.lines if "mooncake store ready" in x)
        assert f"store.uri={uri} " in line and "adopted" in line, line
        assert torch.equal(store.get(specs)["h"], torch.arange(1000))
        store.release(specs)

        # SIGTERM to `specbus up` stops everything, the adopted store included.
        up.proc.send_signal(signal.SIGTERM)
        assert up.wait() == 0
        assert not gone([server, *store_procs]), "children left after SIGTERM"
    finally:
        if store is not None:
            store.close()
        up.kill()
        _reap(seen)


def test_up_with_auth_serves_on_the_port_given(tmp_path):
    """`specbus up --auth DIR --port P` listens on P (it took a free port instead: issue 33),
    with the role users in force there, and declares the run through it."""
    from specbus.ops.services.common import free_port

    auth = tmp_path / "auth"
    made = Proc(tmp_path, "auth", "--out", str(auth), "run=lc", f"run_dir={tmp_path / 'run'}")
    assert made.wait() == 0, "".join(made.lines)
    port = free_port()
    seen = []
    up = Proc(tmp_path, "up", "--auth", str(auth), "--port", str(port), "run=lc",
              f"run_dir={tmp_path / 'run'}")  # fmt: skip
    try:
        url, pid = up.expect(r"cluster ready at (nats://\S+) \(n1 pid (\d+)").groups()
        seen.append(psutil.Process(int(pid)))
        up.expect(r"run 'lc' declared")  # the admin user connected to `url` and declared
        up.expect(READY)
        assert url == f"nats://127.0.0.1:{port}"
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            info = s.recv(4096)  # what nats-server says first, to anyone: auth is on here
        assert info.startswith(b"INFO ") and json.loads(info[5:])["auth_required"] is True
        assert any(c.laddr.port == port for c in seen[0].net_connections(kind="tcp")
                   if c.status == psutil.CONN_LISTEN)  # fmt: skip
        up.proc.send_signal(signal.SIGTERM)
        assert up.wait() == 0
        assert not gone(seen)
    finally:
        up.kill()
        _reap(seen)
