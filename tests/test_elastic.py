"""Elastic trainers (issue 27): torchrun agents join a running run and leave it, exactly once.

Real processes on a real broker and shm store: a feeder, a producer and `specbus train
--elastic MIN:MAX` agents (torchrun's elastic agent, c10d rendezvous on loopback, gloo), started
and killed by PID. What each test checks in the end: every fed sample trained exactly once
(the final checkpoint's lineage), nothing pending or ack-pending at the broker, no dead
letter, no store byte left, every process that was not a victim exited 0, and no rank of a
killed agent left running. The world's formations are read from the run's KV (`world`, written
by rank 0 at each world's first step), so each change of world is asserted while the run is
under way, and its re-formation time and retrained steps are printed (`-s`).
"""

from __future__ import annotations

import asyncio
import os
import re
import time

import pytest
from specbus.bus.connection import connect
from specbus.bus.topology import open_kv
from specbus.core.config import BusConfig
from specbus.ops.services.common import free_port

from tests.fixtures.pipeline import Cluster, pipeline_config, write_tokenised_data
from tests.test_pipeline import assert_lineage, assert_settled, train_complete

pytestmark = pytest.mark.slow  # several minutes each: agents, ranks, re-formations on 2 cores


def kv_world(url: str, run: str) -> dict | None:
    """The run KV's `world` record (None before the first world's first step or when the
    broker does not answer)."""

    async def go():
        async with await connect(BusConfig(connect_give_up_s=2.0), url) as bus:
            kv = await open_kv(bus, run)
            return None if kv is None else await kv.get_world()

    try:
        return asyncio.run(asyncio.wait_for(go(), 10))
    except Exception:  # noqa: BLE001 - not readable now: polled again
        return None


def children(pid: int) -> list[int]:
    """Every descendant of `pid` (the ranks of an agent)."""
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in kids.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Elastic:
    """A run with elastic trainer agents, each `specbus train --elastic 1:MAX` on one c10d
    rendezvous endpoint."""

    def __init__(self, cluster: Cluster, *, max_agents: int = 2, per_agent: int = 1):
        self.cluster, self.max_agents, self.per_agent = cluster, max_agents, per_agent
        self.endpoint = f"127.0.0.1:{free_port()}"
        self.formations: list[dict] = []
        self.victims: set[str] = set()

    def kill(self, name: str) -> None:
        """kill -9 the agent `name` (its ranks die with it: SIGHUP, see ops/elastic.py)."""
        self.victims.add(name)
        self.cluster.kill(name)

    def agent(self, name: str):
        return self.cluster.start(
            name, "train", "--elastic", f"1:{self.max_agents}", "--nproc-per-node",
            str(self.per_agent), "--rdzv-endpoint", self.endpoint,
        )  # fmt: skip

    def ranks_of(self, name: str, timeout_s: float = 60.0) -> list[int]:
        """The trainer ranks (`specbus.ops.cli train` processes) the agent `name` runs now."""
        pid, deadline = self.cluster.procs[name].pid, time.monotonic() + timeout_s
        while True:
            ranks = [p for p in children(pid) if b"--resume" in _cmdline(p)]
            if len(ranks) == self.per_agent:
                return ranks
            assert time.monotonic() < deadline, f"{name} runs {ranks}, not {self.per_agent} ranks"
            time.sleep(0.1)

    def wait_world(self, size: int, *, timeout_s: float = 400.0) -> dict:
        """The next formation's record (a `world` newer than the last one seen) once its first
        step is done, asserting it has `size` ranks and that the run is under way (not marked
        complete, no process failed)."""
        c = self.cluster
        after = self.formations[-1]["formation"] if self.formations else 0
        deadline = time.monotonic() + timeout_s
        while True:
            rec = kv_world(c.url, c.cfg.run)
            if rec is not None and rec["formation"] > after:
                assert rec["world"] == size, f"formed a world of {rec['world']}, not {size}: {rec}"
                assert train_complete(c.url, c.cfg.run) is None, "the run ended first"
                self.formations.append(rec)
                return rec
            failed = {n: code for n, p in c.procs.items()
                      if (code := p.poll()) not in (None, 0) and n not in self.victims}  # fmt: skip
            assert not failed, f"failed while waiting for a world of {size}: {failed}"
            assert time.monotonic() < deadline, f"no world of {size} in {timeout_s}s: {rec}"
            time.sleep(0.25)


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


@pytest.fixture
def make_elastic(tmp_path, tiny_target, run_id):
    clusters = []

    def make(url: str, n: int, **kw) -> Elastic:
        data = write_tokenised_data(tmp_path / f"{run_id}.jsonl", n)
        cfg = pipeline_config(
            run_id, tmp_path / "run", tiny_target, data, store_uri=f"shm://{run_id}",
            overrides=["training.checkpoint_every=1000", "training.log_every=1",
                       "bus.ack_wait_s=10", "training.elastic_init_timeout_s=60"],
        )  # fmt: skip
        cluster = Cluster(cfg, tmp_path / "procs", url)
        cluster.n = n
        clusters.append(cluster)
        return Elastic(cluster, **kw)

    yield make
    for c in clusters:
        c.stop()


