"""The SGLang capture layer against the real SGLang 0.5.23 code (the pinned wheel, CPU imports).

- `specbus sglang apply|check|revert` on the installed wheel: the hook targets found in its
  source, the plugin's distribution written and removed, another version refused by name;
- `tests/sglang_driver.py` in a subprocess with SGLang on its path: SGLang's own plugin loader
  finds the applied entry point and its HookRegistry wraps the real methods; the hooks run on
  real `Req` / `ScheduleBatch` / `LogitsProcessorOutput` / `GenerationBatchResult` objects
  (prefill whole and chunked, decode, a prefix hit, an overshoot tick, an unsampled request),
  and the real `CaptureSink` puts the rows into the real shm store and POSTs them to the real
  intake, which publishes SampleRefs on the real broker. The test reads them back.
The GPU forward and SGLang's own result processing do not run here (docs/sglang.md says so).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from specbus.core.models.target import load_target_info
from specbus.core.strategies.base import build_strategy
from specbus.ops import sglang_layer as layer
from specbus.producers.engines.pins import SGLANG_VERSION
from specbus.producers.live.wire import sample_id_of

from tests.fixtures.live import live_config, start_intake_thread, write_chats
from tests.sglang_driver import rows_at
from tests.test_live_intake import lease_refs

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "sglang-token"


def test_apply_check_revert_on_the_installed_wheel(sglang_site, tmp_path):
    before = layer.check(sglang_site)
    assert before["sglang"] == SGLANG_VERSION and not before["applied"], before
    assert before["problems"] == ["not applied (`specbus sglang apply`)"]
    done = layer.apply(sglang_site)
    try:
        after = layer.check(sglang_site)
        assert after["ok"] and after["applied"], after
        written = (Path(done["dist_info"]) / "entry_points.txt").read_text()
        assert "specbus.patches.sglang.plugin:register" in written
    finally:
        removed = layer.revert(sglang_site)
    assert len(removed) == 5 and not Path(done["dist_info"]).exists()
    assert layer.check(sglang_site)["problems"] == ["not applied (`specbus sglang apply`)"]
    # another version, by name: a site whose SGLang says 0.5.22
    other = tmp_path / "site"
    (other / "sglang-0.5.22.dist-info").mkdir(parents=True)
    (other / "sglang-0.5.22.dist-info" / "METADATA").write_text("Name: sglang\nVersion: 0.5.22\n")
    with pytest.raises(layer.LayerError, match=r"SGLang 0\.5\.22 is installed.*0\.5\.23 only"):
        layer.apply(other)
    assert not list(other.glob("specbus_*"))


def test_a_missing_hook_target_is_named(sglang_site, tmp_path):
    """A source where upstream renamed a hooked method: `check` names it, `apply` refuses."""
    site = tmp_path / "site"
    src = sglang_site / "sglang" / "srt"
    for rel in layer.NEEDS:
        (site / "sglang" / "srt" / rel).parent.mkdir(parents=True, exist_ok=True)
        text = (src / rel).read_text()
        if rel.endswith("batch_result_processor.py"):
            text = text.replace("def process_batch_result_decode(", "def process_decode(")
        (site / "sglang" / "srt" / rel).write_text(text)
    missing = layer.missing_targets(site)
    assert missing == [
        "managers/scheduler_components/batch_result_processor.py: "
        "SchedulerBatchResultProcessor.process_batch_result_decode"
    ]


@pytest.fixture
def intake(tmp_path, chat_target, nats_server, run_id):
    cfg, store, cap, thread = start_intake_thread(run_id, tmp_path, chat_target, nats_server.url,
                                                  TOKEN)  # fmt: skip
    yield cfg, store, cap, thread
    thread.stop()
    store.close()


def test_hooks_on_real_sglang_objects_feed_the_intake(sglang_site, sglang_env, intake,
                                                      chat_target, nats_server):  # fmt: skip
    cfg, store, cap, thread = intake
    layer.apply(sglang_site)
    try:
        opts = {"model": str(chat_target), "layer_ids": list(cap.aux_layers),
                "hidden": cap.hidden_size, "rate": 1.0}  # fmt: skip
        env = {**sglang_env, "SPECBUS_CAPTURE_INTAKE_URL": thread.url,
               "SPECBUS_INTAKE_TOKEN": TOKEN}  # fmt: skip
        proc = subprocess.run([sys.executable, "-m", "tests.sglang_driver", json.dumps(opts)],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    finally:
        layer.revert(sglang_site)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])

    assert report["hooked"] == {**report["hooked"], "req": True, "sched": True, "prefill": True}
    assert "--disable-radix-cache" in report["refused"]["radix"]
    assert "--enable-return-aux-hidden-states" in report["refused"]["no_aux"]
    assert report["handshake"]
    modes, plain = report["modes"], report["return_hidden_states"]
    assert modes["unsampled-1"] == 0 and all(m == 2 for r, m in modes.items() if r != "unsampled-1")
    assert not any(plain.values())  # the response path never sees the rows
    counts = report["counts"]
    assert counts.get("accepted") == 4 and counts.get("layer_prefix_hit") == 1, counts

    requests = report["requests"]
    captured = ["whole-1", "whole-2", "chunked-1", "overshoot-1"]
    refs = {r.sample_id: r for r in lease_refs(nats_server.url, cfg.run, 8)}
    assert set(refs) == {sample_id_of(rid) for rid in captured}
    width = len(cap.aux_layers) * cap.hidden_size
    for rid in captured:
        prompt, output = requests[rid]["prompt"], requests[rid]["output"]
        fed = prompt + output[:-1]
        got = store.get(refs[sample_id_of(rid)])
        by_source = {d.source: got[d.name] for d in cap.features}
        positions = list(range(len(fed)))
        assert by_source["input_ids"].tolist() == fed, rid
        assert by_source["loss_mask"].tolist() == [0] * len(prompt) + [1] * (len(output) - 1)
        torch.testing.assert_close(by_source["aux"], rows_at(positions, fed, width), rtol=0, atol=0)
        if "final" in by_source:
            torch.testing.assert_close(by_source["final"], -rows_at(positions, fed, cap.hidden_size),
                                       rtol=0, atol=0)  # fmt: skip


def test_the_engines_refuse_without_sglang_naming_the_install(chat_target):
    from specbus.core.config import TargetConfig
    from specbus.core.errors import ConfigError
    from specbus.producers.engines.registry import build_engine

    with pytest.raises(ConfigError, match=r"target.engine=sglang needs SGLang 0\.5\.23: "
                       r"pip install sglang==0\.5\.23"):  # fmt: skip
        build_engine(TargetConfig(engine="sglang", model=str(chat_target)))
    # sglang_server drives a server over HTTP (no SGLang here): it needs the server's URL
    with pytest.raises(ConfigError, match=r"sglang_server needs target.server_url"):
        build_engine(TargetConfig(engine="sglang_server", model=str(chat_target)))


def test_serve_prints_a_command_real_sglang_accepts(sglang_env, chat_target, tmp_path):
    """`specbus serve --engine sglang --dry-run`: the printed flags parse with SGLang's own
    `prepare_server_args`, and the layer's startup check passes on the result."""
    from specbus.core.config import dump_config

    cfg = live_config("sg", tmp_path / "run", chat_target, write_chats(tmp_path / "c.jsonl"),
                      store_uri="shm://sg", overrides=["live.sample_rate=0.25"])  # fmt: skip
    path = tmp_path / "run.yaml"
    path.write_text(dump_config(cfg))
    out = subprocess.run([sys.executable, "-m", "specbus.ops.cli", "serve", "-c", str(path),
                          "--engine", "sglang", "--dry-run"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    words = out.stdout.strip().splitlines()[-1].split()
    env = dict(w.split("=", 1) for w in words if "=" in w and not w.startswith("-"))
    assert env["SPECBUS_CAPTURE_SAMPLE_RATE"] == "0.25"
    assert env["SPECBUS_CAPTURE_ENDPOINT"].endswith("live/intake.json")
    argv = words[words.index("sglang.launch_server") + 1 :]
    check = ("import sys, json; from sglang.srt.server_args import prepare_server_args\n"
             "from specbus.patches.sglang.plugin import check_server_args\n"
             "a = prepare_server_args(json.loads(sys.argv[1])); check_server_args(a)\n"
             "print(json.dumps([a.return_aux_hidden_state_layer_ids, a.disable_radix_cache]))")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", check, json.dumps(argv)], env=sglang_env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    info = load_target_info(chat_target)
    layers = build_strategy(cfg.strategy, info).feature_contract(info).aux_layers
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [list(layers), True]
