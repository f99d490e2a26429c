"""Observability of a real run (real broker, shm store, tiny target): one trace follows a
sample from its feed to the step that trained it (in-process, and exported by separate
processes to a real OTLP/HTTP receiver); rank 0 writes TensorBoard scalars, and the same to
an offline Weights & Biases run; `specbus top --once` shows the run."""

from __future__ import annotations

import asyncio
import threading
import uuid

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from specbus.core.telemetry import setup_tracing
from specbus.ops.cli import main as cli_main
from specbus.ops.observe import finish_trackers
from specbus.ops.produce import run_feeder, run_producer
from specbus.ops.train import run_trainer

from tests.fixtures.pipeline import Cluster, pipeline_config, write_tokenised_data

# a trained sample's path, from the step up to the root of its trace
CHAIN = ["train_step", "lease", "publish", "capture", "publish", "feed"]


def chain_of(span, by_id) -> list:
    """`span` and its ancestors, while the parent was received."""
    out = [span]
    while out[-1]["parent"] in by_id:
        out.append(by_id[out[-1]["parent"]])
    return out


def check_traces(spans: list[dict]) -> list[dict]:
    """Every step's chain of parents reaches a feed span in the same trace, and the step links
    to the lease span of each sample it trained; returns the first step's chain."""
    by_id = {s["id"]: s for s in spans}
    steps = [s for s in spans if s["name"] == "train_step"]
    assert steps
    for step in steps:
        chain = chain_of(step, by_id)
        assert [s["name"] for s in chain] == CHAIN, [s["name"] for s in chain]
        assert {s["trace"] for s in chain} == {step["trace"]}
        assert step["parent"] in step["links"]
        assert all(by_id[link]["name"] == "lease" for link in step["links"] if link in by_id)
        assert "ack" in {s["name"] for s in spans if s["parent"] == step["id"]}
    # the store release follows the lockstep exchange after the commit (every rank is past
    # it), so it is traced outside the step that trained the samples
    assert any(s["name"] == "release" for s in spans)
    return chain_of(steps[0], by_id)


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, tiny_target, nats_server):
    """A fed, captured and trained run (4 steps), its spans recorded in memory."""
    tmp = tmp_path_factory.mktemp("observed")
    run = "t" + uuid.uuid4().hex[:12]
    exporter = InMemorySpanExporter()
    provider = setup_tracing("specbus-test", exporter=exporter)
    data = write_tokenised_data(tmp / "data.jsonl", 8)
    cfg = pipeline_config(run, tmp / "run", tiny_target, data, store_uri=f"shm://{run}",
                          overrides=["telemetry.wandb=true"])  # offline, under the run dir  # fmt: skip
    asyncio.run(run_feeder(cfg, bus_url=nats_server.url))
    producer = threading.Thread(
        target=lambda: asyncio.run(run_producer(cfg, bus_url=nats_server.url))
    )
    producer.start()
    result = run_trainer(cfg, bus_url=nats_server.url)
    finish_trackers()  # what the trainer process does at exit
    producer.join(60)
    provider.force_flush()
    spans = [
        {
            "name": s.name,
            "trace": s.context.trace_id,
            "id": s.context.span_id,
            "parent": s.parent.span_id if s.parent else None,
            "links": [link.context.span_id for link in s.links],
        }
        for s in exporter.get_finished_spans()
    ]
    return cfg, result, spans


def test_a_step_continues_the_trace_of_its_samples(trained_run):
    _, result, spans = trained_run
    assert result.steps == 4
    check_traces(spans)