def finished_exactly_once(e: Elastic, *names: str) -> None:
    """Every process that is not a victim exited 0; every fed sample trained once (the count
    is odd, so a remainder is usually trained in one ragged last step: whether one is left
    depends on how many samples the last world started with), nothing left."""
    c = e.cluster
    c.assert_ok(c.wait("feeder", "producer-0", *names, timeout=600))
    assert len(assert_lineage(c, c.n)) == c.n
    assert_settled(c)
    final = c.checkpoint_state()
    for rec in e.formations[1:]:  # each change of world: how long, what was trained again
        print(f"formation {rec['formation']}: world {rec['previous_world']} -> {rec['world']} "
              f"at step {rec['from_step']}: first step {rec['since_end_s']}s after the previous "
              f"world ended ({rec['cause']}), {rec['retrained']} step(s) retrained")  # fmt: skip
    assert final["step"] >= e.formations[-1]["from_step"]


def test_a_host_joins_then_dies_and_every_sample_is_trained_once(make_elastic, nats_server):
    """The issue's run: one agent of 2 ranks trains (world 2); a second agent started with the
    same command joins (world 4, asserted mid-run); a kill -9 of that agent shrinks the world
    back to 2; the run completes exactly once, and each re-formation resumed from the step
    the previous world reached (0 steps retrained)."""
    e = make_elastic(nats_server.url, 3001, per_agent=2)
    c = e.cluster
    c.start("feeder", "feed")
    c.start("producer-0", "produce", "--id", "p0")
    e.agent("agent-a")
    first = e.wait_world(2)
    t_join = time.monotonic()
    e.agent("agent-b")
    grown = e.wait_world(4)
    join_s = time.monotonic() - t_join
    assert grown["from_step"] > first["from_step"] and grown["retrained"] == 0
    b_ranks = e.ranks_of("agent-b")
    t_kill = time.monotonic()
    e.kill("agent-b")
    shrunk = e.wait_world(2)
    death_s = time.monotonic() - t_kill
    assert shrunk["from_step"] >= grown["from_step"] and shrunk["retrained"] == 0
    finished_exactly_once(e, "agent-a")
    assert not [p for p in b_ranks if alive(p)], "a rank of the killed agent is still running"
    log = c.log("agent-a")
    assert re.search(r"exit 75, the torchrun agent forms the next world", log), log[-3000:]
    print(f"join -> first step at world 4: {join_s:.1f}s; kill -9 -> first step at world 2: "
          f"{death_s:.1f}s")  # fmt: skip


def log_after(c: Cluster, name: str, offset: int) -> str:
    return c.log(name)[offset:]


def wait_for_text(c: Cluster, name: str, pattern: str, offset: int = 0, timeout_s: float = 300.0):
    """The first match of `pattern` in `name`'s log after `offset`, waited for; fails when
    `name` ended first or after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = re.search(pattern, log_after(c, name, offset))
        if found:
            return found
        assert c.procs[name].poll() is None, f"{name} ended\n{c.log(name)[-3000:]}"
        assert time.monotonic() < deadline, f"no {pattern!r} in {name}\n{c.log(name)[-3000:]}"
        time.sleep(0.1)


def test_a_host_joins_during_a_broker_outage(make_elastic, private_nats_server):
    """The broker is down when the second agent joins: the running world stops anyway (the
    give-back and the confirmed acks do not wait for the broker), saves its last step, and the
    new world waits for the broker, then resumes from that step: nothing retrained, nothing
    lost. One rank per agent."""
    e = make_elastic(private_nats_server.url, 1201)
    c = e.cluster
    c.start("feeder", "feed")
    c.start("producer-0", "produce", "--id", "p0")
    e.agent("agent-a")
    e.wait_world(1)
    private_nats_server.stop()
    wait_for_text(c, "agent-a", r"disconnected; reconnecting")
    mark = len(c.log("agent-a"))
    e.agent("agent-b")
    stopped = wait_for_text(c, "agent-a", r"training stopped: (\d+) steps", mark)
    # the new world's ranks are up and waiting for the broker: the outage spans the join
    wait_for_text(c, "agent-b", r"no broker answers at")
    private_nats_server.start()
    grown = e.wait_world(2)
    assert grown["from_step"] == int(stopped.group(1)) and grown["retrained"] == 0
    finished_exactly_once(e, "agent-a", "agent-b")


def test_a_host_dies_while_the_world_re_forms(make_elastic, nats_server):
    """A joining agent is killed (kill -9) while the world of 2 forms, before its first step:
    the survivor's new rank does not wait for the dead one past
    `training.elastic_init_timeout_s` (or stops with it), and the survivor forms a world of 1
    again, from the step the first world reached. One rank per agent."""
    e = make_elastic(nats_server.url, 1501)
    c = e.cluster
    c.start("feeder", "feed")
    c.start("producer-0", "produce", "--id", "p0")
    e.agent("agent-a")
    first = e.wait_world(1)
    mark = len(c.log("agent-a"))
    e.agent("agent-b")
    stopped = wait_for_text(c, "agent-a", r"training stopped: (\d+) steps", mark)
    b_ranks = e.ranks_of("agent-b")  # the new world's rank on b exists: the world is forming
    assert kv_world(c.url, c.cfg.run)["formation"] == first["formation"], "the world of 2 stepped"
    e.kill("agent-b")
    again = e.wait_world(1)
    assert again["from_step"] == int(stopped.group(1)) and again["retrained"] == 0
    finished_exactly_once(e, "agent-a")
    assert not [p for p in b_ranks if alive(p)], "a rank of the killed agent is still running"
