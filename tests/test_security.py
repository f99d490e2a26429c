"""Roles, permissions and TLS against a real nats-server configured by `specbus auth`.

One server per module with the role users of two runs (`ops/auth.py`) and TLS (certificates
made with `cryptography`, `ops/tls.py`); a second one with mutual TLS. Each role does its own
work; what it may not do is refused by the server and raised as `PermissionDenied` within one
request timeout, never a wait for the outage give-up.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path

import orjson
import pytest
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from specbus.bus.connection import connect
from specbus.bus.denied import PermissionDenied
from specbus.bus.lease import Leases
from specbus.bus.outage import ride
from specbus.bus.publisher import Publisher
from specbus.bus.replay import get
from specbus.bus.run import declare
from specbus.bus.subjects import Names
from specbus.consumers.bus_source import BusSource
from specbus.core.config import BusConfig
from specbus.core.contracts import Manifest, ManifestTarget, PromptTask, VocabTable
from specbus.core.errors import BusError
from specbus.ops.auth import permissions, role_bus, write_auth
from specbus.ops.services.cluster import NatsCluster, TlsFiles
from specbus.ops.tls import issue, make_ca

from tests.fixtures.nats import FAST_BUS, make_ref, make_task

RUN, OTHER, WORK = "ra", "rb", "rc"  # WORK: the roles' work end to end, on a run of its own
TIMEOUT = 1.0  # the request timeout: a refusal is raised after about this long


def tls_files(auth: Path, verify: bool) -> TlsFiles:
    tls = auth / "tls"
    return TlsFiles(tls / "ca.pem", tls / "server.pem", tls / "server.key", verify=verify)


@pytest.fixture(scope="module")
def auth_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("auth")
    write_auth(out, [RUN, OTHER], tls=True)
    write_auth(out, [WORK], tls=True)  # a run added later: the keys of the others are kept
    return out


@pytest.fixture(scope="module")
def server(auth_dir, tmp_path_factory):
    """One node with the role users and TLS (no client certificate required)."""
    tls = tls_files(auth_dir, verify=False)
    cluster = NatsCluster(tmp_path_factory.mktemp("nats"), 1, auth=auth_dir / "auth.conf", tls=tls)
    cluster.start()
    asyncio.run(_declare_runs(auth_dir, cluster.url))
    yield cluster
    cluster.stop()


async def _declare_runs(auth_dir: Path, url: str) -> None:
    for run in (RUN, OTHER, WORK):  # each run by its own admin (`specbus up --auth`)
        cfg = role_cfg(auth_dir, run, "admin")
        async with await connect(cfg, url, name=f"admin of {run}") as bus:
            await declare(bus, cfg, run)


def role_cfg(auth_dir: Path, run: str | None, role: str, **extra) -> BusConfig:
    bus = role_bus(auth_dir, run, role)
    bus["tls_ca"] = auth_dir / "tls" / "ca.pem"
    return BusConfig(**{**FAST_BUS, "connect_timeout_s": TIMEOUT, **bus, **extra})


async def refused(coro) -> PermissionDenied:
    t0 = time.monotonic()
    with pytest.raises(PermissionDenied) as e:
        await coro
    assert time.monotonic() - t0 < 10 * TIMEOUT, "a refusal must not wait long"
    return e.value


MANIFEST = Manifest(
    run=RUN, plan={"strategy": {"name": "eagle3"}}, plan_hash="abc", planned_tasks=1,
    target=ManifestTarget(model="m", fingerprint="fp", tokenizer_fingerprint="tfp",
                          num_layers=2, hidden_size=8, vocab_size=16),
    strategy="eagle3", vocab=VocabTable(d2t=(0, 1, 3), target_vocab_size=16),
)  # fmt: skip


def test_each_role_does_its_own_work(server, auth_dir):
    async def go():
        n = Names(RUN)
        async with await connect(role_cfg(auth_dir, RUN, "feeder"), server.url) as feeder:
            topo = await declare(feeder, None, RUN)  # finds everything declared: info only
            await Publisher(feeder).publish(n.tasks, make_task(RUN, 1))
            await topo.kv.put_manifest(MANIFEST)
        async with await connect(role_cfg(auth_dir, RUN, "intake"), server.url) as intake:
            # a driven run's intake reads its tasks (producers/live/driven.py)
            stored = await (await declare(intake, None, RUN)).task(1)
            assert stored is not None and PromptTask.from_bytes(stored.data).run_id == RUN
        async with await connect(role_cfg(auth_dir, RUN, "producer"), server.url) as producer:
            tasks = await Leases.join(producer, RUN, "producers")
            (task,) = await tasks.fetch(1, 2.0)
            await Publisher(producer).publish(n.samples, make_ref(RUN, 1))
            await tasks.ack_all([task], confirm=True)
        async with await connect(role_cfg(auth_dir, RUN, "trainer"), server.url) as trainer:
            refs = await Leases.join(trainer, RUN, "trainers")
            (ref,) = await refs.fetch(1, 2.0)
            await refs.ack_all([ref], confirm=True)
            kv = (await declare(trainer, None, RUN)).kv
            await kv.put_checkpoint({"step": 1})
            assert await kv.get_manifest() == MANIFEST
        async with await connect(role_cfg(auth_dir, RUN, "observer"), server.url) as observer:
            from specbus.bus.dead import list_dead
            from specbus.bus.status import run_status

            status = await run_status(observer, RUN)
            assert status["streams"][n.samples_stream]["messages"] == 1
            assert status["kv"]["checkpoint"] == {"step": 1}
            assert await list_dead(observer, RUN) == []

    asyncio.run(go())


def test_a_producer_cannot_ack_for_trainers_publish_tasks_or_read_another_run(server, auth_dir):
    async def go():
        n = Names(RUN)
        async with (
            await connect(role_cfg(auth_dir, RUN, "admin"), server.url) as admin,
            await connect(role_cfg(auth_dir, OTHER, "admin"), server.url) as other_admin,
            await connect(role_cfg(auth_dir, RUN, "producer"), server.url, name="producer") as p,
        ):
            await Publisher(admin).publish(n.samples, make_ref(RUN, 7))
            await Publisher(other_admin).publish(Names(OTHER).samples, make_ref(OTHER, 1))
            # The trainers' consumer: neither a pull nor an ack on a trainer's delivery.
            theirs = await Leases.join(p, RUN, "trainers")
            e = await refused(theirs.fetch(1, 0.5))
            assert "msg.next" in e.subject and "trainers" in e.subject
            trainers = await Leases.join(admin, RUN, "trainers")
            leases = await trainers.fetch(8, 2.0)
            adopted = [theirs.adopt(*h) for h in trainers.hand_over(leases)]
            e = await refused(theirs.ack_all(adopted, confirm=True))
            assert e.subject.startswith("$js.ack.") and "trainers" in e.subject
            # TASKS: only the feeder (and a trainer's recapture) publish there.
            e = await refused(Publisher(p).publish(n.tasks, make_task(RUN, 2)))
            assert e.subject == n.tasks and e.operation == "publish"
            # Another run's streams, KV and consumers.
            await refused(get(p, Names(OTHER).samples_stream, 1))
            await refused(Leases.join(p, OTHER, "producers"))
            await refused(Publisher(p).publish(Names(OTHER).samples, make_ref(OTHER, 2)))
            # It still does its own work on the same connection.
            assert (await get(p, n.samples_stream, 1)) is not None

    asyncio.run(go())


def test_the_observer_cannot_publish_anything(server, auth_dir):
    async def go():
        n = Names(RUN)
        async with await connect(role_cfg(auth_dir, RUN, "observer"), server.url) as obs:
            kv = (await declare(obs, None, RUN)).kv
            await refused(Publisher(obs).publish(n.samples, make_ref(RUN, 9)))
            await refused(Publisher(obs).publish(n.tasks, make_task(RUN, 9)))
            await refused(kv.put_checkpoint({"step": 99}))
            await refused(_pull(obs))

    async def _pull(bus):
        group = await Leases.join(bus, RUN, "trainers")
        return await group.fetch(1, 0.5)

    asyncio.run(go())


def test_unauthenticated_and_unknown_clients_are_refused(server, auth_dir, tmp_path):
    ca = auth_dir / "tls" / "ca.pem"

    async def go():
        t0 = time.monotonic()
        with pytest.raises(BusError, match="(?i)authoriz"):
            await connect(BusConfig(tls_ca=ca, connect_timeout_s=TIMEOUT), server.url)
        assert time.monotonic() - t0 < 10 * TIMEOUT
        # A key the server never saw.
        stranger = BusConfig(
            **role_bus(tmp_path, RUN, "producer"), tls_ca=ca, connect_timeout_s=TIMEOUT
        )
        with pytest.raises(BusError, match="(?i)authoriz"):
            await connect(stranger, server.url)

    asyncio.run(go())


def test_tls_needs_the_right_ca(server, auth_dir, tmp_path):
    wrong = make_ca(tmp_path / "wrong", name="another CA")

    async def go():
        cfg = role_cfg(auth_dir, RUN, "observer", tls_ca=wrong.cert, connect_give_up_s=2.0)
        with pytest.raises(BusError, match="(?i)certificate|ssl"):
            await connect(cfg, server.url)
        # Plain TCP to a TLS server is refused as well (the client asks for TLS it cannot verify).
        plain = role_cfg(auth_dir, RUN, "observer", tls_ca=None, connect_give_up_s=2.0)
        with pytest.raises(BusError):
            await connect(plain, server.url)

    asyncio.run(go())


def test_mutual_tls_needs_a_client_certificate_of_the_ca(auth_dir, tmp_path):
    cluster = NatsCluster(tmp_path / "nats", 1, auth=auth_dir / "auth.conf",
                          tls=tls_files(auth_dir, verify=True)).start()  # fmt: skip
    tls = auth_dir / "tls"
    other_ca = make_ca(tmp_path / "other", name="another CA")
    forged = issue(other_ca, tmp_path / "other", "observer", client=True)

    async def go():
        ok = role_cfg(auth_dir, RUN, "observer", tls_cert=tls / "observer.pem",
                      tls_key=tls / "observer.key")  # fmt: skip
        async with await connect(ok, cluster.url) as bus:
            assert bus.connected
        for cert, key in ((None, None), (forged.cert, forged.key)):
            cfg = role_cfg(auth_dir, RUN, "observer", tls_cert=cert, tls_key=key,
                           connect_give_up_s=2.0)  # fmt: skip
            with pytest.raises(BusError):
                await connect(cfg, cluster.url)

    try:
        asyncio.run(go())
    finally:
        cluster.stop()


# ---------------------------------------------------------------- isolation
# A push consumer delivers wherever its creator says: what a role could deliver is what it
# could publish. Each form of the server's consumer-create API subject, with a push config.
SNEAK = "sneak"


def _push_requests(stream: str, subject: str) -> list[tuple[str, dict]]:
    """(API subject, consumer config) of every way to create a push consumer on `stream`
    (`subject`: one the stream stores, for the filtered form); the deliver subject is the
    caller's."""
    api = "$JS.API.CONSUMER"
    push = {"ack_policy": "none", "deliver_policy": "all"}
    named = {**push, "name": SNEAK}
    return [
        (f"{api}.CREATE.{stream}", push),  # an ephemeral one
        (f"{api}.CREATE.{stream}.{SNEAK}", named),
        (f"{api}.CREATE.{stream}.{SNEAK}.{subject}", {**named, "filter_subject": subject}),
        (f"{api}.DURABLE.CREATE.{stream}.{SNEAK}", {**push, "durable_name": SNEAK}),
        # the trainers' own durable, turned into a push consumer (what a reposition recreated)
        (f"{api}.CREATE.{stream}.trainers", {**push, "name": "trainers"}),
        (f"{api}.DURABLE.CREATE.{stream}.trainers", {**push, "durable_name": "trainers"}),
    ]


