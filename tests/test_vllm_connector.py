"""The vLLM capture connector against the real vLLM 0.33.0 code (the pinned wheel, CPU imports).

- `specbus vllm check` on the installed wheel: the version and every vLLM name the connector
  uses found by AST; another version refused by name; a renamed name named;
- `specbus serve --engine vllm --dry-run` prints a command vLLM's own CLI parser and
  `create_engine_config` accept (chunked prefill and prefix caching off, extract_hidden_states
  with the run's layers in vLLM's ids, the connector by module path), for live and driven runs;
- `tests/vllm_driver.py` in a subprocess with vLLM on its path: vLLM's scheduler, KV cache
  manager and connector factory drive the connector through whole requests (a batch of two, a
  stop token, an unsampled request, one with no generated row, an aborted one); the rows reach
  the real intake through the real `CaptureSink`, the SampleRefs the real broker, the tensors
  the real shm store, every stored row is checked at its position and every block the
  connector held is back in vLLM's pool. The GPU forward does not run (docs/vllm.md says so).
"""

from __future__ import annotations

import asyncio
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from specbus.core.export.speculators import export_eagle3
from specbus.core.models.target import load_final_norm, load_target_info
from specbus.ops import vllm_layer as layer
from specbus.ops.services.common import free_port
from specbus.patches.vllm.capture import FinalNorm
from specbus.producers.engines.pins import VLLM_VERSION
from specbus.producers.live.wire import sample_id_of

from tests.fixtures.live import live_config, start_intake_thread, wait_until, write_chats
from tests.sglang_driver import rows_at
from tests.test_live_intake import lease_refs

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "vllm-token"


def test_check_on_the_installed_wheel(vllm_site, tmp_path):
    state = layer.check(vllm_site)
    assert state["ok"] and state["vllm"] == VLLM_VERSION, state
    assert state["names_checked"] >= 50
    # another version, by name
    other = tmp_path / "site"
    (other / "vllm-0.32.1.dist-info").mkdir(parents=True)
    (other / "vllm-0.32.1.dist-info" / "METADATA").write_text("Name: vllm\nVersion: 0.32.1\n")
    problems = layer.check(other)["problems"]
    assert problems[0] == ("vLLM 0.32.1 is installed; the specbus capture connector is for vLLM "
                           "0.33.0 only (pip install vllm==0.33.0)")  # fmt: skip
    # a renamed hook point upstream is named
    src = vllm_site / "vllm" / "distributed" / "kv_transfer" / "kv_connector" / "v1" / "base.py"
    renamed = other / "vllm" / "distributed" / "kv_transfer" / "kv_connector" / "v1" / "base.py"
    renamed.parent.mkdir(parents=True)
    renamed.write_text(src.read_text().replace("def request_finished(", "def request_done("))
    assert ("missing: distributed/kv_transfer/kv_connector/v1/base.py: "
            "KVConnectorBase_V1.request_finished") in layer.check(other)["problems"]  # fmt: skip


def serve_argv(cfg, tmp_path, capsys) -> tuple[dict, list[str]]:
    """`specbus serve --engine vllm --dry-run` as a user runs it (the CLI's `main`, in this
    process: a subprocess would spend ~15 s importing): (environment, vllm argv)."""
    from specbus.core.config import dump_config
    from specbus.ops.cli import main

    path = tmp_path / f"{cfg.run}.yaml"
    path.write_text(dump_config(cfg))
    capsys.readouterr()
    assert main(["serve", "-c", str(path), "--engine", "vllm", "--dry-run"]) == 0
    words = shlex.split(capsys.readouterr().out.strip().splitlines()[-1])
    at = words.index("vllm")
    assert words[at + 1] == "serve"
    return dict(w.split("=", 1) for w in words[:at]), words[at + 2 :]


