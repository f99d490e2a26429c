"""Chaos campaign: seeded kill -9 and broker outages over the real processes of one run.

    python -m specbus.ops.chaos --store shm --trials 50 --seed 1
    python -m specbus.ops.chaos --store mooncake --trials 20 --seed 1 --slow
    python -m specbus.ops.chaos --seed 7 --trials 1 --keep          # reproduce one trial
    python -m specbus.ops.chaos --store mooncake --trials 30 --tasks 256 --budget 262144
                                                   # capture paced by a tight store (issue 33)

Each trial is one run on a tiny random target (4 layers, hidden 32) with pre-tokenised data,
started the way users start it, every process by PID on loopback:

- the broker: `specbus up --port P --store-dir D` (the `python -m specbus.ops.cli up` wrapper, which
  runs nats-server as its child). A restart is `specbus up` again on the same port and store
  dir; where `up` refuses (today: "--port P is in use" while the old server's sockets linger,
  or an orphaned nats-server still holds the port) the refusal is a failure of the trial and
  the harness brings the broker back with `ops.services.nats.NatsServer` on the same port and
  dir (or keeps the orphan that still serves), so the remaining checks still say something;
- `--store mooncake`: a mooncake_master + store node of its own (`MooncakeServices`), not
  tied to the broker; with `--budget B` (`store.budget_bytes`, any store) the node's segment
  is sized by it as `specbus store` sizes it (the budget, at least Mooncake's 16 MiB), else
  128 MiB. A tight budget (a few dozen samples of the tiny target's ~7-21 KB) makes capture
  wait for training all the time: the producers wait for room with their leases kept alive,
  and DEAD must stay empty (issue 33);
- the feeder (`specbus feed`), 2 producers (`specbus produce --id pN`), and 2 trainer ranks
  under torchrun (`python -m torch.distributed.run --standalone --nproc-per-node 2 -m specbus.ops.cli
  train`, `--resume` on restarts): when one rank dies, torchrun stops the other.

A trial's plan (from its seed alone) is 1-3 faults, each fired when the trainers' consumer ack
floor (SAMPLES stream sequence, read from the broker) has reached the fault's `at` and has
advanced since the previous fault was repaired, so each lands after an ack in a live run:

    producer[i]  kill -9 producer i; restart it (same --id)
    trainer[r]   kill -9 rank r (found among torchrun's children by its RANK); torchrun stops
                 the other rank and exits; run torchrun again with `train --resume`
    broker       kill -9 nats-server right after the ack floor advanced; `specbus up` again
    up           kill -9 the `specbus up` wrapper; `specbus up` again
    store        (mooncake) kill -9 the store node; start it again
    outageN      stop the broker (SIGTERM to `specbus up`, as Ctrl-C), leave everything else
                 running for N s (2, 10; 60 only with --slow), `specbus up` again
    join         (elastic trials) start one more trainer agent, `specbus train --elastic 1:3`:
                 the world grows by a rank; the harness waits for its first step
    leave        (elastic trials) kill -9 a running trainer agent (its rank dies with it): the
                 world shrinks by a rank; the harness waits for its first step

A trial whose plan has a `join` or `leave` runs its trainers elastic (ops/elastic.py): a
`specbus rendezvous` of its own (so that any agent may die) and two agents of one rank each,
`specbus train --elastic 1:3 --nproc-per-node 1` (world 2, as the other trials); the plan keeps
1 to 3 agents (a `join` at 3 becomes a `leave`, a `leave` at 1 a `join`); a `trainer[r]` kill
in such a trial is left to torchrun (it restarts the agent's rank; nothing is restarted by
hand). Each formation's record (the run KV's `world`) is in the report, with the seconds from
the fault to the new world's first step. `join` and `leave` are not among the default victims
(an elastic trial takes minutes): name them with `--victims`.

A fault "landed" when, at the moment it fired, the trainers had acked (floor >= 1), the
train-complete marker was absent and torchrun was running; the trial report records the
floor, the last step rank 0 logged and the marker. A process that exits non-zero without
being a victim is a failure ("died"); it is restarted as a user would (once the broker is up),
so the checks that follow still measure something.

Checks after the run ends (all processes of the pipeline exited 0 within the deadline):

- lineage: the latest checkpoint's (the prefix of <run_dir>/checkpoints/lineage.jsonl it
  counts) holds every fed sample id (the TASKS stream's dataset tasks, `<task>-e<epoch>`) exactly once (any task
  count: a remainder over world * micro_batch * accumulation is trained in a ragged last
  step);
- broker: the "trainers" and "producers" consumers have nothing pending and nothing
  ack-pending, the DEAD stream is empty, the feed-complete marker holds the task count;
- store: shm: the store directory of the run is gone (no file left); mooncake: the master's
  /metrics `master_allocated_bytes` is back to its value before the run (polled for a while:
  releases under a read lease are retried);
- orphans: after the harness stopped the broker (SIGTERM to `specbus up`) and the store
  services, every PID it started or saw (nats-server, torchrun's ranks) is gone and no
  process's command line contains the trial directory.

Output: one line per trial (seed, plan, result, seconds), then per-victim counts; the exit
status is non-zero when a trial failed. A failing trial's directory (every process's log, the
plan, report.json) is kept and its reproduction command printed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORLD, MICRO, ACCUM = 2, 2, 1
WINDOW = WORLD * MICRO * ACCUM
PRODUCERS = 2
KILLS = ("producer", "trainer", "broker", "up")
OUTAGES = {"outage2": 2.0, "outage10": 10.0, "outage60": 60.0}
ELASTIC = ("join", "leave")  # trainer agents joining / dying: the trial's trainers are elastic
ELASTIC_AGENTS = (1, 2, 3)  # an elastic trial keeps 1..3 agents of one rank; it starts with 2
ALL_VICTIMS = (*KILLS, "store", *OUTAGES, *ELASTIC)
# Mooncake services of a trial: short read lease, quick node-loss detection (as the tests').
MOONCAKE_FAST = {"lease_ttl_ms": 500, "client_ttl_s": 2, "put_start_timeout_s": 2}
MOONCAKE_SEGMENT = 128 << 20
STARTUP_S = 240.0  # the first fault's trigger also waits this long for the processes to start


# ---------------------------------------------------------------- plans
@dataclass
class Fault:
    victim: str  # one of ALL_VICTIMS
    at: int  # fire once the trainers' ack floor reaches this (and advanced since the last fault)
    index: int | None = None  # producer index / trainer rank
    landed: dict = field(default_factory=dict)  # filled in when it fires

    @property
    def label(self) -> str:
        idx = f"[{self.index}]" if self.index is not None else ""
        return f"{self.victim}{idx}@{self.at}"

    @property
    def fired(self) -> str:
        """Where it landed: `t` (trainers') or `p` (producers') ack floor, rank 0's last step."""
        d = self.landed
        if "ack_floor" not in d:
            return "missed" if d else "not-fired"
        return f"{d['group'][0]}{d['ack_floor']}/step{d.get('last_step_logged')}"


