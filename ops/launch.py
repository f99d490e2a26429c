"""Launching the processes of a run from Python: ranks, environments, logs, PIDs, stop.

`Launcher` starts named children (`python -m specbus.ops.cli ...` unless told another module),
each with its own log file, and stops them by PID; `ranks` starts trainer ranks under the
torchrun environment contract (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT on a
free loopback port). `specbus demo`, the tests' `Cluster` and the benchmarks all launch
through it; `ops/chaos.py` keeps its own supervisor (start times, orphans).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from specbus.ops.services.common import (
    LOOPBACK,
    dies_with_parent,
    free_port,
    kill_pid,
    stop_pids,
)

# One CPU thread per child unless told otherwise: several processes share the machine.
QUIET_THREADS = {"OMP_NUM_THREADS": "1", "SPECBUS_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def rank_env(rank: int, world: int, port: int, local_rank: int | None = None) -> dict[str, str]:
    """The torchrun environment of trainer rank `rank` of `world` (rendezvous on loopback)."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank if local_rank is None else local_rank),
        "MASTER_ADDR": LOOPBACK,
        "MASTER_PORT": str(port),
    }


class Launcher:
    """Children of this process, by name. `logs`: the directory of `<name>.log` (stdout and
    stderr). `env`: added to this process's environment for every child. `module`: what
    `python -m` runs. `cwd`: the children's working directory. `append`: append to an
    existing log (a restarted child keeps its history). `session`: children run in their
    own session and get SIGTERM when this process dies (a terminal's Ctrl-C reaches only
    this process, which stops them)."""

    def __init__(
        self,
        logs: Path,
        *,
        env: Mapping[str, str] | None = None,
        module: str = "specbus.ops.cli",
        cwd: Path | None = None,
        append: bool = False,
        session: bool = False,
    ):
        self.logs, self.module, self.cwd = Path(logs), module, cwd
        self.env = {**os.environ, **(env or {})}
        self.append, self.session = append, session
        self.logs.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen] = {}

    def start(
        self,
        name: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        show: bool = False,
    ) -> subprocess.Popen:
        """Start `python -m <module> <argv>` as `name` (its stdout on this terminal when
        `show`, else in its log). A name started again replaces the finished one."""
        log = open(self.log_path(name), "a" if self.append else "w")  # noqa: SIM115 - the child owns it
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", self.module, *argv],
                stdout=None if show else log,
                stderr=log if show else subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**self.env, **(env or {})},
                cwd=self.cwd,
                preexec_fn=dies_with_parent() if self.session else None,
                start_new_session=self.session,
            )
        finally:
            log.close()
        self.procs[name] = proc
        return proc

    def ranks(
        self,
        world: int,
        argv: Sequence[str] | Callable[[int], Sequence[str]],
        *,
        name: str = "trainer-{rank}",
        env: Callable[[int], Mapping[str, str]] | None = None,
        local_rank: Callable[[int], int] | None = None,
        show_rank0: bool = False,
    ) -> list[subprocess.Popen]:
        """Start `world` trainer ranks (`argv`, or `argv(rank)`) under the torchrun contract,
        rendezvous on a free loopback port; `env(rank)` adds to a rank's environment,
        `local_rank(rank)` overrides its LOCAL_RANK (one visible GPU per process: 0)."""
        port = free_port()
        out = []
        for rank in range(world):
            local = None if local_rank is None else local_rank(rank)
            child_env = {**rank_env(rank, world, port, local), **(env(rank) if env else {})}
            args = argv(rank) if callable(argv) else argv
            out.append(self.start(name.format(rank=rank), args, env=child_env,
                                  show=show_rank0 and rank == 0))  # fmt: skip
        return out

    def log_path(self, name: str) -> Path:
        """Where child `name` logs."""
        return self.logs / f"{name}.log"

    def log(self, name: str) -> str:
        """Child `name`'s log so far."""
        return self.log_path(name).read_text(errors="replace")

    def failed(self) -> tuple[str, int] | None:
        """The first child that exited with an error, as (name, exit code); None if none."""
        for name, p in self.procs.items():
            if p.poll() not in (None, 0):
                return name, p.returncode
        return None

    def wait(self, *names: str, timeout: float) -> dict[str, int | None]:
        """Exit codes of `names` (all children by default) within `timeout` seconds in all;
        None for one still running at the deadline."""
        deadline = time.monotonic() + timeout
        codes: dict[str, int | None] = {}
        for name in names or tuple(self.procs):
            try:
                codes[name] = self.procs[name].wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                codes[name] = None
        return codes

    def kill(self, name: str) -> None:
        """kill -9 `name` (fault injection) and reap it."""
        kill_pid(self.procs[name])

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM every running child at once, SIGKILL what lingers after `timeout_s`, reap
        all (a trainer saves a checkpoint on SIGTERM: give it the time)."""
        stop_pids(self.procs.values(), timeout_s)
