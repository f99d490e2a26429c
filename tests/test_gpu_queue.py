"""ops/bench/gpu_queue.sh: device work longer than one call, started detached and collected
over later calls (run here with a queue folder under tmp_path and plain shell commands)."""

import os
import subprocess
import tarfile
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "ops" / "bench" / "gpu_queue.sh"


def queue(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "GPU_QUEUE": str(tmp_path / "q"), "OUT": str(tmp_path / "out")}
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True,
                          text=True, timeout=60)  # fmt: skip


def test_a_fresh_machine_has_no_queue_and_the_poll_returns_at_once(tmp_path):
    done = queue(tmp_path, "poll", "50")
    assert done.returncode == 3
    assert "fresh machine" in done.stdout


def test_commands_run_in_order_detached_each_with_its_folders_and_come_back_packed(tmp_path):
    go = tmp_path / "go"
    first = 'echo one; mkdir -p "$OUT"; echo "$PERF" > "$OUT/perf.txt"'
    blocked = f"while [ ! -f {go} ]; do sleep 0.05; done; echo two; exit 7"
    started = queue(tmp_path, "start", "0", first, blocked)
    assert started.returncode == 0, started.stdout + started.stderr
    assert "queue still running" in started.stdout
    # a second queue is refused while this one runs (its commands would interleave)
    again = queue(tmp_path, "start", "0", "echo three")
    assert again.returncode == 2 and "a queue is running" in again.stdout
    go.touch()  # the second command may finish now
    done = queue(tmp_path, "poll", "50")
    assert done.returncode == 0 and "queue done" in done.stdout
    assert "c1 exit 0" in done.stdout and "c2 exit 7" in done.stdout
    with tarfile.open(tmp_path / "out" / "q.tgz") as tar:
        names = set(tar.getnames())
        assert {"./c1.log", "./c2.log", "./progress.txt", "./done", "./c1/perf.txt"} <= names
        assert tar.extractfile("./c1.log").read().decode() == "one\n"
        assert tar.extractfile("./c1/perf.txt").read().decode().strip() == str(
            tmp_path / "q" / "p1"
        )
        assert tar.extractfile("./c2.log").read().decode() == "two\n"
    # a finished queue makes room for the next one
    rerun = queue(tmp_path, "start", "50", "echo four")
    assert rerun.returncode == 0 and "queue done" in rerun.stdout and "c1 exit 0" in rerun.stdout
