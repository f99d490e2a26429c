"""Elastic trainers: the trainers' world grows and shrinks under torch.distributed.elastic.

Membership is torchrun's (`torch.distributed.elastic`, the c10d rendezvous): every trainer
host runs the same command, `specbus train --elastic MIN:MAX` (`launch` here: torchrun's agent
in this process, the worker command `specbus train --resume`), or the torchrun command it
prints. When a host joins, the agents stop their workers (SIGTERM: every rank stops at the
same step boundary, gives back its leases and rank 0 saves the checkpoint of the last
optimizer step, consumers/shutdown.py) and start them again in the new world, which resumes
from that checkpoint by replay (ops/train.py) with the schedule re-planned for its size. When
a host dies (its agent and ranks killed) the survivors' collectives fail: they save the last
step when they can alone (the first to claim it, consumers/trainer.py) and exit `REFORM_EXIT`,
which torchrun treats as a failed worker group and restarts (one of `--max-restarts`) at the
smaller world, down to MIN. A rank whose world stopped under it (a peer's stop) exits
`REFORM_EXIT` too: torchrun ends a worker group that exits 0 as finished.

What a rank does differently under an elastic agent (`Member.from_env`: torchrun set
`TORCHELASTIC_MAX_RESTARTS` > 0): it always resumes, it dies with its agent (a killed agent's
ranks would otherwise train on in their own session), and it ends its world with
`REFORM_EXIT` unless the data ended or it was asked to stop itself.

Each world is recorded (`Formation`): rank 0 writes the run KV's `world` at the world's first
step (size, formation number, the step it resumed from, how long since the previous world
ended and how many steps it retrained, and the past formations); the ranks of a world that
ends other than at the end of the data record how (step reached, why) in the checkpoint
directory, which needs no broker. `specbus status` and `specbus top` show the record. docs/architecture.md, "Elastic trainers".
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("specbus.elastic")

REFORM_EXIT = 75  # EX_TEMPFAIL: this rank's world ended under it; its agent starts it again
HISTORY = 20  # formations kept in the KV's `world` record
# torchrun's rendezvous settings of `specbus train --elastic` (c10d backend, seconds): a dead
# agent is dropped from the rendezvous after KEEP_ALIVE_S * KEEP_ALIVE_MISSES without a
# heartbeat; a round with MIN agents waits LAST_CALL_S for more before it closes.
KEEP_ALIVE_S, KEEP_ALIVE_MISSES, LAST_CALL_S, MONITOR_S = 1, 5, 3, 0.5
MAX_RESTARTS = 100  # each re-formation may count one on a host whose ranks a peer stopped


@dataclass(frozen=True)
class Member:
    """This rank's place under torchrun's elastic agent (from the environment it sets)."""

    run_id: str
    restart: int  # the agent's restarts so far (TORCHELASTIC_RESTART_COUNT)
    max_restarts: int
    group_rank: int  # the agent's rank among the agents (GROUP_RANK)
    agents: int  # GROUP_WORLD_SIZE

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Member | None:
        """This process's membership, or None when no elastic agent runs it (no torchrun, or a
        torchrun that never restarts its workers: `--max-restarts 0`)."""
        env = os.environ if env is None else env
        max_restarts = int(env.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
        if max_restarts <= 0 or "TORCHELASTIC_RUN_ID" not in env:
            return None
        return cls(
            run_id=env["TORCHELASTIC_RUN_ID"],
            restart=int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
            max_restarts=max_restarts,
            group_rank=int(env.get("GROUP_RANK", "0") or 0),
            agents=int(env.get("GROUP_WORLD_SIZE", "1") or 1),
        )


def die_with_agent(sig: int = signal.SIGHUP) -> None:
    """Make this process receive `sig` when its parent (the torchrun agent) dies, even by
    kill -9: torchrun starts its workers in sessions of their own, so a killed agent's ranks
    would otherwise keep training in a world nobody supervises. SIGHUP, the trainer's stop
    that never escalates (consumers/shutdown.py): the kernel sends it once per thread of the
    dead agent, and a repeated SIGTERM would mean "exit now". The ranks stop at the next step
    boundary with the checkpoint of the last step; the world's survivors then re-form. Linux
    only (PR_SET_PDEATHSIG); a parent already gone ends this process now."""
    parent = os.getppid()
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return
    if libc.prctl(1, int(sig), 0, 0, 0) != 0:  # 1: PR_SET_PDEATHSIG
        log.warning("could not tie this rank to its agent (prctl errno %d)", ctypes.get_errno())
        return
    if os.getppid() != parent or parent == 1:
        log.warning("the torchrun agent of this rank is gone: exiting")
        os._exit(REFORM_EXIT)


def peer_gone(e: BaseException) -> bool:
    """Whether `e` is what a collective raises when a peer rank is gone (a closed connection,
    a timed-out store or collective), not a bug of this rank."""
    import torch.distributed as dist

    if isinstance(e, dist.DistError):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and any(
        w in text for w in ("gloo", "Connection reset", "Connection closed", "NCCL")
    )


def member_exit(result: Any) -> int:
    """The exit code of an elastic rank after `run_trainer` returned `result`: 0 when the data
    ended or this rank was asked to stop (its agent is stopping it); `REFORM_EXIT` when a
    peer's stop ended the world under it (exit 0 would tell torchrun the run is done)."""
    if result is not None and result.stopped and not result.stopped_here:
        print(f"world stopped by a peer at step {result.steps} (checkpoint {result.checkpoint}): "
              f"exit {REFORM_EXIT}, the torchrun agent forms the next world", flush=True)  # fmt: skip
        return REFORM_EXIT
    return 0