def test_rank0_writes_tensorboard_scalars(trained_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg, _, _ = trained_run
    acc = EventAccumulator(str(cfg.resolved_tensorboard_dir))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for tag in ("train/loss", "train/acc_0", "train/ploss_1", "acceptance/sim_accept_len",
                "optim/lr", "optim/grad_norm", "throughput/samples_per_s",
                "throughput/world_samples_per_s",
                "throughput/tokens_per_s", "time/data_wait_frac", "time/bus_s_per_step",
                "store/resident_bytes", "bus/lag_refs", "bus/redeliveries",
                "bus/dead_letters"):  # fmt: skip
        assert tag in tags, sorted(tags)
    assert [e.step for e in acc.Scalars("train/loss")] == [2, 4]  # log_every 2, 4 steps


def test_rank0_logs_the_tensorboard_scalars_to_an_offline_wandb_run(trained_run):
    """`telemetry.wandb` (offline): the W&B run directory under the run dir holds the same
    scalars as TensorBoard, under the same tags, at the same steps."""
    from specbus.core.wandb_log import read_offline_scalars
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg, _, _ = trained_run
    (run_dir,) = (cfg.resolved_run_dir / "wandb").glob("offline-run-*")
    rows = read_offline_scalars(run_dir, wait_s=30)  # the run finished: its file complete
    assert [row["_step"] for row in rows] == [2, 4]  # log_every 2, 4 steps
    acc = EventAccumulator(str(cfg.resolved_tensorboard_dir))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {k for row in rows for k in row if not k.startswith("_")} == tags
    for tag in tags:
        board = [(e.step, e.value) for e in acc.Scalars(tag)]
        logged = [(row["_step"], row[tag]) for row in rows if tag in row]
        assert [s for s, _ in logged] == [s for s, _ in board], tag
        for (_, a), (_, b) in zip(logged, board, strict=True):
            assert a == pytest.approx(b, rel=1e-6), tag  # TensorBoard keeps float32


def test_the_console_line_gives_the_worlds_samples_per_s_and_the_ranks():
    from specbus.ops.commands import format_row

    one = format_row({"step": 3, "samples_per_s": 0.8, "world_samples_per_s": 0.8})
    two = format_row({"step": 3, "samples_per_s": 0.8, "world_samples_per_s": 1.6})
    assert "0.8 samples/s" in one and "/rank" not in one
    assert "1.6 samples/s (0.8/rank)" in two


def test_top_once_shows_the_run(trained_run, nats_server, capsys):
    cfg, _, _ = trained_run
    code = cli_main(["top", "--once", "--url", nats_server.url, f"run={cfg.run}",
                     f"run_dir={cfg.resolved_run_dir}"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"run {cfg.run}" in out and "training complete" in out
    assert "progress   last known" in out and "step 4 |" in out and "steps/s" in out
    lines = {line.split()[0]: line.split() for line in out.splitlines() if line.strip()}
    assert lines["trainers"][1:3] == ["0", "0"]  # no lag, nothing pending after the run
    assert lines["dead"][1] == "0"


def test_processes_export_one_trace_from_feed_to_step(
    tmp_path, tiny_target, nats_server, run_id, otlp_receiver
):
    """Feeder, producer and trainer processes export over OTLP/HTTP (configured only by
    OTEL_* variables) to a real receiver; the steps' traces reach back to the feed."""
    data = write_tokenised_data(tmp_path / "data.jsonl", 8)
    cfg = pipeline_config(run_id, tmp_path / "run", tiny_target, data, store_uri=f"shm://{run_id}",
                          overrides=["telemetry.tensorboard=false"])  # fmt: skip
    cluster = Cluster(cfg, tmp_path / "procs", nats_server.url)
    cluster.launcher.env.update(
        OTEL_EXPORTER_OTLP_ENDPOINT=otlp_receiver.endpoint, OTEL_BSP_SCHEDULE_DELAY="200"
    )
    try:
        cluster.start("feeder", "feed")
        cluster.start("producer", "produce", "--id", "p0")
        cluster.trainers(1)
        cluster.assert_ok(cluster.wait("feeder", "producer", "trainer-0", timeout=180))
    finally:
        cluster.stop()
    assert otlp_receiver.wait_for(lambda got: sum(s.name == "train_step" for s in got) == 4)
    spans = [
        {"name": s.name, "trace": s.trace_id, "id": s.span_id, "parent": s.parent_span_id,
         "links": [span_id for _, span_id in s.links], "service": s.service}
        for s in otlp_receiver.spans
    ]  # fmt: skip
    chain = check_traces(spans)
    assert [s["service"] for s in chain] == ["specbus-trainer"] * 2 + ["specbus-producer"] * 2 + [
        "specbus-feeder"
    ] * 2


def test_an_offline_runs_scalars_are_read_once_its_file_is_complete(tmp_path):
    """`read_offline_scalars(wait_s=...)` returns a finished run's rows, and on a file cut
    mid-record (W&B's service process still writing it) returns the whole records only, or,
    asked for a finished run, raises TimeoutError instead of rows that are not all there."""
    from specbus.core.wandb_log import WandbWriter, read_offline_scalars

    writer = WandbWriter(tmp_path, project="p", name="r", mode="offline")
    for step in (1, 2, 3):
        writer.write({"loss": 1.0 / step}, step=step)
    writer.close()
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    rows = read_offline_scalars(run_dir, wait_s=30)
    assert [row["_step"] for row in rows] == [1, 2, 3]
    (path,) = run_dir.glob("run-*.wandb")
    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / path.name).write_bytes(path.read_bytes()[:-100])  # the exit record cut through
    partial = read_offline_scalars(cut)  # the whole records before the cut, no error
    assert partial == rows[: len(partial)]
    with pytest.raises(TimeoutError, match="no exit record"):
        read_offline_scalars(cut, wait_s=0.2)