def dev_namespace(code: Path) -> Path:
    """`code/.dev`, holding `specbus/<folder>` links to the checkout's folders: the checkout
    importable as the `specbus` namespace without installing it (README, Development)."""
    ns = code / ".dev" / "specbus"
    ns.mkdir(parents=True, exist_ok=True)
    for folder in ("core", "bus", "producers", "consumers", "ops", "patches"):
        link = ns / folder
        if not link.exists():
            link.symlink_to(code / folder)
    return code / ".dev"


@dataclass
class Plan:
    seed: int
    store: str
    tasks: int
    faults: list[Fault]

    @property
    def label(self) -> str:
        return " ".join(f.label for f in self.faults) or "no-fault"


def victims_for(store: str, slow: bool) -> list[str]:
    kinds = [*KILLS, "outage2", "outage10"]
    if store == "mooncake":
        kinds.append("store")
    if slow:
        kinds.append("outage60")
    return kinds


def make_plan(
    seed: int,
    *,
    store: str = "shm",
    tasks: int = 2048,
    slow: bool = False,
    victims: list[str] | None = None,
    faults: tuple[int, int] = (1, 3),
) -> Plan:
    """The plan of trial `seed`: depends only on the arguments (reproducible)."""
    if tasks < WINDOW:
        raise ValueError(f"--tasks must be at least one step ({WINDOW}): faults fire after one")
    rng = random.Random(f"specbus-chaos:{seed}:{store}")
    kinds = victims or victims_for(store, slow)
    n = rng.randint(*faults)
    # Fire between the first full window and 60 % of the run, in increasing order (what is
    # left must outlast the repairs that do not stop training); 30 % where agents may join or
    # leave: a re-formation takes about a minute on 2 cores, and the world must step after it.
    share = 0.3 if set(kinds) & set(ELASTIC) else 0.6
    lo, hi = WINDOW, max(WINDOW, int(tasks * share))
    ats = sorted(rng.randint(lo, hi) for _ in range(n))
    out = []
    agents = 2  # an elastic trial's agents (join/leave keep them within ELASTIC_AGENTS)
    for at in ats:
        victim = rng.choice(kinds)
        index = (
            rng.randrange(PRODUCERS)
            if victim == "producer"
            else rng.randrange(WORLD)
            if victim == "trainer"
            else None
        )
        if victim in ELASTIC:
            if victim == "join" and agents == ELASTIC_AGENTS[-1]:
                victim = "leave"
            elif victim == "leave" and agents == ELASTIC_AGENTS[0]:
                victim = "join"
            agents += 1 if victim == "join" else -1
            index = rng.randrange(agents + 1) if victim == "leave" else None  # which agent
        out.append(Fault(victim, at, index))
    return Plan(seed, store, tasks, out)