def process_started_at() -> float:
    """This process's start (Unix time), from /proc (now where /proc cannot say)."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(
            float(line.split()[1])
            for line in Path("/proc/stat").read_text().splitlines()
            if line.startswith("btime ")
        )
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


class Formation:
    """One world of the run's trainers, from its start to its end.

    At the world's start every rank reads the last recorded world from the run's KV (`world`;
    best effort, bounded: unreadable, the figures are unknown) and how it ended, from the
    checkpoint directory (`worlds/end-r<rank>.json`: written by the ranks that left it, with
    no broker needed, since a world may end during a broker outage; every trainer host shares
    the checkpoint directory anyway, it resumes from it). At the world's first step rank 0
    writes the new `world` record to the KV: its size, formation number, the step it resumed
    from, its processes' start, the first step's time, the seconds from the previous world's
    end to it (`since_end_s`: the re-formation time), the steps trained again (`retrained`:
    the highest step a rank of the previous world reached minus the step resumed from; 0 when
    the checkpoint was taken at the re-formation), the previous world's size and why it ended,
    and the last `HISTORY` formations. A rank of a world that made a step and ends other than
    at the end of the data writes its end file."""

    def __init__(
        self, loop: Any, run: Any, directory: Path, *, world: int, rank: int, from_step: int
    ):
        self.loop, self.run, self.world, self.rank = loop, run, world, rank
        self.ends = Path(directory) / "worlds"
        self.from_step, self.started_at = from_step, process_started_at()
        future = loop.submit(run.kv.get_world())
        try:
            self.previous = future.result(5.0)
        except Exception as e:  # noqa: BLE001 - bookkeeping: unknown, not fatal
            future.cancel()
            log.info("run KV not read (%s): this world's formation figures are unknown",
                     type(e).__name__)  # fmt: skip
            self.previous = None
        self.number = int((self.previous or {}).get("formation", 0)) + 1
        self.previous_end = self._end_of(self.number - 1)
        self.stepped = False

    def _end_of(self, number: int) -> dict | None:
        """How formation `number` ended: the highest step its leaving ranks reached, the
        earliest time one left, and why (None when none of its ranks recorded an end)."""
        ends = []
        for path in self.ends.glob("end-r*.json"):
            try:
                end = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if end.get("formation") == number:
                ends.append(end)
        if not ends:
            return None
        last = max(ends, key=lambda e: e["step"])
        return {**last, "at": min(e["at"] for e in ends)}

    def record(self, at: float) -> dict[str, Any]:
        """The `world` record of this formation, first step at `at`."""
        prev, end = self.previous or {}, self.previous_end
        rec: dict[str, Any] = {
            "formation": self.number, "world": self.world, "from_step": self.from_step,
            "started_at": self.started_at, "at": at, "previous_world": prev.get("world"),
            "cause": end.get("reason") if end else None,
            "since_end_s": round(at - end["at"], 2) if end else None,
            "retrained": max(0, int(end["step"]) - self.from_step) if end else None,
        }  # fmt: skip
        history = [*prev.get("history", []), rec][-HISTORY:]
        return {**rec, "history": history}

    def first_step(self, step: int) -> None:
        """The `Trainer` hook after this world's first step: rank 0 records the world (the
        KV write rides through a broker outage on the bus loop; training does not wait)."""
        self.stepped = True
        if self.rank != 0:
            return
        rec = self.record(time.time())
        since = rec["since_end_s"]
        # a re-formation is worth a warning; a run's first (or only) world is not
        log.log(
            logging.WARNING if since is not None else logging.INFO,
            "world %d (formation %d) trains from step %d%s", self.world, self.number,
            self.from_step,
            f": first step {since:.1f}s after world {rec['previous_world']} ended "
            f"({rec['cause']}), {rec['retrained']} step(s) trained again" if since is not None
            else "",
        )  # fmt: skip
        future = self.loop.submit(self.run.kv.put_world(rec))

        def done(f) -> None:
            if not f.cancelled() and f.exception() is not None:
                log.warning("world record not written: %s", f.exception())

        future.add_done_callback(done)

    def end(self, step: int, reason: str) -> None:
        """This rank leaves its world other than at the end of the data (a stop, a peer's
        stop, a failure) at `step`: its end file says so. Never raises."""
        if not self.stepped:
            return
        end = {"formation": self.number, "world": self.world, "step": step, "at": time.time(),
               "reason": reason, "rank": self.rank}  # fmt: skip
        path = self.ends / f"end-r{self.rank}.json"
        try:
            self.ends.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}")
            tmp.write_text(json.dumps(end))
            os.replace(tmp, path)
        except OSError as e:
            log.info("world end not recorded in %s: %s", path, e)


# ---------------------------------------------------------------- specbus train --elastic
def parse_nodes(text: str) -> tuple[int, int]:
    """`MIN:MAX` (or `N`) -> (min, max) agents; `ValueError` naming the flag otherwise."""
    lo, _, hi = text.partition(":")
    try:
        nmin, nmax = int(lo), int(hi or lo)
    except ValueError:
        raise ValueError(f"--elastic takes MIN:MAX agents (e.g. 1:4), not {text!r}") from None
    if not 1 <= nmin <= nmax:
        raise ValueError(f"--elastic {text}: need 1 <= MIN <= MAX")
    return nmin, nmax


def torchrun_argv(args: argparse.Namespace, run: str, url: str) -> list[str]:
    """The torchrun arguments of `specbus train --elastic MIN:MAX` (what it prints): the c10d
    rendezvous on `--rdzv-endpoint`, rendezvous id the run's name, this process's ranks
    running `specbus train --resume` with the same config and broker."""
    nmin, nmax = parse_nodes(args.elastic)
    worker = ["-m", "specbus.ops.cli", "train", "--resume", "--url", url]
    if args.config:
        worker += ["--config", str(Path(args.config).resolve())]
    worker += list(args.overrides)
    conf = (f"keep_alive_interval={KEEP_ALIVE_S},keep_alive_max_attempt={KEEP_ALIVE_MISSES},"
            f"last_call_timeout={LAST_CALL_S},join_timeout={args.join_timeout}")  # fmt: skip
    return [
        "--nnodes", f"{nmin}:{nmax}", "--nproc-per-node", str(args.nproc_per_node),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", args.rdzv_endpoint, "--rdzv-id", run,
        "--rdzv-conf", conf, "--max-restarts", str(args.max_restarts),
        "--monitor-interval", str(MONITOR_S), *worker,
    ]  # fmt: skip


def launch(args: argparse.Namespace, run: str, url: str) -> int:
    """`specbus train --elastic MIN:MAX`: torchrun's elastic agent in this process (its exit
    code). A rendezvous already closed (the run's trainers finished) is said and is 0."""
    from torch.distributed.elastic.rendezvous.api import RendezvousClosedError
    from torch.distributed.run import main as torchrun

    argv = torchrun_argv(args, run, url)
    # torch 2.13's shared rendezvous TCPStore: an agent that stays rank 0 in a new round does
    # not publish the round's store address, and a joining agent waits for it forever (seen
    # here: both agents time out after 60 s). Each round then builds its own store.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    print(f"run {run}: elastic trainers, this host's agent: torchrun {' '.join(argv)}",
          flush=True)  # fmt: skip
    try:
        torchrun(argv)
    except RendezvousClosedError:
        print(f"run {run}: the trainers' rendezvous is closed (their run finished): nothing to "
              "join", flush=True)  # fmt: skip
        return 0
    except SystemExit as e:
        return int(e.code or 0)
    return 0