async def _api(bus, subject: str, body: dict) -> dict:
    """A raw JetStream API request through the bus's ride-through (a refusal: PermissionDenied)."""
    payload = orjson.dumps(body)
    msg = await ride(
        bus, f"requesting {subject}", lambda: bus.nc.request(subject, payload, timeout=0.5)
    )
    return orjson.loads(msg.data)


class _Watch:
    """Everything the server delivers on `subjects` of one run's account, seen by its admin;
    `quiet()` proves nothing came: a marker published last must be the only message."""

    def __init__(self, bus, run: str):
        self.bus, self.run, self.got = bus, run, []

    async def start(self, *subjects: str) -> _Watch:
        for subject in subjects:
            await self.bus.nc.subscribe(subject, cb=self._on)
        await self.bus.nc.flush()
        return self

    async def _on(self, msg) -> None:
        self.got.append(msg.subject)

    async def quiet(self) -> list[str]:
        """What came before the marker (must be nothing)."""
        marker = f"specbus.{self.run}.marker"
        await self.bus.nc.publish(marker, b"")
        deadline = time.monotonic() + 10
        while marker not in self.got:
            assert time.monotonic() < deadline, "the marker never came back"
            await asyncio.sleep(0.01)
        return [s for s in self.got if s != marker]


async def _counts(bus, run: str) -> dict[str, int]:
    n = Names(run)
    streams = (n.tasks_stream, n.samples_stream, n.dead_stream, f"KV_{n.kv_bucket}")
    return {s: (await bus.js.stream_info(s)).state.last_seq for s in streams}