# ---------------------------------------------------------------- processes
def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def _start_time(pid: int) -> int | None:
    """The process's start time (clock ticks since boot): a pid plus this names one process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


class Pids:
    """PIDs the harness started or saw, each with its start time (a reused PID is not ours)."""

    def __init__(self):
        self.seen: dict[int, int | None] = {}

    def add(self, pid: int) -> None:
        self.seen.setdefault(pid, _start_time(pid))

    def update(self, pids) -> None:
        for pid in pids:
            self.add(pid)

    def ours(self, pid: int | None) -> bool:
        """`pid` is alive and still the process recorded under it."""
        return pid in self.seen and _alive(pid) and _start_time(pid) == self.seen[pid]

    def alive(self) -> list[int]:
        return [p for p, t in self.seen.items() if _alive(p) and _start_time(p) == t]


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _environ(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            items = f.read().split(b"\0")
    except OSError:
        return {}
    return dict(i.decode(errors="replace").split("=", 1) for i in items if b"=" in i)


def _children(pid: int) -> list[int]:
    """Every descendant of `pid` (from /proc/*/stat parent links)."""
    parents: dict[int, list[int]] = defaultdict(list)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents[ppid].append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _procs_mentioning(text: str) -> list[tuple[int, str]]:
    me = os.getpid()
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != me:
            cmd = _cmdline(int(entry))
            if text in cmd and _alive(int(entry)):
                out.append((int(entry), cmd))
    return out


def _sigkill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _metric_rows(logs: Path) -> list[dict]:
    """Rank 0's log rows (`<run_dir>/logs/metrics.jsonl`), a torn line skipped."""
    rows = []
    try:
        lines = (logs / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return rows
    for line in lines:
        with contextlib.suppress(ValueError):
            rows.append(json.loads(line))
    return rows


def _port_open(port: int) -> bool:
    import socket

    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


def _wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return not _alive(pid)


class Role:
    """One process a user runs (a feeder, a producer, torchrun, `specbus up`), by incarnations."""

    def __init__(self, trial: Trial, name: str, argv_of, *, restart_argv_of=None):
        self.trial, self.name = trial, name
        self.argv_of, self.restart_argv_of = argv_of, restart_argv_of or argv_of
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self.expected_exit = False  # the harness killed/stopped it
        self.death_seen = False  # an unexpected exit was recorded (restart pending)
        self.done = False  # exited 0
        self.log_path = trial.dir / f"{name}.log"

    def start(self) -> subprocess.Popen:
        argv = (self.argv_of if self.starts == 0 else self.restart_argv_of)()
        self.starts += 1
        self.expected_exit = self.done = self.death_seen = False
        with open(self.log_path, "a") as log:
            log.write(
                f"=== chaos: start {self.starts} at t={self.trial.t():.1f}s: {' '.join(argv)}\n"
            )
            log.flush()
            self.proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=self.trial.env, cwd=self.trial.dir,
            )  # fmt: skip
        self.trial.pids.add(self.proc.pid)
        return self.proc

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        if self.proc is not None:
            self.expected_exit = True
            _sigkill(self.proc.pid)
            self.proc.wait(timeout=30)

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.running:
            self.expected_exit = True
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)

    def tail(self, n: int = 15) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def last_error(self) -> str:
        """The error of the latest incarnation: its first `specbus X: error:` or specbus error
        (core.errors), else its last exception line with a message, else its last line."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        lines = [
            ln.strip()
            for ln in text.rsplit("=== chaos: start", 1)[-1].splitlines()[1:]
            if " WARNING " not in ln and "ChildFailedError" not in ln
        ]
        for pattern in (r"specbus \w+: error:", r"core\.errors\.\w+: "):
            for line in lines:
                if re.search(pattern, line):
                    return line[:300]
        for line in reversed(lines):
            if re.search(r"^(\[rank\d+\]: )?[\w.]*(Error|Exception): \S", line):
                return line[:300]
        return lines[-1][:300] if lines else ""


# ---------------------------------------------------------------- the broker
class Broker:
    """The broker of a trial on a fixed port and store dir: `specbus up` first, NatsServer
    where `up` refuses to start (recorded), an orphaned nats-server adopted when it serves."""

    def __init__(self, trial: Trial, port: int):
        self.trial, self.port = trial, port
        self.store_dir = trial.dir / "nats"
        self.url = f"nats://127.0.0.1:{port}"
        self.up = Role(trial, "up", self._up_argv)
        self.direct = None  # ops.services.nats.NatsServer when `up` refused
        self.server_pid: int | None = None
        self.down_since: float | None = None
        self.up_since = time.monotonic()

    def _up_argv(self) -> list[str]:
        return [sys.executable, "-m", "specbus.ops.cli", "up", "--config", str(self.trial.config_path),
                "--port", str(self.port), "--store-dir", str(self.store_dir)]  # fmt: skip

    @property
    def wrapper_running(self) -> bool:
        return self.up.running

    def serving(self) -> bool:
        return self.trial.pids.ours(self.server_pid)

    def start(self, timeout_s: float = 60.0) -> None:
        """`specbus up` on the same port and store dir; wait for its ready line."""
        offset = self.up.log_path.stat().st_size if self.up.log_path.exists() else 0
        proc = self.up.start()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            text = self.up.log_path.read_text(errors="replace")[offset:]
            m = re.search(r"nats-server ready at \S+ \(pid (\d+)", text)
            # `up`'s own ready line (with the server's pid); or, should `up` exec nats-server
            # (or print otherwise), the server's "Server is ready" from a nats-server process
            # that is `up` itself or one of its descendants.
            pid = int(m.group(1)) if m and "Ctrl-C to stop" in text else None
            if pid is None and "Server is ready" in text:
                pid = next(
                    (p for p in [proc.pid, *_children(proc.pid)] if "nats-server" in _cmdline(p).split(" ")[0]),
                    None,
                )  # fmt: skip
            if pid is not None:
                self.server_pid = pid
                self.trial.pids.add(pid)
                self._is_up()
                return
            if proc.poll() is not None:
                self.up.expected_exit = True  # accounted for here, not as a death
                self.trial.fail(
                    "broker_restart",
                    f"`specbus up --port {self.port}` refused (exit {proc.returncode}): "
                    f"{self.up.last_error()}",
                )
                self._fallback(timeout_s)
                return
            time.sleep(0.05)
        raise TrialError(f"specbus up not ready in {timeout_s}s:\n{self.up.tail()}")

    def _fallback(self, timeout_s: float) -> None:
        if self.serving():  # an orphaned nats-server of a killed wrapper still holds the port
            self.trial.note(f"broker: nats-server pid {self.server_pid} still serves (orphan)")
            self._is_up()
            return
        from specbus.ops.services.nats import NatsServer

        self.direct = NatsServer(self.store_dir, port=self.port).start(timeout_s)
        self.server_pid = self.direct.pid
        self.trial.pids.add(self.server_pid)
        self.trial.note(f"broker: started nats-server directly (pid {self.server_pid})")
        self._is_up()

    def _is_up(self) -> None:
        if self.down_since is not None:
            self.up_since = time.monotonic()
        self.down_since = None

    def state(self) -> str:
        if self.down_since is not None:
            return f"broker down for {time.monotonic() - self.down_since:.1f}s"
        return f"broker up for {time.monotonic() - self.up_since:.1f}s"

    def kill_server(self) -> bool:
        """kill -9 nats-server. `specbus up` notices and exits (then the harness runs it again:
        returns False), or brings a new server up itself on the same port (returns True)."""
        old = self.server_pid
        self.up.expected_exit = True
        if self.direct is not None and self.direct.pid == old:
            self.direct.kill()  # kill -9 and reap
            self.direct = None
        elif self.trial.pids.ours(old):
            _sigkill(old)
            _wait_gone(old, 10)
        self.down_since = time.monotonic()
        if not self.up.running:
            return False
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if not self.up.running:
                return False
            for pid in _children(self.up.proc.pid):
                if (
                    pid != old
                    and "nats-server" in _cmdline(pid).split(" ")[0]
                    and _port_open(self.port)
                ):
                    self.server_pid = pid
                    self.trial.pids.add(pid)
                    self.trial.note(
                        f"broker: `specbus up` restarted nats-server itself (pid {pid})"
                    )
                    self.up.expected_exit = False
                    self._is_up()
                    return True
            time.sleep(0.05)
        self.trial.fail(
            "broker", "`specbus up` neither exited nor served again 15 s after its nats-server died"
        )
        self.up.kill()
        return False

    def kill_wrapper(self) -> None:
        self.up.kill()
        # A server tied to its wrapper (death signal) gets a moment to shut down.
        if self.server_pid and not _wait_gone(self.server_pid, 2):
            self.trial.note(f"up killed: its nats-server (pid {self.server_pid}) still runs")
        else:
            self.down_since = time.monotonic()

    def stop(self, *, orphan_too: bool = True) -> None:
        """What Ctrl-C does: SIGTERM to `specbus up` (or to the server the harness started
        directly). `orphan_too`: also SIGTERM a nats-server whose wrapper is gone (an outage
        must take the broker down); the final stop leaves it to the orphan check."""
        if self.up.running:
            self.up.stop(timeout_s=15)
        if self.direct is not None:
            self.direct.stop()
            self.direct = None
        if orphan_too and self.serving():
            os.kill(self.server_pid, signal.SIGTERM)
            if not _wait_gone(self.server_pid, 10):
                _sigkill(self.server_pid)
        self.down_since = time.monotonic()


# ---------------------------------------------------------------- broker probe
class Probe:
    """A broker connection on a loop thread, for the harness's reads of stream/consumer state."""

    def __init__(self, url: str, run: str):
        import logging

        # The probe's own reconnect lines would interleave with the trial lines.
        logging.getLogger("specbus.bus").addFilter(lambda r: "chaos-probe" not in r.getMessage())
        self.url, self.run = url, run
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.bus = None

    def _call(self, coro, timeout_s: float = 5.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    async def _bus(self):
        from specbus.bus.connection import connect
        from specbus.core.config import BusConfig

        if self.bus is None or self.bus.nc.is_closed:
            cfg = BusConfig(connect_timeout_s=2.0, reconnect_wait_s=0.2)
            self.bus = await connect(cfg, self.url, name="chaos-probe")
        return self.bus

    async def _consumer(self, stream: str, group: str) -> dict:
        bus = await self._bus()
        info = await bus.js.consumer_info(stream, group, timeout=1.0)
        return {
            "pending": info.num_pending,
            "ack_pending": info.num_ack_pending,
            "redelivered": info.num_redelivered,
            "delivered": info.delivered.stream_seq if info.delivered else 0,
            "ack_floor": info.ack_floor.stream_seq if info.ack_floor else 0,
        }

    def consumer(self, group: str) -> dict | None:
        """The consumer's state, None while the broker does not answer."""
        from specbus.bus.subjects import Names

        names = Names(self.run)
        try:
            return self._call(self._consumer(names.stream_of(group), group), 3.0)
        except Exception:
            return None

    async def _kv(self, key: str):
        bus = await self._bus()
        from specbus.bus.subjects import Names

        kv = await bus.js.key_value(Names(self.run).kv_bucket)
        try:
            entry = await kv.get(key)
        except Exception as e:
            if "not found" in str(e).lower() or type(e).__name__ == "KeyNotFoundError":
                return None
            raise
        return json.loads(entry.value) if entry.value else None

    def kv(self, key: str, default="?"):
        """A run KV value (None: absent; `default` when the broker does not answer)."""
        try:
            return self._call(self._kv(key), 3.0)
        except Exception:
            return default

    async def _final(self) -> dict:
        from specbus.bus.replay import replay
        from specbus.bus.subjects import PRODUCERS as P
        from specbus.bus.subjects import TRAINERS as T
        from specbus.bus.subjects import Names
        from specbus.core.contracts import PromptTask

        names = Names(self.run)
        bus = await self._bus()
        out = {
            "trainers": await self._consumer(names.samples_stream, T),
            "producers": await self._consumer(names.tasks_stream, P),
        }
        streams = {}
        for s in (names.tasks_stream, names.samples_stream, names.dead_stream):
            st = (await bus.js.stream_info(s)).state
            streams[s] = {"messages": st.messages, "last_seq": st.last_seq}
        out["streams"] = streams
        out["dead"] = streams[names.dead_stream]["messages"]
        if out["dead"]:
            from specbus.bus.dead import list_dead

            out["dead_letters"] = [
                f"{d.kind} {d.reason} {d.stream}#{d.seq} x{d.deliveries} {d.detail[:160]}"
                for d in await list_dead(bus, self.run)
            ]
        fed = set()
        async for m in replay(bus, names.tasks_stream):
            task = PromptTask.from_bytes(m.data)
            if task.source == "dataset":
                fed.add(f"{task.task_id}-e{task.epoch}")
        out["fed"] = sorted(fed)
        out["feed_complete"] = await self._kv("feed_complete")
        out["train_complete"] = await self._kv("train_complete")
        return out

    def final(self, timeout_s: float = 30.0) -> dict:
        return self._call(self._final(), timeout_s)

    def close(self) -> None:
        if self.bus is not None:
            with contextlib.suppress(Exception):
                self._call(self.bus.close(), 5.0)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)


# ---------------------------------------------------------------- a trial
class TrialError(RuntimeError):
    """The harness could not run the trial (not a verdict on the system)."""


@dataclass
class Options:
    work: Path
    store: str = "shm"
    tasks: int = 2048
    slow: bool = False
    code: Path = ROOT  # the checkout whose `ops.cli` the processes run
    deadline_s: float = 240.0  # for the run to end after the last fault (plus outages)
    keep: bool = False
    budget: int | None = None  # store.budget_bytes (None: the test config's 64 MiB)


class Trial:
    def __init__(self, plan: Plan, opts: Options, assets: dict[str, Path]):
        from specbus.ops.services.common import free_port

        self.plan, self.opts, self.assets = plan, opts, assets
        self.run = (
            f"chaos{plan.seed}{plan.store[0]}{os.getpid() % 10000}x{random.randrange(1 << 16):x}"
        )
        base = Path(opts.work) / f"trial-{plan.store}-{plan.seed}"
        self.dir, n = base, 1
        while self.dir.exists():  # an earlier trial of this seed (other victims) kept its logs
            n += 1
            self.dir = base.with_name(f"{base.name}.{n}")
        self.dir.mkdir(parents=True)
        self.t0 = time.monotonic()
        self.pids = Pids()
        self.failures: list[tuple[str, str]] = []
        self.notes: list[str] = []
        self.deaths: list[dict] = []
        self.port = free_port()
        self.mooncake = None
        self.probe: Probe | None = None
        pypath = [str(dev_namespace(opts.code)), str(opts.code),
                  *filter(None, os.environ.get("PYTHONPATH", "").split(":"))]  # fmt: skip
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", "SPECBUS_THREADS": "1",
                    "PYTHONPATH": ":".join(dict.fromkeys(pypath)), "HF_HUB_OFFLINE": "1",
                    "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip
        self.config_path = self.dir / "run.yaml"
        self.shm_dir: Path | None = None
        self.mc_baseline = 0
        self.elastic = any(f.victim in ELASTIC for f in plan.faults)
        self.rendezvous: Role | None = None  # an elastic trial's `specbus rendezvous`
        self.departed: list[Role] = []  # agents a `leave` killed (out of `roles`)
        self.agents_started = 0

    # -- bookkeeping
    def t(self) -> float:
        return time.monotonic() - self.t0

    def fail(self, check: str, detail: str) -> None:
        self.failures.append((check, detail))
        self.note(f"FAIL {check}: {detail}")

    def note(self, line: str) -> None:
        self.notes.append(f"{self.t():6.1f}s {line}")

    # -- setup
    def _config(self):
        from specbus.core.config import dump_config

        from tests.fixtures.pipeline import pipeline_config

        overrides = ["training.checkpoint_every=5", f"training.micro_batch={MICRO}",
                     f"training.accumulation={ACCUM}", "target.capture_batch=2"]  # fmt: skip
        if self.opts.budget is not None:
            overrides.append(f"store.budget_bytes={self.opts.budget}")
        if self.plan.store == "mooncake":
            from specbus.core.store.mooncake import mooncake_uri

            mc = self.mooncake.config()
            store_uri = mooncake_uri(f"s{self.run}", mc)
            overrides += ["store.mooncake.buffer_bytes=33554432",
                          "store.mooncake.release_retry_s=0.2",
                          "store.mooncake.force_release_after_s=3.0",
                          f"store.mooncake.segment_bytes={self.mooncake.segment_bytes}"]  # fmt: skip
        else:
            store_uri = f"shm://{self.run}"
            from specbus.core.store.shm import SHM_ROOT

            self.shm_dir = SHM_ROOT / f"specbus-{self.run}"
        cfg = pipeline_config(
            self.run, self.dir / "run", self.assets["target"], self.assets["data"],
            store_uri=store_uri, overrides=overrides,
        )  # fmt: skip
        self.cfg = cfg
        self.config_path.write_text(dump_config(cfg))

    def _cli(self, command: str, *extra: str) -> list[str]:
        return [sys.executable, "-m", "specbus.ops.cli", command, "--config", str(self.config_path),
                "--url", self.broker.url, *extra]  # fmt: skip

    def _torchrun(self, resume: bool) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", str(WORLD), "-m", "specbus.ops.cli", "train",
                "--config", str(self.config_path), "--url", self.broker.url,
                *(["--resume"] if resume else [])]  # fmt: skip

    def setup(self) -> None:
        (self.dir / "plan.json").write_text(json.dumps(asdict(self.plan), indent=2))
        if self.plan.store == "mooncake":
            from specbus.core.store.mooncake_admin import segment_bytes_for
            from specbus.ops.services.mooncake import MooncakeServices

            segment = (
                MOONCAKE_SEGMENT
                if self.opts.budget is None
                else segment_bytes_for(self.opts.budget, None)  # as `specbus store` sizes it
            )
            self.mooncake = MooncakeServices(
                self.dir / "mooncake", segment_bytes=segment, **MOONCAKE_FAST
            ).start()
            self.pids.update(p.pid for p in (self.mooncake.master, self.mooncake.node))
            self.mc_baseline = self._mc_allocated()
        self.broker = Broker(self, self.port)
        self._config()
        self.broker.start()
        self.probe = Probe(self.broker.url, self.run)
        self.roles: dict[str, Role] = {"feeder": Role(self, "feeder", lambda: self._cli("feed"))}
        for i in range(PRODUCERS):
            self.roles[f"producer-{i}"] = Role(
                self, f"producer-{i}", lambda i=i: self._cli("produce", "--id", f"p{i}")
            )
        if self.elastic:
            self._setup_elastic()
            return
        self.roles["trainers"] = Role(
            self,
            "trainers",
            lambda: self._torchrun(False),
            restart_argv_of=lambda: self._torchrun(True),
        )

    def launch(self) -> None:
        for role in self.roles.values():
            role.start()

    # -- elastic trainers (join / leave)
    def _setup_elastic(self) -> None:
        """A rendezvous of its own (any agent may then die) and the first two agents."""
        from specbus.ops.services.common import free_port

        self.rdzv_endpoint = f"127.0.0.1:{free_port()}"
        self.rendezvous = Role(self, "rendezvous", lambda: [
            sys.executable, "-m", "specbus.ops.cli", "rendezvous", "--rdzv-endpoint",
            self.rdzv_endpoint])  # fmt: skip
        self.rendezvous.start()
        self.wait_until(
            lambda: "rendezvous of the elastic trainers at" in self.rendezvous.tail(5),
            60.0, "the rendezvous",
        )  # fmt: skip
        for _ in range(2):
            self._add_agent()

    def _add_agent(self) -> Role:
        """One more trainer agent (started by `launch`, or by a `join`)."""
        name = "trainers" if self.agents_started == 0 else f"trainers-{self.agents_started}"
        self.agents_started += 1
        role = Role(self, name, lambda: self._cli(
            "train", "--elastic", f"1:{ELASTIC_AGENTS[-1]}", "--nproc-per-node", "1",
            "--rdzv-endpoint", self.rdzv_endpoint))  # fmt: skip
        self.roles[name] = role
        return role

    def _trainer_roles(self) -> list[Role]:
        return [r for n, r in self.roles.items() if n == "trainers" or n.startswith("trainers-")]

    def _trainers_running(self) -> bool:
        return any(r.running for r in self._trainer_roles())

    def _trainers_done(self) -> bool:
        return all(r.done for r in self._trainer_roles())

    def _fire_elastic(self, fault: Fault) -> None:
        """join: one more agent; leave: kill -9 a running agent (its rank dies with it);
        trainer[r] under elastic agents: kill -9 rank r and let its agent re-form. Then wait
        for the next world's first step (the run KV's `world`) and record it in the fault."""
        before = self.probe.kv("world", None) or {}
        t_fire, size = time.time(), before.get("world")
        if fault.victim == "join":
            self._add_agent().start()
            expected = None if size is None else size + 1
        elif fault.victim == "leave":
            running = [r for r in self._trainer_roles() if r.running]
            role = running[(fault.index or 0) % len(running)]
            self.pids.update(_children(role.proc.pid))  # its rank: the orphan check looks
            role.kill()
            self.roles.pop(role.name)
            self.departed.append(role)
            fault.landed["agent"] = role.name
            expected = None if size is None else size - 1
        else:  # the world may be smaller than the plan's rank after a leave: rank 0 then
            pid = self._trainer_pid(fault.index) or self._trainer_pid(0)
            if pid is not None:
                self.pids.add(pid)
                _sigkill(pid)
            expected = size

        def formed():
            world = self.probe.kv("world", None)
            if world and world.get("formation", 0) > before.get("formation", 0):
                return world
            return {"missed": True} if self._trainers_done() else None

        world = self.wait_until(formed, 400.0 + self._outage_total(), "the next world's step")
        if "missed" in world:
            fault.landed["world"] = {"missed": "the run ended before the next world stepped"}
            self.fail("fault_missed", f"{fault.label}: the run ended before a new world stepped")
            return
        fault.landed["world"] = {
            "from": size, "to": world["world"], "formation": world["formation"],
            "fault_to_first_step_s": round(world["at"] - t_fire, 1),
            "since_end_s": world.get("since_end_s"), "retrained": world.get("retrained"),
        }  # fmt: skip
        self.note(f"{fault.label}: {fault.landed['world']}")
        if expected is not None and world["world"] != expected:
            self.fail("reform", f"{fault.label}: a world of {world['world']}, not {expected}")

    # -- supervision
    def supervise(self) -> None:
        """Notice unexpected exits (a failure) and restart the process as a user would."""
        up = self.broker.up
        if up.proc is not None and not up.running and not up.expected_exit:
            self._death(up)
            up.expected_exit = True
            if not self.broker.serving():
                self.broker.down_since = time.monotonic()
                self.broker.start()
        for role in self.roles.values():
            if role.proc is None or role.running or role.done:
                continue
            if role.proc.returncode == 0 and not role.expected_exit:
                role.done = True
                self.note(f"{role.name} exited 0")
                continue
            if role.expected_exit:
                continue  # the fault that killed it restarts it
            if not role.death_seen:
                role.death_seen = True
                self._death(role)
            if self.broker.down_since is not None:
                continue  # restart once the broker is back
            if role.starts >= 6:
                raise TrialError(f"{role.name} died {role.starts} times; giving up")
            role.start()

    def _death(self, role: Role) -> None:
        rc = role.proc.returncode
        broker = self.broker.state()
        self.deaths.append({"role": role.name, "rc": rc, "t": round(self.t(), 1),
                            "broker": broker, "error": role.last_error()})  # fmt: skip
        self.fail("died", f"{role.name} exited {rc} ({broker}): {role.last_error()}")

    def wait_until(self, cond, timeout_s: float, what: str, poll_s: float = 0.05):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.supervise()
            value = cond()
            if value:
                return value
            time.sleep(poll_s)
        raise TrialError(f"timed out after {timeout_s:.0f}s waiting for {what}")

    # -- faults
    def _trainer_pid(self, rank: int) -> int | None:
        for role in self._trainer_roles():
            if not role.running:
                continue
            for pid in _children(role.proc.pid):
                if "specbus.ops.cli" in _cmdline(pid) and _environ(pid).get("RANK") == str(rank):
                    return pid
        return None

    def _last_step(self) -> int | None:
        if self.elastic:  # rank 0 may be any agent's: its rows
            rows = [r for r in _metric_rows(self.dir / "run" / "logs") if "step" in r]
            return int(rows[-1]["step"]) if rows else None
        text = self.roles["trainers"].log_path.read_text(errors="replace")
        steps = re.findall(r"(?:^|\] |:)\s*step (\d+)", text, flags=re.M)
        return int(steps[-1]) if steps else None

    def inject(self) -> None:
        for n, fault in enumerate(self.plan.faults):
            state: dict[str, int] = {}

            def ready(fault=fault, state=state):
                # Fire right after an ack that took the floor to `at`: the trainers' floor, or
                # for a producer also the producers' floor (tasks captured), so that a producer
                # kill lands mid-capture while there is capture left.
                if self._trainers_done():
                    return {"missed": "training ended before the trigger"}
                if self.broker.down_since is not None or not self._trainers_running():
                    state.clear()
                    return None
                groups = ("trainers", "producers") if fault.victim == "producer" else ("trainers",)
                for group in groups:
                    c = self.probe.consumer(group)
                    if c is None:
                        state.clear()
                        return None
                    prev = state.get(group)
                    state[group] = c["ack_floor"]
                    if prev is not None and c["ack_floor"] > prev and c["ack_floor"] >= fault.at:
                        return {**c, "group": group}
                return None

            # The first trigger also waits for the processes to start: on the shared 2-core
            # box at load 11-14, torchrun's ranks took ~2 minutes to import and load; elastic
            # agents start slower still (an agent, then its ranks) and re-form for minutes.
            slack = 300.0 if self.elastic else 0.0
            budget_s = 120.0 + slack + self._outage_total() + (STARTUP_S if n == 0 else 0.0)
            c = self.wait_until(ready, budget_s, f"ack floor {fault.at}")
            if "missed" in c:
                fault.landed = c
                self.fail("fault_missed", f"{fault.label}: training ended before the trigger")
                continue
            complete = self.probe.kv("train_complete")
            if self.plan.store != "mooncake" and fault.victim == "store":
                continue
            if (
                fault.victim == "trainer"
                and not self.elastic
                and self._trainer_pid(fault.index) is None
            ):
                self.wait_until(lambda f=fault: self._trainer_pid(f.index), 30, "trainer rank")
            fault.landed = {
                "t": round(self.t(), 2), "group": c["group"], "ack_floor": c["ack_floor"], "delivered": c["delivered"],
                "ack_pending": c["ack_pending"], "last_step_logged": self._last_step(),
                "train_complete": complete, "torchrun_running": self._trainers_running(),
            }  # fmt: skip
            if complete not in (None,) or c["ack_floor"] < 1:
                self.fail("fault_missed", f"{fault.label}: not mid-run ({fault.landed})")
            self.note(f"fire {fault.label}: {fault.landed}")
            self._fire(fault)

    def _outage_total(self) -> float:
        return sum(OUTAGES.get(f.victim, 0.0) for f in self.plan.faults)

    def _fire(self, fault: Fault) -> None:
        v = fault.victim
        if v in ELASTIC or (v == "trainer" and self.elastic):
            self._fire_elastic(fault)
        elif v == "producer":
            role = self.roles[f"producer-{fault.index}"]
            role.kill()
            role.start()
        elif v == "trainer":
            pid = self._trainer_pid(fault.index)
            role = self.roles["trainers"]
            role.expected_exit = True
            if pid is not None:
                self.pids.add(pid)
                self.pids.update(_children(role.proc.pid))
                _sigkill(pid)
            try:
                rc = role.proc.wait(timeout=90)
                fault.landed["torchrun_exit"] = rc
            except subprocess.TimeoutExpired:
                self.fail("trainer_kill", "torchrun did not stop the world within 90 s")
                role.kill()
            role.start()  # torchrun ... train --resume
        elif v == "broker":
            if not self.broker.kill_server():
                self.broker.start()
        elif v == "up":
            self.broker.kill_wrapper()
            self.broker.start()
        elif v == "store":
            self.mooncake.kill_node()
            self.mooncake.start_node()
            self.pids.add(self.mooncake.node.pid)
        elif v in OUTAGES:
            self.broker.stop()
            t_end = time.monotonic() + OUTAGES[v]
            while time.monotonic() < t_end:  # the outage itself: everything else keeps running
                self.supervise()
                time.sleep(0.1)
            fault.landed["died_during_outage"] = [
                d["role"] for d in self.deaths if d["broker"] == "down"
            ]
            self.broker.start()
        else:
            raise ValueError(v)

    # -- end of run and checks
    def finish(self) -> bool:
        """Wait for the pipeline to end (every role exited 0)."""
        try:
            self.wait_until(
                lambda: all(r.done for r in self.roles.values()),
                self.opts.deadline_s,
                "end of run",
                0.2,
            )
            return True
        except TrialError as e:
            running = [r.name for r in self.roles.values() if not r.done]
            self.fail("hang", f"{e}; still running or failed: {running}")
            for name in running:
                self.note(f"--- {name} tail:\n{self.roles[name].tail(8)}")
            return False

    def check_broker(self) -> dict:
        try:
            final = self.probe.final()
        except Exception as e:
            self.fail("broker", f"cannot read the final stream/consumer state: {e!r}")
            return {}
        for group in ("trainers", "producers"):
            c = final[group]
            if c["pending"] or c["ack_pending"]:
                self.fail(
                    "ack_pending",
                    f"{group}: pending {c['pending']}, ack-pending {c['ack_pending']}",
                )
        if final["dead"]:
            self.fail("dead", f"DEAD holds {final['dead']} messages: {final.get('dead_letters')}")
        if final["feed_complete"] != {"task_count": self.plan.tasks}:
            self.fail(
                "feed", f"feed-complete marker {final['feed_complete']} (fed {self.plan.tasks})"
            )
        return final

    def check_lineage(self, fed: list[str], ended: bool = True) -> dict:
        from specbus.consumers.lineage import load_state

        ckpt = self.dir / "run" / "checkpoints"
        try:
            name = (ckpt / "latest").read_text().strip()
            state = load_state(ckpt / name)  # the lineage from the file beside it
        except Exception as e:
            if ended:
                self.fail("lineage", f"no final checkpoint: {e!r}")
            return {}
        lineage = list(state["lineage"])
        counts = Counter(lineage)
        dups = sorted(k for k, n in counts.items() if n > 1)
        expected = set(fed) or {f"t{i}-e0" for i in range(self.plan.tasks)}
        missing = sorted(expected - set(lineage))
        extra = sorted(set(lineage) - expected)
        if len(expected) != self.plan.tasks:
            self.fail(
                "lineage", f"TASKS holds {len(expected)} dataset tasks, fed {self.plan.tasks}"
            )
        if dups:
            self.fail("duplicates", f"{len(dups)} samples trained twice or more: {dups[:8]}")
        if missing and ended:
            self.fail("missing", f"{len(missing)} fed samples never trained: {missing[:8]}")
        if extra:
            self.fail("lineage", f"{len(extra)} trained ids never fed: {extra[:8]}")
        return {"checkpoint": name, "step": state.get("step"), "trained": len(lineage),
                "duplicates": len(lineage) - len(counts), "missing": len(missing)}  # fmt: skip

    def _mc_allocated(self) -> int:
        url = f"http://{self.mooncake.admin_address}/metrics"
        with urllib.request.urlopen(url, timeout=2) as r:
            for line in r.read().decode().splitlines():
                if line.startswith("master_allocated_bytes"):
                    return int(float(line.split()[-1]))
        return 0

    def check_store(self) -> dict:
        if self.plan.store == "mooncake":
            deadline = time.monotonic() + 20
            allocated = self._mc_allocated()
            while allocated != self.mc_baseline and time.monotonic() < deadline:
                time.sleep(0.25)
                allocated = self._mc_allocated()
            if allocated != self.mc_baseline:
                self.fail("store_leak", f"mooncake master_allocated_bytes {allocated} "
                          f"(baseline {self.mc_baseline}): {allocated - self.mc_baseline} B leaked")  # fmt: skip
            return {"allocated": allocated, "baseline": self.mc_baseline}
        root = self.shm_dir
        if root is None or not root.exists():
            return {"files": 0}
        files = [p for p in root.rglob("*") if p.is_file()]
        samples = [p for p in files if "samples" in p.relative_to(root).parts]
        nbytes = sum(p.stat().st_size for p in samples)
        self.fail(
            "store_leak",
            f"{root} left with {len(files)} files ({len(samples)} sample files, {nbytes} B)",
        )
        return {"files": len(files), "sample_bytes": nbytes}

    def check_orphans(self) -> list:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            left = self.pids.alive()
            found = _procs_mentioning(f"{self.dir}/")
            if not left and not found:
                return []
            time.sleep(0.2)
        orphans = sorted({*left, *(p for p, _ in found)})
        desc = [f"{p}: {_cmdline(p)[:160]}" for p in orphans]
        self.fail("orphans", f"{len(orphans)} processes left: {desc}")
        for p in orphans:  # ours (started by the harness or by a process it started): end them
            _sigkill(p)
        return desc

    def teardown(self) -> None:
        for role in getattr(self, "roles", {}).values():
            role.stop(timeout_s=10)
        if self.rendezvous is not None:
            self.rendezvous.stop(timeout_s=10)
        if self.probe is not None:
            self.probe.close()
            self.probe = None
        if getattr(self, "broker", None) is not None:
            self.broker.stop(orphan_too=False)
        if self.mooncake is not None:
            self.mooncake.stop()


@dataclass
class Result:
    plan: Plan
    ok: bool
    seconds: float
    failures: list[tuple[str, str]]
    report: dict
    dir: Path

    @property
    def checks(self) -> list[str]:
        return sorted({c for c, _ in self.failures})


def run_trial(plan: Plan, opts: Options, assets: dict[str, Path] | None = None) -> Result:
    assets = assets or build_assets(opts)
    trial = Trial(plan, opts, assets)
    report: dict = {"seed": plan.seed, "store": plan.store, "plan": plan.label, "run": trial.run}
    try:
        try:
            trial.setup()
            trial.launch()
            trial.inject()
            ended = trial.finish()
            final = trial.check_broker()
            report["broker"] = {k: v for k, v in final.items() if k != "fed"}
            report["lineage"] = trial.check_lineage(final.get("fed", []), ended)
            if trial.elastic:  # every formation of the trainers' world, from the run KV
                report["formations"] = (trial.probe.kv("world", None) or {}).get("history")
            for role in trial.roles.values():  # the store check needs every process gone
                role.stop(timeout_s=10)
            report["store"] = trial.check_store()
        except TrialError as e:
            trial.fail("harness", str(e))
        except Exception as e:  # a harness bug must not leave processes behind
            trial.fail("harness", f"{type(e).__name__}: {e}")
            import traceback

            trial.note(traceback.format_exc())
        finally:
            trial.teardown()
        report["orphans"] = trial.check_orphans()
    finally:
        if trial.shm_dir is not None and trial.shm_dir.exists():
            shutil.rmtree(trial.shm_dir, ignore_errors=True)
    report["faults"] = [asdict(f) for f in plan.faults]
    report["deaths"] = trial.deaths
    report["failures"] = trial.failures
    report["notes"] = trial.notes
    seconds = trial.t()
    report["seconds"] = round(seconds, 1)
    (trial.dir / "report.json").write_text(json.dumps(report, indent=2, default=str))
    ok = not trial.failures
    if ok and not opts.keep:
        shutil.rmtree(trial.dir, ignore_errors=True)
    return Result(plan, ok, seconds, list(trial.failures), report, trial.dir)


# ---------------------------------------------------------------- campaign
def build_assets(opts: Options) -> dict[str, Path]:
    """The tiny target and the pre-tokenised data, once per work dir."""
    from tests.fixtures.pipeline import build_tiny_target, write_tokenised_data

    work = Path(opts.work)
    work.mkdir(parents=True, exist_ok=True)
    target = work / "tiny-target"
    if not (target / "config.json").exists():
        build_tiny_target(target)
    data = work / f"data-{opts.tasks}.jsonl"
    if not data.exists():
        write_tokenised_data(data, opts.tasks)
    return {"target": target, "data": data}


def repro(
    plan: Plan, opts: Options, victims: list[str] | None, faults: tuple[int, int] = (1, 3)
) -> str:
    parts = ["python -m specbus.ops.chaos", f"--store {plan.store}", f"--seed {plan.seed}", "--trials 1",
             f"--tasks {opts.tasks}", "--keep"]  # fmt: skip
    if opts.budget is not None:
        parts.append(f"--budget {opts.budget}")
    if opts.slow:
        parts.append("--slow")
    if victims:
        parts.append(f"--victims {','.join(victims)}")
    if tuple(faults) != (1, 3):
        parts.append(f"--faults {faults[0]}-{faults[1]}")
    return " ".join(parts)


def summarize(results: list[Result]) -> str:
    per: dict[str, Counter] = defaultdict(Counter)
    for r in results:
        for v in {f.victim for f in r.plan.faults} or {"none"}:
            per[v]["trials"] += 1
            per[v]["pass" if r.ok else "fail"] += 1
            for c in r.checks:
                per[v][c] += 1
    fails = sum(not r.ok for r in results)
    lines = [f"{len(results)} trials, {len(results) - fails} passed, {fails} failed"]
    lines.append(f"{'victim':<10} {'trials':>6} {'pass':>5} {'fail':>5}  failing checks")
    for v in sorted(per):
        c = per[v]
        checks = ", ".join(
            f"{k} {n}" for k, n in sorted(c.items()) if k not in ("trials", "pass", "fail")
        )
        lines.append(f"{v:<10} {c['trials']:>6} {c['pass']:>5} {c['fail']:>5}  {checks}")
    if results:
        secs = [r.seconds for r in results]
        lines.append(
            f"trial time: min {min(secs):.0f}s, median {sorted(secs)[len(secs) // 2]:.0f}s, max {max(secs):.0f}s"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m specbus.ops.chaos", description=__doc__.splitlines()[0]
    )
    ap.add_argument("--store", choices=["shm", "mooncake"], default="shm")
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--seed", type=int, default=1, help="first seed (trial i runs seed + i)")
    ap.add_argument(
        "--tasks", type=int, default=2048, help=f"tasks fed per trial (at least {WINDOW})"
    )
    ap.add_argument("--slow", action="store_true", help="also 60 s broker outages")
    ap.add_argument("--budget", type=int, default=None,
                    help="store.budget_bytes of every trial (default 64 MiB); Mooncake: the "
                         "node's segment is sized by it, as `specbus store` does")  # fmt: skip
    ap.add_argument("--victims", default=None, help=f"comma list from {','.join(ALL_VICTIMS)}")
    ap.add_argument("--faults", default="1-3", help="faults per trial, e.g. 1-3 or 0")
    ap.add_argument("--work", default=None, help="campaign dir (default a new one under /tmp)")
    ap.add_argument("--code", default=str(ROOT), help="checkout the processes run (PYTHONPATH)")
    ap.add_argument(
        "--deadline",
        type=float,
        default=240.0,
        help="seconds for a run to end after its last fault",
    )
    ap.add_argument("--keep", action="store_true", help="keep passing trials' directories too")
    ap.add_argument("--stop-on-fail", action="store_true")
    ap.add_argument("--dry-run", action="store_true", help="print the plans only")
    args = ap.parse_args(argv)
    victims = args.victims.split(",") if args.victims else None
    for v in victims or []:
        if v not in ALL_VICTIMS:
            ap.error(f"unknown victim {v!r}")
        if v == "store" and args.store != "mooncake":
            ap.error("victim 'store' (the Mooncake store node) needs --store mooncake")
    lo, _, hi = args.faults.partition("-")
    faults = (int(lo), int(hi or lo))
    work = Path(args.work or tempfile.mkdtemp(prefix="specbus-chaos-"))
    opts = Options(work=work, store=args.store, tasks=args.tasks, slow=args.slow,
                   code=Path(args.code).resolve(), deadline_s=args.deadline, keep=args.keep,
                   budget=args.budget)  # fmt: skip
    plans = [
        make_plan(
            s, store=args.store, tasks=args.tasks, slow=args.slow, victims=victims, faults=faults
        )
        for s in range(args.seed, args.seed + args.trials)
    ]
    if args.dry_run:
        for p in plans:
            print(json.dumps(asdict(p)))
        return 0
    budget = f", store budget {args.budget} B" if args.budget is not None else ""
    print(f"chaos: {args.trials} trials on {args.store}, seeds {args.seed}..{args.seed + args.trials - 1}, "
          f"{args.tasks} tasks each{budget}, work dir {work}", flush=True)  # fmt: skip
    assets = build_assets(opts)
    results = []
    for plan in plans:
        r = run_trial(plan, opts, assets)
        results.append(r)
        verdict = "PASS" if r.ok else "FAIL " + "; ".join(f"{c}: {d[:200]}" for c, d in r.failures)
        fired = ",".join(f.fired for f in plan.faults) or "-"
        print(f"seed {plan.seed:<4} {plan.store:<8} {plan.label:<36} fired {fired:<24} "
              f"{r.seconds:4.0f}s  {verdict}", flush=True)  # fmt: skip
        if not r.ok:
            print(f"    logs: {r.dir}\n    repro: {repro(plan, opts, victims, faults)}", flush=True)
            if args.stop_on_fail:
                break
    print(summarize(results))
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
