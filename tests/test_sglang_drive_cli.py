"""A driven run through the CLI, end to end: `specbus feed`, `specbus intake`, a layer-applied
SGLang server, `specbus produce` on `target.engine: sglang_server`, `specbus train`.

Real processes, started as users start them (the launcher, `ops/launch.py`): the broker, the
feeder, the intake (waiting for the feeder's manifest), the stand-in SGLang server of
`tests/sglang_server.py` (SGLang's own request parsing, the layer's real hooks and sink; it
finds the intake through `<run_dir>/live/intake.json`, as docs/sglang.md has it), a
`DrivenWorker` producer and one trainer rank, on a shm store.
"""

from __future__ import annotations

import asyncio
import socket

import pytest
from specbus.core.errors import ConfigError
from specbus.core.store import open_store
from specbus.ops import sglang_layer as layer
from specbus.ops.intake_endpoint import endpoint_file
from specbus.ops.live import run_intake
from specbus.ops.services.common import free_port

from tests.fixtures.live import LiveRun, wait_until
from tests.fixtures.pipeline import pipeline_config, write_tokenised_data
from tests.test_live_pipeline import refs_of
from tests.test_sglang_drive import Server

N = 8  # tasks: 4 full windows of 1 rank x micro-batch 2, every one trained


@pytest.fixture
def applied(sglang_site):
    layer.apply(sglang_site)
    try:
        yield sglang_site
    finally:
        layer.revert(sglang_site)


def finish(run: LiveRun, names, server, timeout_s: float) -> None:
    """Until every one of `names` exited 0; a failure fails at once (a dead producer would
    leave the trainer waiting), with every process's log tail."""

    def done():
        codes = [run.procs[n].poll() for n in names]
        return all(c is not None for c in codes) or any(c not in (None, 0) for c in codes)

    try:
        wait_until(done, timeout_s, f"{', '.join(names)} to finish")
    finally:
        codes = {n: run.procs[n].poll() for n in names}
        if any(c != 0 for c in codes.values()):
            tails = [f"--- {n} ({codes.get(n, 'running')})\n{run.log(n)[-2500:]}"
                     for n in (*names, "intake")]  # fmt: skip
            tails.append(f"--- server\n{server.log.read_text(errors='replace')[-2500:]}")
            pytest.fail(f"exit codes {codes}\n" + "\n".join(tails))


@pytest.mark.slow  # five processes on 2 cores: ~35 s
def test_a_driven_run_through_the_cli_trains_every_task_once(
    applied, sglang_env, chat_target, nats_server, run_id, tmp_path
):
    data = write_tokenised_data(tmp_path / "tasks.jsonl", N)
    server_port = free_port()
    # Held (listening) until the server starts, seconds later: another worker's free_port()
    # probe then sees it taken (CI once lost the port to one in that window: EADDRINUSE).
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    holder.bind(("127.0.0.1", server_port))
    holder.listen()
    cfg = pipeline_config(run_id, tmp_path / "run", chat_target, data, store_uri=f"shm://{run_id}",
                          overrides=["target.engine=sglang_server",
                                     f"target.server_url=http://127.0.0.1:{server_port}"])  # fmt: skip
    run = LiveRun(cfg, tmp_path / "procs", nats_server.url)
    server = None
    try:
        run.start("feeder", "feed")
        intake_port = next(p for p in iter(free_port, None) if p != server_port)
        run.start_intake(intake_port)  # ready once the feeder's manifest is there and checked
        with run.intake_client() as c:
            hs = c.get("/v1/spec-capture/config").json()
        assert hs["sample_rate"] == 0  # a driven run's handshake: driven requests only
        env = {**sglang_env, "SPECBUS_CAPTURE_ENDPOINT": str(endpoint_file(cfg))}
        opts = {"model": str(chat_target), "layer_ids": hs["aux_layers"],
                "hidden": hs["hidden_size"], "port": server_port}  # fmt: skip
        holder.close()
        server = Server(env, opts, tmp_path / "server.log").start()
        run.start("producer-0", "produce", "--id", "p0")
        run.trainers(1)
        finish(run, ("feeder", "producer-0", "trainer-0"), server, timeout_s=300)

        fed = {f"t{i}-e0" for i in range(N)}
        state = run.checkpoint_state()
        assert sorted(state["lineage"]) == sorted(fed), "every task trained exactly once"
        assert state["step"] == N // 2  # (the stand-in forward's rows train no useful draft)
        assert f"producer done: {N} samples from {N} tasks, 0 failures" in run.log("producer-0")
        refs = refs_of(nats_server.url, cfg.run)
        assert sorted(r.sample_id for r in refs) == sorted(fed)  # one ref per task
        assert {r.task_id for r in refs} == {f"t{i}" for i in range(N)}
        metrics = run.intake_metrics()
        assert metrics.get(("200", "accepted")) == N and not metrics.get(("200", "duplicate"))
        store = open_store(cfg.store.uri)
        try:
            store.gc()
            assert store.usage().resident_bytes == 0  # the trainer swept what it trained
        finally:
            store.close()
        assert run.terminate("intake") == 0
        assert f"{N} accepted" in run.log("intake")
        # an intake whose config is not the feeder's plan is refused, by name
        other = pipeline_config(run_id, tmp_path / "other", chat_target, data,
                                store_uri=f"shm://{run_id}x",
                                overrides=["target.engine=sglang_server", "data.limit=4"])  # fmt: skip
        with pytest.raises(ConfigError, match="manifest of another plan"):
            asyncio.run(run_intake(other, bus_url=nats_server.url, port=0))
    finally:
        holder.close()  # idempotent: released already unless the run failed before the server
        if server is not None:
            server.kill()
        run.stop()


def test_intake_refuses_a_disaggregated_run_on_another_engine(chat_target, tmp_path, run_id):
    data = write_tokenised_data(tmp_path / "tasks.jsonl", 2)
    cfg = pipeline_config(run_id, tmp_path / "run", chat_target, data, store_uri=f"shm://{run_id}")
    with pytest.raises(ConfigError, match="deployment.mode=live.*target.engine sglang_server"):
        asyncio.run(run_intake(cfg, bus_url=None, port=0))