def test_serve_dry_run_prints_the_live_and_the_driven_command(chat_target, tmp_path, capsys):
    """The CLI: a live run's server samples at `live.sample_rate` and finds the intake through
    its intake.json; a driven run's (`target.engine: vllm_server`) captures only the
    producer's requests (rate 0); the token is never printed."""
    chats = write_chats(tmp_path / "c.jsonl")
    live = live_config("vl", tmp_path / "live", chat_target, chats, store_uri="shm://vl",
                       overrides=["live.sample_rate=0.25", "target.dtype=bfloat16"])  # fmt: skip
    env, argv = serve_argv(live, tmp_path, capsys)
    assert env["SPECBUS_CAPTURE_SAMPLE_RATE"] == "0.25"
    assert env["SPECBUS_CAPTURE_ENDPOINT"].endswith("live/intake.json")
    assert argv[argv.index("--dtype") + 1] == "bfloat16"
    for flag in ("--no-enable-prefix-caching", "--no-enable-chunked-prefill"):
        assert flag in argv
    kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert kv == {"kv_connector": "SpecbusCaptureConnector", "kv_role": "kv_producer",
                  "kv_connector_module_path": "specbus.patches.vllm.connector"}  # fmt: skip
    driven = live_config("vd", tmp_path / "driven", chat_target, chats, store_uri="shm://vd",
                         overrides=["deployment.mode=disaggregated", "target.engine=vllm_server",
                                    "live.url=http://10.0.0.1:8470", "live.token=s3cret"])  # fmt: skip
    env, argv = serve_argv(driven, tmp_path, capsys)
    assert env == {"SPECBUS_CAPTURE_SAMPLE_RATE": "0", "SPECBUS_CAPTURE_QUEUE": "32",
                   "SPECBUS_CAPTURE_INTAKE_URL": "http://10.0.0.1:8470",
                   "SPECBUS_INTAKE_TOKEN": "<the intake's token>"}  # fmt: skip


@pytest.fixture
def intake(tmp_path, chat_target, nats_server, run_id):
    cfg, store, cap, thread = start_intake_thread(run_id, tmp_path, chat_target, nats_server.url,
                                                  TOKEN, overrides=["target.dtype=float32"])  # fmt: skip
    yield cfg, store, cap, thread
    thread.stop()
    store.close()


@pytest.mark.slow
def test_live_and_driven_capture_through_vllms_scheduler(vllm_env, intake, chat_target,
                                                         nats_server, tmp_path):  # fmt: skip
    """One vLLM process (its import alone is ~30 s here): the live scenarios, then the same
    engine behind a stand-in HTTP server that a `DrivenWorker` drives with `vllm_server`."""
    from specbus.ops.vllm import server_command

    cfg, store, cap, thread = intake
    env, argv = server_command(cfg)  # what `specbus serve --engine vllm --dry-run` prints
    assert argv[:2] == ["vllm", "serve"] and env["SPECBUS_CAPTURE_SAMPLE_RATE"] == "1"
    argv = argv[2:]
    info = load_target_info(chat_target)
    assert argv[0] == str(chat_target)
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    # specbus's aux layer a is vLLM's a + 1; the final state is vLLM's last id, normed here
    ids = sorted({*(a + 1 for a in cap.aux_layers), info.num_layers})  # as vLLM keeps them
    assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == ids
    port = free_port()
    draft = export_eagle3(speculators_draft(chat_target), tmp_path / "draft", verifier=chat_target)
    opts = {"argv": argv, "rate": 0.5, "port": port, "draft": str(draft)}
    run_env = {**vllm_env, "SPECBUS_CAPTURE_INTAKE_URL": thread.url, "SPECBUS_INTAKE_TOKEN": TOKEN,
               "SPECBUS_CAPTURE_SAMPLE_RATE": "0.5"}  # fmt: skip
    log = tmp_path / "vllm.log"
    with open(log, "w") as out:  # a pipe nobody reads would block the server
        proc = subprocess.Popen([sys.executable, "-m", "tests.vllm_driver", json.dumps(opts)],
                                cwd=ROOT, env=run_env, stdout=out, stderr=out)  # fmt: skip
    try:
        wait_until(
            lambda: _healthy(f"http://127.0.0.1:{port}"), 400, "the vLLM stand-in", proc, log
        )
        report = next(json.loads(line) for line in log.read_text().splitlines()
                      if line.startswith('{"config"'))  # fmt: skip
        # vLLM's engine config reads the speculators export as an EAGLE3 draft
        assert report["draft"] == {"config": "SpeculatorsConfig", "method": "eagle3",
                                   "architectures": ["Eagle3LlamaForCausalLM"], "layer_ids": [1, 2, 3],
                                   "norm_before_residual": False, "draft_vocab_size": 64,
                                   "tokens": 3}  # fmt: skip
        check_live(report, cfg, store, cap, info, ids, nats_server, chat_target)
        check_driven(cfg, store, cap, thread, port, nats_server, chat_target, ids, info)
    finally:
        proc.kill()
        proc.wait(30)


def speculators_draft(target: Path):
    """An EAGLE3 draft of `target` on aux layers 2, 0, 1 with a 64-token vocabulary."""
    from specbus.core.config import StrategyConfig
    from specbus.core.data.vocab import VocabMapping
    from specbus.core.models.target import load_target_heads
    from specbus.core.strategies.base import build_strategy

    info, heads = load_target_info(target), load_target_heads(target)
    strategy = build_strategy(StrategyConfig(draft={"draft_vocab_size": 64}), info, heads=heads,
                              aux_layers=[2, 0, 1])  # fmt: skip
    t2d = torch.zeros(info.vocab_size, dtype=torch.bool)
    t2d[:64] = True
    return strategy.build_model(
        info, heads, VocabMapping(d2t=torch.zeros(64, dtype=torch.long), t2d=t2d)
    )