def test_no_role_can_create_a_consumer_that_delivers_anywhere(server, auth_dir):
    """The observer (on DEAD), a trainer and the colocated role (on SAMPLES) try every form of
    creating a push consumer, aimed at their own run's TASKS or KV and at the other run's
    subjects: each is refused by the server (`PermissionDenied`), nothing is delivered to
    either run, no stream changes. (On the old roles the observer and the trainers created
    them, and the server delivered into both runs.)"""
    ours, theirs = Names(RUN), Names(OTHER)
    targets = {
        "observer": (ours.dead_stream, ours.dead("tasks"), [ours.tasks, theirs.tasks]),
        "trainer": (ours.samples_stream, ours.samples,
                    [theirs.samples, theirs.tasks, f"$KV.{ours.kv_bucket}.manifest"]),
        "colocated": (ours.samples_stream, ours.samples, [theirs.tasks, ours.tasks]),
    }  # fmt: skip

    async def attack(role: str) -> list[str]:
        stream, subject, aims = targets[role]
        cfg = role_cfg(auth_dir, RUN, role, connect_timeout_s=0.5)
        refusals = []
        async with await connect(cfg, server.url, name=role) as bus:
            for i, (api, config) in enumerate(_push_requests(stream, subject)):
                config = {**config, "deliver_subject": aims[i % len(aims)]}
                try:
                    answer = await _api(bus, api, {"stream_name": stream, "config": config})
                except PermissionDenied as e:
                    refusals.append(e.subject)
                else:
                    raise AssertionError(f"{role} was not refused {api}: {answer}")
            # the trainers' durable: neither deleted nor reset by anyone but a trainer
            e = await refused(_api(bus, f"$JS.API.CONSUMER.DELETE.{stream}.trainers", {}))
            refusals.append(e.subject)
        return refusals

    async def go():
        async with (
            await connect(role_cfg(auth_dir, RUN, "admin"), server.url) as admin,
            await connect(role_cfg(auth_dir, OTHER, "admin"), server.url) as other,
        ):
            await Publisher(admin).publish(ours.dead("tasks"), make_task(RUN, 40))
            await Publisher(admin).publish(ours.samples, make_ref(RUN, 40))
            before = (await _counts(admin, RUN), await _counts(other, OTHER))
            mine = await _Watch(admin, RUN).start("specbus.ra.>", f"$KV.{ours.kv_bucket}.>")
            yours = await _Watch(other, OTHER).start("specbus.rb.>")
            refusals = await asyncio.gather(*(attack(role) for role in targets))
            assert [len(r) for r in refusals] == [7, 7, 7]
            assert all(s.startswith("$js.api.consumer.") for r in refusals for s in r)
            assert await mine.quiet() == [] and await yours.quiet() == []
            assert (await _counts(admin, RUN), await _counts(other, OTHER)) == before
            consumers = await admin.js.consumers_info(ours.samples_stream)
            assert sorted(c.name for c in consumers) == ["trainers"]
            assert [c.name for c in await admin.js.consumers_info(ours.dead_stream)] == []

    asyncio.run(go())


