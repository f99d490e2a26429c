"""Prometheus `/metrics` of every long-running process, scraped over HTTP and parsed with
`prometheus_client.parser`: the feeder while it runs, a producer and trainer rank 0 of a
disaggregated run (found through their file-based discovery entries), the intake and
`specbus serve` of a live run (real processes, a real broker)."""

from __future__ import annotations

import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from specbus.ops.metrics_http import series_name

from tests.fixtures.live import LiveRun, live_config, wait_until, write_chats
from tests.fixtures.pipeline import Cluster, pipeline_config, write_tokenised_data

pytestmark = pytest.mark.slow  # real processes: ~40-60 s each on 2 loaded cores


class Scraper:
    """Polls one process's `/metrics` (`scrape`) the way Prometheus does: a scrape the
    connection drops is a gap (None), not the end, while the process runs; once it has
    exited, the test fails with its log's tail. Dropped scrapes are counted (`dropped`), so
    that a server that drops them as a habit still fails the test.

    Why: CI once saw `Server disconnected without sending a response` from the feeder's
    endpoint, the feeder's log unseen; a dead process now says why it died."""

    def __init__(self, cluster, name: str):
        self.proc, self.log = cluster.procs[name], cluster.launcher.log_path(name)
        self.name, self.dropped = name, 0

    def __call__(self, url: str) -> dict[str, dict] | None:
        try:
            return scrape(url)
        except httpx.TransportError as e:
            if self.proc.poll() is not None:
                tail = self.log.read_text(errors="replace")[-3000:]
                raise AssertionError(f"{self.name} exited with {self.proc.returncode} while "
                                     f"scraped ({e!r})\n{tail}") from e  # fmt: skip
            self.dropped += 1
            tail = self.log.read_text(errors="replace")[-1500:]
            print(f"{self.name}'s /metrics dropped a scrape ({e!r}); its log ends:\n{tail}")
            assert self.dropped <= 3, f"{self.name}'s /metrics dropped {self.dropped} scrapes"
            return None


def scrape(url: str, headers: dict | None = None) -> dict[str, dict]:
    """{family name: {"type", "samples": {sample name + labels: value}}} of one `/metrics`."""
    text = httpx.get(url, headers=headers, timeout=10.0).text
    out = {}
    for family in text_string_to_metric_families(text):
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in family.samples}
        out[family.name] = {"type": family.type, "samples": samples}
    return out


def value(families: dict, name: str, **labels) -> float:
    """The one sample `name{labels}` (counters: the `_total` sample). Missing, the failure
    lists every sample named `name` (other labels), else the families scraped."""
    want = {k: str(x) for k, x in labels.items()}
    others = []
    for fam in families.values():
        for (sample, lab), v in fam["samples"].items():
            if sample == name:
                if dict(lab) == want:
                    return v
                others.append(f"{name}{dict(lab)} = {v}")
    if others:
        raise AssertionError(f"no sample {name}{want}; its samples: {others}")
    raise AssertionError(f"no sample {name}{want} in {sorted(families)}")


def endpoints(cfg, role: str) -> list[str]:
    """The `/metrics` URLs `role` announced for Prometheus' file-based discovery."""
    out = []
    for path in (cfg.resolved_run_dir / "metrics").glob(f"{role}-*.json"):
        try:
            (entry,) = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # being replaced
        assert entry["labels"] == {"run": cfg.run, "role": role}
        out += [f"http://{target}/metrics" for target in entry["targets"]]
    return out


