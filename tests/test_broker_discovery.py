"""Which broker a command uses without `--url` (ops/discover.py), and what it says when none
answers, with real processes: `python -m specbus.ops.cli up` (one node or a 3-node cluster),
`feed` and `status` as a user runs them (in-process `main` where timing and log lines are
checked), each test with its own announcement state dir.

- a broker the run did not start (another run's `specbus up`, a cluster) is never used unless
  named (`--url`); the command fails at once naming it, and names the `specbus up` to run;
- the machine's shared broker (a plain `specbus up`) serves a run with no broker of its own,
  said in a WARNING line;
- a stopped broker is said within seconds (what was tried, how to start one), not after a
  two-minute silent wait; a named URL is waited for (a process started during an outage) and
  used once a broker serves there.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from specbus.core.config import dump_config
from specbus.ops.cli import main
from specbus.ops.services.common import free_port

from tests.fixtures.pipeline import pipeline_config, write_tokenised_data
from tests.test_broker_lifecycle import READY, ROOT, Proc, _env, _reap, start_up

CLI = [sys.executable, "-m", "specbus.ops.cli"]


def cli(tmp_path: Path, *argv: str, timeout_s: float = 120.0) -> tuple[int, str, float]:
    """Run one `specbus` command to its end: exit code, output (stdout + stderr), seconds."""
    t0 = time.monotonic()
    done = subprocess.run([*CLI, *argv], capture_output=True, text=True, cwd=ROOT,
                          env=_env(tmp_path), timeout=timeout_s)  # fmt: skip
    return done.returncode, done.stdout + done.stderr, time.monotonic() - t0


def stop(up: Proc) -> None:
    up.proc.send_signal(signal.SIGINT)
    assert up.wait() == 0


@pytest.mark.slow
def test_feed_never_publishes_to_a_cluster_another_run_started(tmp_path, tiny_target, run_id):
    """The issue's case: this run's `specbus up` was stopped; another run's `specbus up
    --cluster 3` runs on the machine. `specbus feed` refuses (it published 200 tasks there)."""
    cfg = pipeline_config(run_id, tmp_path / "mine", tiny_target,
                          write_tokenised_data(tmp_path / "data.jsonl", 16), store_uri=f"shm://{run_id}")  # fmt: skip
    config = tmp_path / "mine.yaml"
    config.write_text(dump_config(cfg))
    mine = Proc(tmp_path, "up", "--config", str(config), "--port", "0")
    mine.expect(READY)
    stop(mine)
    other = Proc(tmp_path, "up", "--cluster", "3", "run=other", f"run_dir={tmp_path / 'other'}")
    try:
        cluster_url = other.expect(r"cluster ready at (\S+)").group(1)
        other.expect(READY)
        rc, out, _ = cli(tmp_path, "feed", "--config", str(config))
        assert rc == 2, out
        assert f"the broker of run {run_id!r} is not running" in out, out
        assert f"specbus up --config {config}" in out, out  # how to start it
        assert cluster_url in out and "--cluster 3` of run 'other'" in out, out  # not used
        assert "feeding" not in out, out

        # Nothing of this run reached the cluster; named with --url, the cluster is used.
        rc, out, _ = cli(tmp_path, "status", "--config", str(config), "--url", cluster_url)
        assert rc == 1 and f"run {run_id} @ {cluster_url}" in out and "not declared" in out, out
    finally:
        alive = other.proc.poll() is None
        nodes = psutil.Process(other.pid).children(recursive=True) if alive else []
        other.proc.send_signal(signal.SIGINT)
        other.wait()
        _reap(nodes)


def test_another_runs_broker_is_not_used_the_shared_one_is_said(
    tmp_path, run_id, monkeypatch, capsys, caplog
):
    """A run with no broker of its own uses neither another run's `specbus up` nor anything
    but the machine's shared broker (a plain `specbus up`), and says so."""
    monkeypatch.setenv("SPECBUS_STATE_DIR", str(tmp_path / "state"))
    run = [f"run={run_id}", f"run_dir={tmp_path / 'x'}"]
    theirs, their_url, their_server = start_up(tmp_path, "--port", "0", run="theirs")
    shared = None
    seen = [their_server]
    try:
        assert main(["status", *run]) == 2
        err = capsys.readouterr().err
        assert f"no broker for run {run_id!r}" in err and f"specbus up {' '.join(run)}" in err
        assert f"{their_url} (`specbus up` of run 'theirs'" in err, err  # named, not used

        # A plain `specbus up` (no config: the machine's shared broker) serves the run.
        shared = Proc(tmp_path, "up", "--port", "0", "--store-dir", str(tmp_path / "shared"))
        shared_url = shared.expect(r"ready at (nats://127\.0\.0\.1:\d+)").group(1)
        shared.expect(READY)
        with caplog.at_level(logging.INFO, logger="specbus"):
            assert main(["status", *run]) == 1  # not declared there yet
        assert f"run {run_id} @ {shared_url}" in capsys.readouterr().out
        said = [r for r in caplog.records if f"broker {shared_url}" in r.getMessage()]
        assert said and said[0].levelno == logging.WARNING, caplog.text
        assert "the machine's shared broker" in said[0].getMessage(), caplog.text
    finally:
        if shared is not None:
            stop(shared)
        stop(theirs)
        _reap(seen)


