"""Connection: fails fast and quietly on a dead URL, passes auth through, survives restarts."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from specbus.bus.connection import connect
from specbus.core.config import BusConfig
from specbus.core.errors import BusError, ConfigError
from specbus.ops.services.common import free_port
from specbus.ops.services.nats import NatsServer


def test_an_unreachable_broker_fails_after_the_connect_give_up_with_one_line_errors(caplog):
    cfg = BusConfig(connect_timeout_s=0.5, reconnect_wait_s=0.1, connect_give_up_s=1.0)
    url = f"nats://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with (
        caplog.at_level(logging.DEBUG, logger="specbus.bus"),
        pytest.raises(BusError, match="cannot connect"),
    ):
        asyncio.run(connect(cfg, url))
    assert time.monotonic() - t0 < 5
    records = [r for r in caplog.records if r.name == "specbus.bus"]
    assert records, "connection errors are logged"
    assert all("\n" not in r.getMessage() and r.exc_info is None for r in records)
    # The same error repeated is logged once at WARNING, the repeats at DEBUG; the wait for
    # the broker is announced once.
    warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and "not reachable yet" in warnings[1], warnings


def test_a_process_started_during_an_outage_waits_for_the_broker(tmp_path, caplog, monkeypatch):
    """A producer restarted while the broker is down (issue 12: a restart during a 60 s
    outage exited 2) connects once the broker is back, within bus.connect_give_up_s; the wait
    is said at the first refusal (under 5 s: issue 34), with how to start a broker, and then
    with a progress line (every 15 s; 0.3 s here)."""
    import specbus.bus.connection as connection

    monkeypatch.setattr(connection, "PROGRESS_S", 0.3)
    server = NatsServer(tmp_path / "nats")
    cfg = BusConfig(connect_timeout_s=0.5, reconnect_wait_s=0.1, connect_give_up_s=60)

    async def body():
        t0 = time.monotonic()
        connecting = asyncio.create_task(connect(cfg, server.url, name="late"))
        while not any("not reachable yet" in r.getMessage() for r in caplog.records):
            assert not connecting.done(), connecting  # still waiting, not failed
            await asyncio.sleep(0.05)
        assert time.monotonic() - t0 < 5.0
        assert "specbus up" in caplog.text
        while "still waiting for the broker" not in caplog.text:
            assert not connecting.done(), connecting
            await asyncio.sleep(0.05)
        await asyncio.to_thread(server.start)  # the broker comes up after its client
        bus = await asyncio.wait_for(connecting, 30)
        assert bus.connected
        await bus.close()

    try:
        with caplog.at_level(logging.WARNING, logger="specbus.bus"):
            asyncio.run(body())
    finally:
        server.stop()
    assert any("connected to" in r.getMessage() for r in caplog.records)


def test_no_url_is_a_clear_error():
    with pytest.raises(ConfigError, match="no broker URL"):
        asyncio.run(connect(BusConfig()))


@pytest.fixture
def auth_server(tmp_path):
    """A broker that requires user/password (and JetStream, like the embedded one)."""
    conf = tmp_path / "auth.conf"
    conf.write_text(
        f'jetstream {{ store_dir: "{tmp_path / "js"}" }}\n'
        'authorization { users = [ { user: "trainer", password: "s3cret" } ] }\n'
    )
    server = NatsServer(tmp_path, config_file=conf).start()
    yield server
    server.stop()


def test_user_and_password_are_passed_through(auth_server):
    async def body():
        bus = await connect(BusConfig(user="trainer", password="s3cret"), auth_server.url)
        info = await bus.js.account_info()
        assert info is not None
        await bus.close()

    asyncio.run(body())
    t0 = time.monotonic()  # refused credentials are not retried until the connect give-up
    with pytest.raises(BusError, match="cannot connect"):
        asyncio.run(
            connect(
                BusConfig(user="trainer", password="wrong", connect_timeout_s=0.5), auth_server.url
            )
        )
    assert time.monotonic() - t0 < 30


def test_a_missing_creds_file_is_named(tmp_path):
    cfg = BusConfig(creds_file=tmp_path / "nope.creds")
    with pytest.raises(ConfigError, match="nope.creds"):
        asyncio.run(connect(cfg, "nats://127.0.0.1:4222"))


def test_the_connection_survives_a_broker_restart(private_nats_server):
    async def body():
        bus = await connect(BusConfig(reconnect_wait_s=0.1), private_nats_server.url)
        private_nats_server.kill()
        private_nats_server.start()
        for _ in range(100):
            if bus.connected and bus.reconnects == 1:
                break
            await asyncio.sleep(0.05)
        assert bus.connected and bus.reconnects == 1
        assert (await bus.js.account_info()) is not None
        await bus.close()

    asyncio.run(body())