def test_a_push_consumer_delivers_only_within_its_run(server, auth_dir):
    """The isolation is the server's, not only the roles': even the run's admin, who may create
    any consumer in its run, cannot have the server deliver into another run. Its push
    consumer's deliveries to the other run's TASKS subject stay in its own account (its own
    subscriber gets them); the other run sees nothing and its TASKS stream is unchanged."""
    ours, theirs = Names(RUN), Names(OTHER)

    async def go():
        async with (
            await connect(role_cfg(auth_dir, RUN, "admin"), server.url) as admin,
            await connect(role_cfg(auth_dir, OTHER, "admin"), server.url) as other,
        ):
            await Publisher(admin).publish(ours.dead("samples"), make_ref(RUN, 41))
            dead = (await admin.js.stream_info(ours.dead_stream)).state.messages
            before = await _counts(other, OTHER)
            yours = await _Watch(other, OTHER).start("specbus.rb.>")
            mine = await _Watch(admin, RUN).start(theirs.tasks)  # in this run's account
            await admin.js.add_consumer(
                ours.dead_stream,
                ConsumerConfig(name=SNEAK, deliver_subject=theirs.tasks, ack_policy=AckPolicy.NONE,
                               deliver_policy=DeliverPolicy.ALL),
            )  # fmt: skip
            try:
                deadline = time.monotonic() + 10
                while len(mine.got) < dead:  # delivered, within this run
                    assert time.monotonic() < deadline, f"{len(mine.got)} of {dead} delivered"
                    await asyncio.sleep(0.01)
            finally:
                await admin.js.delete_consumer(ours.dead_stream, SNEAK)
            assert await yours.quiet() == []
            assert await _counts(other, OTHER) == before

    asyncio.run(go())