def _healthy(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url + "/health", timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


def expected(fed: list[int], cap, ids: list[int], info, norm) -> tuple[torch.Tensor, torch.Tensor]:
    """(aux, final) rows the stand-in forward wrote for `fed`, as the connector must store them:
    the cache column of vLLM id a + 1 for each aux layer a, the normed column of the last id."""
    rows = rows_at(list(range(len(fed))), fed, len(ids) * cap.hidden_size).view(
        len(fed), len(ids), -1
    )
    aux = torch.cat([rows[:, ids.index(a + 1)] for a in cap.aux_layers], dim=1)
    return aux, norm(rows[:, ids.index(info.num_layers)])


def check_live(report, cfg, store, cap, info, ids, nats_server, chat_target) -> None:
    assert report["config"] == {"chunked_prefill": False, "prefix_caching": False,
                                "method": "extract_hidden_states", "layer_ids": ids,
                                "connector": "SpecbusCaptureConnector"}  # fmt: skip
    refused = report["refused"]
    assert "--no-enable-chunked-prefill" in refused["chunked"], refused
    assert "--no-enable-prefix-caching" in refused["prefix"], refused
    assert "extract_hidden_states" in refused["no_extract"], refused
    assert "--pipeline-parallel-size must be 1" in refused["pipeline"], refused
    assert report["writer"] is True
    counts = report["counts"]
    assert counts.get("accepted") == 4 and counts.get("too_short") == 1, counts
    assert report["free_blocks"][0] == report["free_blocks"][1]  # every held block came back
    requests = report["requests"]
    outputs = {"whole": [7] * 4, "batch-a": [7] * 3, "batch-b": [7] * 5, "stopped": [7, 7, 2]}
    refs = {r.sample_id: r for r in lease_refs(nats_server.url, cfg.run, 8)}
    assert set(refs) == {sample_id_of(requests[n]["rid"]) for n in outputs}
    norm = FinalNorm(*load_final_norm(chat_target))
    for name, output in outputs.items():
        prompt = requests[name]["prompt"]
        fed = prompt + output[:-1]
        got = store.get(refs[sample_id_of(requests[name]["rid"])])
        by_source = {d.source: got[d.name] for d in cap.features}
        assert by_source["input_ids"].tolist() == fed, name
        assert by_source["loss_mask"].tolist() == [0] * len(prompt) + [1] * (len(output) - 1)
        aux, final = expected(fed, cap, ids, info, norm)
        torch.testing.assert_close(by_source["aux"], aux, rtol=0, atol=0)
        torch.testing.assert_close(by_source["final"], final, rtol=0, atol=0)


def check_driven(cfg, store, cap, thread, port, nats_server, chat_target, ids, info) -> None:
    """Tasks driven through the stand-in by `DrivenWorker` + `VLLMServerEngine`: each arrives
    once, under its task's id, with the task's tokens, loss mask and rows."""
    from specbus.core.config import TargetConfig
    from specbus.producers.engines.vllm_server import VLLMServerEngine

    from tests.test_sglang_drive import drive, tasks_of

    target = TargetConfig(engine="vllm_server", model=str(chat_target),
                          server_url=f"http://127.0.0.1:{port}", capture_wait_s=30.0)  # fmt: skip
    engine = VLLMServerEngine(target, intake_url=thread.url, token=TOKEN)
    tasks = tasks_of(cfg.run, 4)
    worker, seqs, floor = asyncio.run(drive(cfg, nats_server.url, engine, store, tasks))
    engine.close()
    assert worker.stats.tasks == 4 and floor == max(seqs.values())
    refs = [
        r for r in lease_refs(nats_server.url, cfg.run, 12) if not r.sample_id.startswith("live-")
    ]
    assert sorted(r.sample_id for r in refs) == sorted(f"{t.task_id}-e0" for t in tasks)
    by_id = {t.task_id: t for t in tasks}
    norm = FinalNorm(*load_final_norm(chat_target))
    for ref in refs:
        task = by_id[ref.task_id]
        assert (ref.task_seq, ref.epoch, ref.generation) == (seqs[task.task_id], 0, 0)
        got = store.get(ref)
        src = {d.source: got[d.name] for d in cap.features}
        assert src["input_ids"].tolist() == list(task.input_ids)
        assert src["loss_mask"].tolist() == list(task.loss_mask)
        aux, final = expected(list(task.input_ids), cap, ids, info, norm)
        torch.testing.assert_close(src["aux"], aux, rtol=0, atol=0)
        torch.testing.assert_close(src["final"], final, rtol=0, atol=0)
