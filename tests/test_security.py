"""Roles, permissions and TLS against a real nats-server configured by `specbus auth`.

One server per module with the role users of two runs (`ops/auth.py`) and TLS (certificates
made with `cryptography`, `ops/tls.py`); a second one with mutual TLS. Each role does its own
work; what it may not do is refused by the server and raised as `PermissionDenied` within one
request timeout, never a wait for the outage give-up.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from specbus.bus.connection import connect
from specbus.bus.denied import PermissionDenied
from specbus.bus.lease import Leases
from specbus.bus.publisher import Publisher
from specbus.bus.replay import get
from specbus.bus.subjects import Names
from specbus.bus.topology import declare
from specbus.core.config import BusConfig
from specbus.core.contracts import Manifest, ManifestTarget, PromptTask, VocabTable
from specbus.core.errors import BusError
from specbus.ops.auth import role_bus, write_auth
from specbus.ops.services.cluster import NatsCluster, TlsFiles
from specbus.ops.tls import issue, make_ca

from tests.fixtures.nats import FAST_BUS, make_ref, make_task

RUN, OTHER = "ra", "rb"
TIMEOUT = 1.0  # the request timeout: a refusal is raised after about this long


def tls_files(auth: Path, verify: bool) -> TlsFiles:
    tls = auth / "tls"
    return TlsFiles(tls / "ca.pem", tls / "server.pem", tls / "server.key", verify=verify)


@pytest.fixture(scope="module")
def auth_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("auth")
    write_auth(out, [RUN, OTHER], tls=True)
    return out


@pytest.fixture(scope="module")
def server(auth_dir, tmp_path_factory):
    """One node with the role users and TLS (no client certificate required)."""
    tls = tls_files(auth_dir, verify=False)
    cluster = NatsCluster(tmp_path_factory.mktemp("nats"), 1, auth=auth_dir / "auth.conf", tls=tls)
    cluster.start()
    cfg = role_cfg(auth_dir, None, "admin")
    asyncio.run(_declare_runs(cfg, cluster.url))
    yield cluster
    cluster.stop()


async def _declare_runs(cfg: BusConfig, url: str) -> None:
    async with await connect(cfg, url, name="admin") as bus:
        for run in (RUN, OTHER):
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
            await connect(role_cfg(auth_dir, RUN, "producer"), server.url, name="producer") as p,
        ):
            await Publisher(admin).publish(n.samples, make_ref(RUN, 7))
            await Publisher(admin).publish(Names(OTHER).samples, make_ref(OTHER, 1))
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
