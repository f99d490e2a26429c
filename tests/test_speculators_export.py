"""`specbus export --format speculators`: what vLLM serves and vLLM's `speculators` loads.

A checkpoint of an EAGLE3 draft (the tiny chat target's embedding, a reduced vocabulary, weights
moved off their initial values) is exported by the CLI, loaded by the real speculators 0.9.0
(`SpeculatorModel.from_pretrained`, in a subprocess with the pinned package:
tests/fixtures/vllm.py), and its draft forward is compared with ours on the same inputs, every
TTT step's logits: both read the same exported (bf16) weights and compute in fp32, so they
agree to float32 rounding (atol 1e-4 on logits of size ~1; measured ~1e-6). vLLM's own parse
of the same directory as a draft (`SpeculatorsConfig`, `create_engine_config`) runs in
tests/test_vllm_connector.py's vLLM process. The SGLang export stays the default.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from specbus.core.config import dump_config
from specbus.core.data.vocab import VocabMapping
from specbus.core.errors import ExportError
from specbus.core.export.speculators import export_speculators
from specbus.core.models.llama_eagle3 import Eagle3Config, LlamaEagle3Draft
from specbus.core.models.target import load_target_heads, load_target_info
from specbus.core.strategies.base import build_strategy

from tests.fixtures.live import live_config, write_chats

ROOT = Path(__file__).resolve().parent.parent


def trained_checkpoint(tmp_path: Path, chat_target: Path):
    """(run config path, the draft) of a run with one checkpoint holding a draft whose weights
    are not their initial values and whose vocabulary is reduced (d2t offsets, t2d mask)."""
    # distinct aux layers, not ascending: the export puts them in vLLM's (ascending) order
    cfg = live_config("spx", tmp_path / "run", chat_target, write_chats(tmp_path / "c.jsonl"),
                      store_uri="shm://spx", overrides=["target.aux_layers=[2,0,1]"])  # fmt: skip
    info, heads = load_target_info(chat_target), load_target_heads(chat_target)
    strategy = build_strategy(cfg.strategy, info, heads=heads, aux_layers=cfg.target.aux_layers)
    g = torch.Generator().manual_seed(3)
    kept = torch.randperm(info.vocab_size, generator=g)[: cfg.strategy.draft.draft_vocab_size]
    kept = kept.sort().values
    t2d = torch.zeros(info.vocab_size, dtype=torch.bool)
    t2d[kept] = True
    vocab = VocabMapping(d2t=kept - torch.arange(len(kept)), t2d=t2d)
    draft = strategy.build_model(info, heads, vocab)
    with torch.no_grad():
        for p in draft.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
    ckpt = tmp_path / "run" / "checkpoints"
    (ckpt / "step-000001").mkdir(parents=True)
    torch.save({"model": draft.state_dict()}, ckpt / "step-000001" / "state.pt")
    (ckpt / "latest").write_text("step-000001")
    path = tmp_path / "spx.yaml"
    path.write_text(dump_config(cfg))
    return path, draft


def export(config: Path, out: Path, *fmt: str) -> None:
    """`specbus export` as a user runs it (the CLI's `main`, in this process)."""
    from specbus.ops.cli import main

    assert main(["export", "-c", str(config), "--out", str(out), *fmt]) == 0


def ours_from(out: Path, aux_layers: list[int]) -> LlamaEagle3Draft:
    """Our draft read back from the speculators directory, fp32 (names mapped back, `fc`'s
    column blocks back in our `aux_layers` order)."""
    config = json.loads((out / "config.json").read_text())
    layer = config["transformer_layer_config"]
    cfg = Eagle3Config.from_hf_dict({**layer, "draft_vocab_size": config["draft_vocab_size"],
                                     "target_hidden_size": config["target_hidden_size"]})  # fmt: skip
    cfg.aux_layers = list(aux_layers)
    draft = LlamaEagle3Draft(cfg)
    tensors = load_file(out / "model.safetensors")
    state = {k.replace("layers.0.", "midlayer.", 1): v for k, v in tensors.items()}
    blocks = state["fc.weight"].split(cfg.target_hidden_size, dim=1)  # ascending layers
    rank = sorted(aux_layers)
    state["fc.weight"] = torch.cat([blocks[rank.index(a)] for a in aux_layers], dim=1)
    draft.load_state_dict(state)
    return draft.float().eval()


@pytest.mark.slow
def test_speculators_loads_the_export_and_drafts_as_we_do(speculators_env, chat_target, tmp_path):
    config, draft = trained_checkpoint(tmp_path, chat_target)
    out = tmp_path / "spec"
    export(config, out, "--format", "speculators")
    written = json.loads((out / "config.json").read_text())
    assert written["speculators_model_type"] == "eagle3"
    assert draft.config.aux_layers == [2, 0, 1]
    assert written["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]  # vLLM's ids, ascending
    ours = ours_from(out, draft.config.aux_layers)

    g = torch.Generator().manual_seed(5)
    length, steps = 24, 3
    ids = torch.randint(4, 128, (1, length), generator=g)
    hidden = torch.randn(1, length, 3 * draft.config.target_hidden_size, generator=g)
    # what vLLM feeds it: the same layers' states in ascending layer order (ours: 2, 0, 1)
    blocks = hidden.split(draft.config.target_hidden_size, dim=-1)
    vllm_order = torch.cat([blocks[1], blocks[2], blocks[0]], dim=-1)
    torch.save({"path": str(out), "input_ids": ids, "hidden_states": vllm_order,
                "ttt_steps": steps}, tmp_path / "in.pt")  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "tests.speculators_driver", str(tmp_path / "in.pt"),
                           str(tmp_path / "out.pt")], cwd=ROOT, env=speculators_env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    theirs = torch.load(tmp_path / "out.pt")
    assert theirs["class"] == "Eagle3DraftModel"
    assert theirs["layer_ids"] == [1, 2, 3]
    assert theirs["norm_before_residual"] is False
    assert torch.equal(theirs["d2t"], draft.d2t) and torch.equal(theirs["t2d"], draft.t2d)
    # the target's embedding (bf16 in the export, as every float tensor)
    torch.testing.assert_close(
        theirs["embed"].float(), draft.embed_tokens.weight.bfloat16().float()
    )

    with torch.no_grad():
        mine = ours(ids, hidden, torch.ones_like(ids), ttt_length=steps)
    assert len(theirs["logits"]) == steps
    for k in range(steps):
        torch.testing.assert_close(theirs["logits"][k].float(), mine[k], atol=1e-4, rtol=1e-4)
    # and the export is the trained draft (up to bf16): not some other draft that agrees
    with torch.no_grad():
        trained = draft.float().eval()(ids, hidden, torch.ones_like(ids), ttt_length=steps)
    assert (trained[0] - mine[0]).abs().max() < 0.05


def test_sglang_stays_the_default_and_other_drafts_are_refused(chat_target, tmp_path):
    config, draft = trained_checkpoint(tmp_path, chat_target)
    export(config, tmp_path / "sg")
    assert json.loads((tmp_path / "sg" / "config.json").read_text())["architectures"] == [
        "LlamaForCausalLMEagle3"
    ]
    with pytest.raises(ExportError, match=r"no speculators export for a Linear draft"):
        export_speculators(torch.nn.Linear(2, 2), tmp_path / "x", verifier=chat_target)
    assert not (tmp_path / "x").exists()
