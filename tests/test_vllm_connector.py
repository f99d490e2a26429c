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

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from specbus.core.models.target import load_final_norm, load_target_info
from specbus.patches.vllm import VLLM_VERSION, layer
from specbus.patches.vllm.capture import FinalNorm
from specbus.producers.live.wire import sample_id_of

from tests.fixtures.live import start_intake_thread
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


def serve_argv(cfg, tmp_path, *extra: str) -> tuple[dict, list[str]]:
    """`specbus serve --engine vllm --dry-run` as a user runs it: (environment, vllm argv)."""
    from specbus.core.config import dump_config

    path = tmp_path / f"{cfg.run}.yaml"
    path.write_text(dump_config(cfg))
    out = subprocess.run([sys.executable, "-m", "specbus.ops.cli", "serve", "-c", str(path),
                          "--engine", "vllm", "--dry-run", *extra], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    words = shlex.split(out.stdout.strip().splitlines()[-1])
    at = words.index("vllm")
    assert words[at + 1] == "serve"
    return dict(w.split("=", 1) for w in words[:at]), words[at + 2 :]


@pytest.fixture
def intake(tmp_path, chat_target, nats_server, run_id):
    cfg, store, cap, thread = start_intake_thread(run_id, tmp_path, chat_target, nats_server.url,
                                                  TOKEN, overrides=["target.dtype=float32"])  # fmt: skip
    yield cfg, store, cap, thread
    thread.stop()
    store.close()


def test_the_connector_in_vllms_scheduler_feeds_the_intake(vllm_env, intake, chat_target,
                                                           nats_server, tmp_path):  # fmt: skip
    cfg, store, cap, thread = intake
    env, argv = serve_argv(cfg, tmp_path)
    assert env["SPECBUS_CAPTURE_SAMPLE_RATE"] == "1"
    info = load_target_info(chat_target)
    assert argv[0] == str(chat_target)
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    # specbus's aux layer a is vLLM's a + 1; the final state is vLLM's last id, normed here
    ids = sorted({*(a + 1 for a in cap.aux_layers), info.num_layers})  # as vLLM keeps them
    assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == ids
    opts = {"argv": argv, "rate": 0.5}
    run_env = {**vllm_env, "SPECBUS_CAPTURE_INTAKE_URL": thread.url, "SPECBUS_INTAKE_TOKEN": TOKEN,
               "SPECBUS_CAPTURE_SAMPLE_RATE": "0.5"}  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "tests.vllm_driver", json.dumps(opts)], cwd=ROOT,
                          env=run_env, capture_output=True, text=True, timeout=400)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-5000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])

    assert report["config"] == {"chunked_prefill": False, "prefix_caching": False,
                                "method": "extract_hidden_states", "connector": "SpecbusCaptureConnector",
                                "layer_ids": ids}  # fmt: skip
    refused = report["refused"]
    assert "--no-enable-chunked-prefill" in refused["chunked"], refused
    assert "--no-enable-prefix-caching" in refused["prefix"], refused
    assert "extract_hidden_states" in refused["no_extract"], refused
    assert report["writer"] is True
    counts = report["counts"]
    assert counts.get("accepted") == 4 and counts.get("too_short") == 1, counts
    assert report["free_blocks"][0] == report["free_blocks"][1]  # every held block came back

    requests = report["requests"]
    outputs = {"whole": [7] * 4, "batch-a": [7] * 3, "batch-b": [7] * 5, "stopped": [7, 7, 2]}
    refs = {r.sample_id: r for r in lease_refs(nats_server.url, cfg.run, 8)}
    assert set(refs) == {sample_id_of(requests[n]["rid"]) for n in outputs}
    width = len(ids) * cap.hidden_size
    norm = FinalNorm(*load_final_norm(chat_target))
    for name, output in outputs.items():
        prompt = requests[name]["prompt"]
        fed = prompt + output[:-1]
        got = store.get(refs[sample_id_of(requests[name]["rid"])])
        by_source = {d.source: got[d.name] for d in cap.features}
        rows = rows_at(list(range(len(fed))), fed, width).view(len(fed), len(ids), -1)
        assert by_source["input_ids"].tolist() == fed, name
        assert by_source["loss_mask"].tolist() == [0] * len(prompt) + [1] * (len(output) - 1)
        aux = torch.cat([rows[:, ids.index(a + 1)] for a in cap.aux_layers], dim=1)
        torch.testing.assert_close(by_source["aux"], aux, rtol=0, atol=0)
        torch.testing.assert_close(by_source["final"], norm(rows[:, ids.index(info.num_layers)]),
                                   rtol=0, atol=0)  # fmt: skip