def test_no_role_but_the_admin_may_touch_a_consumer_definition():
    """What the roles may publish names no consumer create, update or delete subject: the
    trainers' reposition is a reset of their own durable, every replay a direct get."""
    for role in ("feeder", "producer", "trainer", "colocated", "intake", "observer"):
        allowed = permissions(RUN, role)["publish"]["allow"]
        touching = [s for s in allowed if any(f".CONSUMER.{v}" in s for v in ("CREATE", "DELETE", "DURABLE"))]  # fmt: skip
        assert touching == [], role
        names_run = (
            f"specbus.{RUN}.",
            f"SPECBUS_{RUN}_",
            f"SPECBUS_{RUN}.",
            f"KV_SPECBUS_{RUN}",
            f"_INBOX.{RUN}.",
        )
        assert all(any(w in s for w in names_run) or s in ("$JS.API.INFO", "$JS.API.STREAM.NAMES")
                   for s in allowed), role  # fmt: skip


def _gone(ref):
    """`ref` naming a key of an (empty) mem:// store: its tensors are gone, as after a restart."""
    spec = ref.features["hidden_states"]
    spec = spec.model_copy(update={"key": f"{ref.run_id}/{ref.sample_id}/g0/hidden_states"})
    return ref.model_copy(
        update={"store_uri": f"mem://{ref.run_id}", "features": {"hidden_states": spec}}
    )


def test_replay_reposition_recapture_and_dead_letters_work_under_roles(server, auth_dir):
    """The roles' rights create no consumer, yet everything the roles did with one still
    works (a run of its own, WORK): the trainer replays SAMPLES, repositions its group (a
    reset in place), recaptures refs whose tensors are gone and dead-letters a foreign ref; the
    colocated role repositions the producers (a colocated resume); the observer lists the dead letters and the status (`specbus dead`, `specbus status`)."""
    n = Names(WORK)

    def cfg(role: str) -> BusConfig:
        return role_cfg(auth_dir, WORK, role)

    async def go():
        async with await connect(cfg("feeder"), server.url) as feeder:
            await Publisher(feeder).publish_many(n.tasks, [make_task(WORK, i) for i in (1, 2, 3)])
        async with await connect(cfg("producer"), server.url) as producer:
            run = await declare(producer, None, WORK)
            tasks = await Leases.join(producer, WORK, "producers")
            leases = await tasks.fetch(3, 2.0)
            assert [lease.seq for lease in leases] == [1, 2, 3]
            # refs of tasks 1 and 2 whose tensors are gone, one of another run
            refs = [_gone(make_ref(WORK, 1)), _gone(make_ref(WORK, 2)), make_ref(OTHER, 3)]
            await Publisher(producer).publish_many(n.samples, refs)
            await tasks.ack_all(leases[:2], confirm=True)
            await run.dead_letter(leases[2], "invalid", "no engine runs it")
        async with await connect(cfg("trainer"), server.url) as trainer:
            run = await declare(trainer, None, WORK)
            assert [s.seq async for s in run.replay("trainers", 1)] == [1, 2, 3]
            assert [s.seq async for s in run.replay("trainers", 2, end_seq=2)] == [2]
            group = await Leases.join(trainer, WORK, "trainers")
            first = await group.fetch(3, 2.0)
            await group.ack_all(first, confirm=True)
            await run.reposition("trainers", 1)  # everything again, as first deliveries
            source = BusSource(run, group, strategy="eagle3", features=("hidden_states",))
            assert await source.take(3, 2.0) == []  # recaptured, recaptured, dead-lettered
            assert {k: source.stats[k] for k in ("recaptures", "dead_letters", "skipped")} == {
                "recaptures": 2,
                "dead_letters": 1,
                "skipped": 0,
            }
            again = [PromptTask.from_bytes((await run.task(seq)).data) for seq in (4, 5)]
            assert [(t.task_id, t.generation) for t in again] == [("t1", 1), ("t2", 1)]
        async with await connect(cfg("colocated"), server.url) as colocated:
            # a colocated world's resume repositions the producers (it captures TASKS itself)
            run = await declare(colocated, None, WORK)
            await run.reposition("producers", 2)
            tasks = await Leases.join(colocated, WORK, "producers")
            leases = await tasks.fetch(4, 2.0)
            assert [(lease.seq, lease.deliveries) for lease in leases] == [(s, 1) for s in (2, 3, 4, 5)]  # fmt: skip
            await tasks.ack_all(leases, confirm=True)
        async with await connect(cfg("observer"), server.url) as observer:
            from specbus.bus.dead import list_dead
            from specbus.bus.status import run_status

            dead = await list_dead(observer, WORK)
            assert [(d.stream, d.seq, d.reason) for d in dead] == [
                (n.tasks_stream, 3, "invalid"),
                (n.samples_stream, 3, "invalid"),
            ]
            assert PromptTask.from_bytes(dead[0].data).task_id == "t3"
            status = await run_status(observer, WORK)
            assert status["dead_letters"] == 2
            assert status["streams"][n.tasks_stream]["messages"] == 5
            assert status["consumers"]["trainers"]["ack_pending"] == 0

    asyncio.run(go())