def test_the_feeder_producer_and_trainer_serve_their_scalars(tmp_path, tiny_target, nats_server,
                                                             run_id):  # fmt: skip
    n = 300  # more than the feeder's batch (256), so that it waits after the first
    data = write_tokenised_data(tmp_path / "data.jsonl", n)
    cfg = pipeline_config(run_id, tmp_path / "run", tiny_target, data,
                          store_uri=f"shm://{run_id}",
                          overrides=["bus.max_ack_pending=2", "training.log_every=1",
                                     "training.checkpoint_every=2"])  # fmt: skip
    cluster = Cluster(cfg, tmp_path / "procs", nats_server.url)
    try:
        # The feeder stays 4 x max_ack_pending = 8 tasks ahead of the producers: past its
        # first batch it waits, and is scraped while it runs.
        cluster.start("feeder", "feed")
        feeder = wait_until(lambda: endpoints(cfg, "feeder"), 180, "the feeder's /metrics",
                            cluster.procs["feeder"])  # fmt: skip
        poll = Scraper(cluster, "feeder")
        fams = wait_until(lambda: (f := poll(feeder[0])) and value(
            f, "specbus_feeder_held_back_tasks") >= 8 and f, 180, "the feeder held back",
            poll.proc, poll.log)  # fmt: skip
        assert value(fams, "specbus_feeder_planned_tasks") == n
        assert value(fams, "specbus_feeder_published_tasks_total") == 256
        assert fams["specbus_feeder_published_tasks"]["type"] == "counter"
        assert value(fams, "process_resident_memory_bytes") > 0

        cluster.start("producer-0", "produce")
        cluster.trainers(1)
        producer = wait_until(lambda: endpoints(cfg, "producer"), 180, "the producer's /metrics",
                              cluster.procs["producer-0"])  # fmt: skip
        poll = Scraper(cluster, "producer-0")
        fams = wait_until(lambda: (f := poll(producer[0])) and value(
            f, "specbus_producer_samples_total") >= 6 and f, 120, "captures on /metrics",
            poll.proc, poll.log)  # fmt: skip
        assert value(fams, "specbus_producer_tasks_total") >= 6
        assert value(fams, "specbus_producer_capture_seconds_total") > 0
        assert value(fams, "specbus_producer_dead_letters_total") == 0
        assert value(fams, "specbus_producer_store_resident_bytes") >= 0

        trainer = wait_until(lambda: endpoints(cfg, "trainer"), 180, "the trainer's /metrics",
                             cluster.procs["trainer-0"])  # fmt: skip

        poll = Scraper(cluster, "trainer-0")

        def trained(k: int):
            fams = poll(trainer[0])
            if fams is None:
                return None
            steps = fams.get("specbus_trainer_steps", {}).get("samples", {})
            return steps.get(("specbus_trainer_steps_total", ()), 0) >= k and fams

        fams = wait_until(lambda: trained(3), 240, "3 steps on the trainer's /metrics",
                          poll.proc, poll.log)  # fmt: skip
        # the TensorBoard scalars, by Prometheus names (`series_name`)
        for key in ("loss", "lr", "grad_norm", "samples_per_s", "tokens_per_s", "data_wait_frac",
                    "bus_s_per_step", "store_bytes", "lag_refs", "redeliveries", "dead_letters",
                    "checkpoint_seconds", "checkpoint_bytes"):  # fmt: skip
            name, kind, _ = series_name("specbus_trainer", key)
            assert fams[name]["type"] == kind, (key, fams.get(name))
        assert fams["specbus_trainer_position_accuracy"]["samples"]  # acc_k, labelled
        assert {lab for (_, lab) in fams["specbus_trainer_position_accuracy"]["samples"]} >= {
            (("position", "0"),), (("position", "1"),)}  # fmt: skip
        assert value(fams, "specbus_trainer_data_wait_ratio") <= 1.0
        assert value(fams, "specbus_trainer_checkpoint_step") >= 2

        cluster.stop()  # SIGTERM: the trainer saves its step and exits, its entry with it
        assert not endpoints(cfg, "trainer")
    finally:
        cluster.stop()


def test_the_intake_and_serve_answer_metrics(tmp_path, chat_target, nats_server, run_id):
    chats = write_chats(tmp_path / "chats.jsonl")
    cfg = live_config(run_id, tmp_path / "run", chat_target, chats, store_uri=f"shm://{run_id}")
    run = LiveRun(cfg, tmp_path / "procs", nats_server.url)
    try:
        ep = run.start_intake()
        serve = run.start_serve()
        # Greedy, so that the answer is the same 4 tokens every run. Sampled (the default
        # temperature 1, seeded by a fresh request id), the random target ended ~1.6% of the
        # answers with EOS within 2 tokens: fewer generated rows than `live.min_num_tokens`
        # (2), so the sink dropped the capture as `too_short` and the intake saw no record
        # (CI once; such a request id reproduces it: only `reason=config` on its `/metrics`).
        answer = httpx.post(serve + "/v1/chat/completions", timeout=120.0,
                            headers={"X-Request-Id": "metrics-1"}, json={
            "model": "x", "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": "add 12"}]})  # fmt: skip
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 4, answer.text
        sink = run.wait_sink_idle()  # the sink's POST answered: the intake counted the record
        assert sink["counts"].get("accepted") == 1, sink
        auth = {"Authorization": f"Bearer {ep['token']}"}
        fams = scrape(ep["url"] + "/metrics", auth)
        assert fams["specbus_intake_records"]["type"] == "counter"
        assert value(fams, "specbus_intake_records_total", code=200, reason="accepted") == 1
        assert value(fams, "specbus_intake_trainers_lag_refs") == 1  # no trainer yet
        assert value(fams, "specbus_intake_store_budget_bytes") == cfg.store.budget_bytes
        assert value(fams, "process_open_fds") > 0
        assert httpx.get(ep["url"] + "/metrics", timeout=10).status_code == 401  # token needed
        fams = scrape(serve + "/metrics")
        assert value(fams, "specbus_serve_requests_total", route="chat", status=200) == 1
        assert value(fams, "specbus_serve_generated_tokens_total") >= 1
        assert value(fams, "specbus_capture_total", outcome="accepted") == 1
    finally:
        run.stop()