def serve_rendezvous(endpoint: str) -> int:
    """`specbus rendezvous --rdzv-endpoint HOST:PORT`: the c10d rendezvous store of the elastic
    trainers in a process of its own, until SIGINT/SIGTERM. Without it the first agent started
    on HOST serves the rendezvous, and its host must outlive the run; with it every agent is a
    client (an agent whose port is taken connects instead), so any trainer host may die."""
    import threading
    from datetime import timedelta

    from torch.distributed import TCPStore

    host, _, port = endpoint.rpartition(":")
    store = TCPStore(host or "127.0.0.1", int(port), is_master=True, multi_tenant=True,
                     wait_for_workers=False, timeout=timedelta(seconds=60))  # fmt: skip
    print(f"rendezvous of the elastic trainers at {endpoint} (pid {os.getpid()}): run `specbus "
          f"train --elastic MIN:MAX --rdzv-endpoint {endpoint}` on each trainer host; Ctrl-C "
          "stops it", flush=True)  # fmt: skip
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    while not done.wait(1.0):
        pass
    del store
    return 0


def add_elastic_arguments(p: argparse.ArgumentParser) -> None:
    """`specbus train`'s elastic flags."""
    g = p.add_argument_group("elastic trainers (torch.distributed.elastic)")
    g.add_argument("--elastic", metavar="MIN:MAX", default=None,
                   help="join the run's trainers as one host of MIN..MAX (torchrun's agent "
                   "here; the same command on another host joins, a dead host shrinks the "
                   "world down to MIN); implies --resume")  # fmt: skip
    g.add_argument("--nproc-per-node", type=int, default=1, help="ranks on this host")
    g.add_argument("--rdzv-endpoint", default="127.0.0.1:29400",
                   help="HOST:PORT of the c10d rendezvous: `specbus rendezvous` there, else the "
                   "first agent started on HOST serves it (and must stay up)")  # fmt: skip
    g.add_argument("--max-restarts", type=int, default=MAX_RESTARTS,
                   help="re-formations this host's agent may take after a failure")  # fmt: skip
    g.add_argument("--join-timeout", type=int, default=600,
                   help="seconds an agent waits in the rendezvous for MIN agents")  # fmt: skip


def main_of_member(run_trainer: Any, member: Member) -> int:
    """Run `run_trainer()` as an elastic rank: tied to its agent, its exit code telling the
    agent whether the world must re-form (`member_exit`); a collective that failed because
    a peer is gone is one line and `REFORM_EXIT`, anything else raises."""
    die_with_agent()
    try:
        result = run_trainer()
    except Exception as e:
        if not peer_gone(e):
            raise
        print(f"world failed under this rank (a peer is gone): {str(e)[:300]}; exit "
              f"{REFORM_EXIT}, the torchrun agent forms the next world", flush=True)  # fmt: skip
        return REFORM_EXIT
    return member_exit(result)