@pytest.mark.slow  # ~22 s on 2 cores: three nodes and six CLI processes
def test_specbus_auth_for_two_runs_and_up_with_roles_over_mutual_tls(tmp_path):
    """The commands as an operator runs them: `specbus auth` for a run, then for another (the
    first run's keys kept); `specbus up --cluster 3 --auth --tls --mtls` declares its run as
    that run's admin; its observer's `specbus status` and `specbus dead` work, the other
    run's observer sees nothing of it (its own run is not declared: exit 1); `specbus up`
    for a run the auth dir has no users of is refused before any server starts."""
    from tests.test_broker_lifecycle import READY, Proc

    auth, run_dir = tmp_path / "auth", f"run_dir={tmp_path / 'run'}"

    def observer(run: str) -> list[str]:
        bus = role_bus(auth, run, "observer", tls=True)
        return [f"bus.{k}={v}" for k, v in bus.items()]

    assert Proc(tmp_path, "auth", "--out", str(auth), "--tls", "run=ra").wait() == 0
    seeds = {p: p.read_bytes() for p in (auth / "ra").glob("*.nk")}
    assert len(seeds) == 7  # six roles and the run's admin
    assert Proc(tmp_path, "auth", "--out", str(auth), "--tls", "run=rb").wait() == 0
    assert {p: p.read_bytes() for p in (auth / "ra").glob("*.nk")} == seeds
    conf = (auth / "auth.conf").read_text()
    assert '"SPECBUS_ra"' in conf and '"SPECBUS_rb"' in conf

    stranger = Proc(tmp_path, "up", "--auth", str(auth), "run=rc", run_dir)
    assert stranger.wait() == 2
    assert "holds no admin of run 'rc'" in "".join(stranger.lines)

    tls = ["--tls", str(auth / "tls"), "--mtls"]
    up = Proc(tmp_path, "up", "--cluster", "3", "--auth", str(auth), *tls, "run=ra", run_dir,
              "bus.replicas=3")  # fmt: skip
    try:
        url = up.expect(r"cluster ready at (\S+) ").group(1)
        up.expect(READY)
        status = Proc(tmp_path, "status", "--json", "run=ra", run_dir, *observer("ra"))
        assert status.wait() == 0, status.lines
        out = "".join(status.lines)
        shown = json.loads(out[out.index("{") :])
        assert shown["declared"] and shown["dead_letters"] == 0
        dead = Proc(tmp_path, "dead", "run=ra", run_dir, *observer("ra"))
        assert dead.wait() == 0 and "no dead letters" in "".join(dead.lines)
        theirs = Proc(tmp_path, "status", "run=rb", f"bus.url={url}", *observer("rb"))
        assert theirs.wait() == 1 and "not declared" in "".join(theirs.lines)
    finally:
        up.proc.send_signal(signal.SIGINT)
        assert up.wait() == 0