def in_thread(argv: list[str]) -> tuple[threading.Thread, dict]:
    """`main(argv)` in a thread of this process (its exit code lands in the box): the time a
    command takes to say something is measured without the interpreter's own start."""
    box: dict = {}
    thread = threading.Thread(target=lambda: box.setdefault("rc", main(argv)), daemon=True)
    thread.start()
    return thread, box


def test_a_stopped_broker_is_said_at_once_with_how_to_start_it(
    tmp_path, run_id, monkeypatch, capsys
):
    """Item 2 of issue 34: this run's broker was stopped, and `specbus status` waited two
    silent minutes before "cannot connect". Now it fails at once (< 5 s), saying what it tried
    and the `specbus up` that starts it."""
    up, url, server = start_up(tmp_path, "--port", "0", run=run_id)
    stop(up)
    _reap([server])
    monkeypatch.setenv("SPECBUS_STATE_DIR", str(tmp_path / "state"))
    run = [f"run={run_id}", f"run_dir={tmp_path / 'run'}"]
    t0 = time.monotonic()
    thread, box = in_thread(["status", *run])
    thread.join(timeout=20)
    took = time.monotonic() - t0
    assert not thread.is_alive(), "still waiting for a broker after 20 s"
    err = capsys.readouterr().err
    assert box["rc"] == 2 and took < 5.0, (took, err)
    assert f"is not running (it listened at {url}" in err, err
    assert f"specbus up {' '.join(run)}" in err and "--wait" in err, err


def test_a_named_url_is_waited_for_with_a_clear_line_then_used(
    tmp_path, run_id, caplog, capsys, monkeypatch
):
    """A process given a broker's URL and started before the broker (an outage, another host
    not up yet) says at once that nothing answers there and how to start one, keeps waiting
    with a progress line, and carries on once `specbus up` serves on that port."""
    from specbus.ops import discover

    monkeypatch.setattr(discover, "PROGRESS_S", 0.5)  # the progress line, without 15 s of waiting
    port = free_port()
    url = f"nats://127.0.0.1:{port}"
    argv = ["status", "--url", url, f"run={run_id}", f"run_dir={tmp_path / 'run'}"]
    up = None
    seen = []
    with caplog.at_level(logging.INFO, logger="specbus"):
        t0 = time.monotonic()
        thread, box = in_thread(argv)

        def said() -> str | None:
            return next((r.getMessage() for r in caplog.records
                         if f"no broker answers at {url}" in r.getMessage()), None)  # fmt: skip

        while (line := said()) is None and time.monotonic() - t0 < 20:
            assert thread.is_alive(), box
            time.sleep(0.02)
        took = time.monotonic() - t0
        try:
            assert line is not None and took < 5.0, (took, caplog.text)
            assert "specbus up" in line and "waiting for it until" in line, line
            while "still no broker at" not in caplog.text:  # the progress line
                assert thread.is_alive() and time.monotonic() - t0 < 20, (box, caplog.text)
                time.sleep(0.05)
            up, _, server = start_up(tmp_path, "--port", str(port), run=run_id)
            seen.append(server)
            thread.join(timeout=60)
            assert not thread.is_alive(), caplog.text
            # 1: it may read the broker before `specbus up` declared the run there
            assert box["rc"] in (0, 1), (box, caplog.text)
            assert f"run {run_id} @ {url}" in capsys.readouterr().out
            assert f"broker {url} answers after" in caplog.text
        finally:
            if up is not None:
                stop(up)
            _reap(seen)


def test_a_broker_started_with_the_same_config_elsewhere_is_this_runs(
    tmp_path, run_id, monkeypatch, capsys, caplog
):
    """`specbus up --config C --store-dir D` serves C's run: commands with C find it though it
    is not on the run dir's store; the same run name from another config file does not."""
    monkeypatch.setenv("SPECBUS_STATE_DIR", str(tmp_path / "state"))
    config = tmp_path / "c.yaml"
    config.write_text(f"run: {run_id}\nrun_dir: {tmp_path / 'run'}\n")
    up = Proc(tmp_path, "up", "--config", str(config), "--store-dir", str(tmp_path / "d"),
              "--port", "0")  # fmt: skip
    try:
        url = up.expect(r"ready at (nats://127\.0\.0\.1:\d+)").group(1)
        up.expect(READY)
        with caplog.at_level(logging.INFO, logger="specbus"):
            assert main(["status", "--config", str(config)]) == 0
        assert f"run {run_id} @ {url}" in capsys.readouterr().out
        assert f"this run's broker: `specbus up --config {config}`" in caplog.text
        other = tmp_path / "other.yaml"
        other.write_text(config.read_text())
        assert main(["status", "--config", str(other)]) == 2
        err = capsys.readouterr().err
        assert f"no broker for run {run_id!r}" in err and url in err, err
    finally:
        stop(up)
