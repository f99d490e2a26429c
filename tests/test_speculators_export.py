"""`specbus export --format speculators`: what vLLM serves and vLLM's `speculators` loads.

A checkpoint of an EAGLE3 draft (the tiny chat target's embedding, a reduced vocabulary, weights
moved off their initial values) is exported by the CLI, loaded by the real speculators 0.9.0
(`SpeculatorModel.from_pretrained`, in a subprocess with the pinned package:
tests/fixtures/vllm.py), and its draft forward is compared with ours on the same inputs, every
TTT step's logits: both read the same exported (bf16) weights and compute in fp32, so they
agree to float32 rounding (atol 1e-4 on logits of size ~1; measured ~1e-6). vLLM's own parse
of the same directory as a draft (`SpeculatorsConfig`, `create_engine_config`) runs in
tests/test_vllm_connector.py's vLLM process. The SGLang export stays the default.

DFlash and DSpark drafts (random weights moved off their initial values, aux layers out of
order) go the same way: exported by the CLI, loaded by speculators as `DFlashDraftModel` /
`DSparkDraftModel` with the target's embedding and lm_head from the verifier, and speculators'
own training forward (anchors pinned) gives the same block logits as ours on the same blocks
(DSpark: after the Markov bias, and the confidence logits), fp32 on the bf16 weights: atol 1e-4
(measured: at most 2.3e-7 on logits, 1.8e-7 on confidence logits). vLLM 0.33's own
`SpeculatorsConfig` (a vLLM subprocess, tests/fixtures/vllm.py) reads the same directory as the
same draft (layers, block non-causal, anchor convention, draft length). Domino has no
speculators format: refused.
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
from specbus.core.models.dflash import DFlashDraft
from specbus.core.models.llama_eagle3 import Eagle3Config, LlamaEagle3Draft
from specbus.core.models.target import load_target_heads, load_target_info
from specbus.core.strategies.base import build_strategy
from specbus.core.strategies.dflash_blocks import draft_blocks

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
    return checkpointed(tmp_path, cfg, strategy.build_model(info, heads, vocab), g)


def checkpointed(tmp_path: Path, cfg, draft, g: torch.Generator):
    """(run config path, draft): `draft`'s trainable weights moved off their initial values,
    saved as the run's one checkpoint."""
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


def dflash_checkpoint(tmp_path: Path, chat_target: Path, strategy: str, *overrides: str):
    """(run config path, draft) of a DFlash-family run (`strategy`) with one checkpoint; aux
    layers 2, 0, 1 (the export puts them in vLLM's ascending order)."""
    cfg = live_config("spx", tmp_path / "run", chat_target, write_chats(tmp_path / "c.jsonl"),
                      store_uri="shm://spx", strategy=strategy,
                      overrides=["target.aux_layers=[2,0,1]", *overrides])  # fmt: skip
    info, heads = load_target_info(chat_target), load_target_heads(chat_target)
    built = build_strategy(cfg.strategy, info, heads=heads, aux_layers=cfg.target.aux_layers)
    g = torch.Generator().manual_seed(7)
    return checkpointed(tmp_path, cfg, built.build_model(info, heads), g)


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


def dflash_from(out: Path, draft: DFlashDraft) -> DFlashDraft:
    """Our draft read back from the speculators directory, fp32 (`fc`'s column blocks back in
    our `target_layer_ids` order; every name must load, strictly)."""
    tensors = load_file(out / "model.safetensors")
    layers = draft.config.target_layer_ids
    blocks = tensors["fc.weight"].split(draft.config.hidden_size, dim=1)  # ascending layers
    tensors["fc.weight"] = torch.cat([blocks[sorted(layers).index(a)] for a in layers], dim=1)
    ours = DFlashDraft(draft.config)
    ours.load_state_dict(tensors)
    return ours.float().eval()


def block_logits(draft: DFlashDraft, heads, ids, hidden, anchors, markov: bool = True):
    """Our (logits `[1, N, K, V]`, DSpark's confidence logits or None) of the blocks at
    `anchors`, as training computes them (DSpark: each position's previous token is the one at
    anchor + k, its Markov bias added unless `markov` is false)."""
    k = draft.config.block_size
    anchors_BN = torch.tensor([anchors])
    with torch.no_grad():
        h = draft_blocks(draft, input_ids_BL=ids, hidden_states_BLA=hidden, anchors_BN=anchors_BN,
                         keep_BN=torch.ones_like(anchors_BN, dtype=torch.bool),
                         embed_VH=heads.embed_tokens.float(), mask_token_id=draft.config.mask_token_id,
                         block_size=k, attention="eager")  # fmt: skip
        logits = h @ heads.lm_head.float().T
        if draft.config.projector != "dspark":
            return logits, None
        prev = ids[0, anchors_BN[..., None] + torch.arange(k)]  # [1, N, K]
        if draft.markov_head is not None and markov:
            logits = draft.markov_head.block_logits(logits, prev, h)
        return logits, draft.confidence_logits(h, prev)


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy,overrides,model_class,tokens",
    [
        ("dflash", [], "DFlashDraftModel", 3),  # block 4: the anchor, then 3 drafted
        ("dspark", ["strategy.dspark.confidence_with_markov=true"], "DSparkDraftModel", 4),
        ("dspark", ["strategy.dspark.markov_head_type=rnn"], "DSparkDraftModel", 4),
    ],
)
def test_speculators_loads_dflash_family_exports_and_drafts_as_we_do(
    strategy, overrides, model_class, tokens, speculators_env, vllm_env, chat_target, tmp_path
):
    config, draft = dflash_checkpoint(tmp_path, chat_target, strategy, *overrides)
    out = tmp_path / "spec"
    export(config, out, "--format", "speculators")
    written = json.loads((out / "config.json").read_text())
    assert written["speculators_model_type"] == strategy
    assert draft.config.target_layer_ids == [2, 0, 1]
    assert written["aux_hidden_state_layer_ids"] == [1, 2, 3]  # vLLM's ids, ascending
    assert written["sliding_window_non_causal"] is True  # vLLM: not causal
    ours = dflash_from(out, draft)
    heads = load_target_heads(chat_target)

    g = torch.Generator().manual_seed(5)
    length, width = 32, draft.config.hidden_size
    ids = torch.randint(4, 128, (1, length), generator=g)
    hidden = torch.randn(1, length, 3 * width, generator=g)
    blocks = hidden.split(width, dim=-1)  # ours: layers 2, 0, 1; vLLM's order: 0, 1, 2
    vllm_order = torch.cat([blocks[1], blocks[2], blocks[0]], dim=-1)
    anchors = [2, 9, 17, 23]  # < length - block_size: speculators' anchor rule
    torch.save({"path": str(out), "input_ids": ids, "hidden_states": vllm_order,
                "anchors": torch.tensor(anchors)}, tmp_path / "in.pt")  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "tests.speculators_driver", str(tmp_path / "in.pt"),
                           str(tmp_path / "out.pt")], cwd=ROOT, env=speculators_env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    theirs = torch.load(tmp_path / "out.pt")
    assert theirs["class"] == model_class
    assert theirs["saved"] == theirs["expected"]  # every weight it has came from the export
    assert theirs["layer_ids"] == [1, 2, 3]
    assert theirs["sample_from_anchor"] is (strategy == "dspark")
    assert theirs["speculative_tokens"] == tokens and theirs["block_size"] == 4

    # the target's embedding and lm_head, reloaded from the verifier (the export has neither)
    assert torch.equal(theirs["embed"], heads.embed_tokens.float())
    assert torch.equal(theirs["lm_head"], heads.lm_head.float())
    mine, confidence = block_logits(ours, heads, ids, hidden, anchors)
    k = draft.config.block_size
    got = theirs["logits"].view(1, len(anchors), k, -1)
    print(f"{strategy}: max |logits diff| {(got - mine).abs().max().item():.2e}")
    torch.testing.assert_close(got, mine, atol=1e-4, rtol=1e-4)
    if strategy == "dspark":
        assert ours.markov_head is not None and ours.confidence_head is not None
        got_conf = theirs["confidence"].view(1, len(anchors), k)
        print(f"dspark: max |confidence diff| {(got_conf - confidence).abs().max().item():.2e}")
        torch.testing.assert_close(got_conf, confidence, atol=1e-4, rtol=1e-4)
        # the Markov bias is part of what agreed (far above the tolerance)
        plain, _ = block_logits(ours, heads, ids, hidden, anchors, markov=False)
        assert (got - plain).abs().max() > 1e-2
    # and the export is the trained draft (up to bf16): not some other draft that agrees
    trained, _ = block_logits(draft.float().eval(), heads, ids, hidden, anchors)
    assert (trained - mine).abs().max() < 0.05

    # vLLM reads it as the same draft: our layers (its DFlash ids are aux - 1), non-causal blocks
    seen = vllm_reads(out, vllm_env)
    assert seen["method"] == strategy and seen["num_speculative_tokens"] == tokens
    assert seen["draft_vocab_size"] == draft.config.vocab_size
    if strategy == "dflash":
        assert seen["architectures"] == ["DFlashDraftModel"]
        assert seen["dflash_config"] == {"mask_token_id": draft.config.mask_token_id,
                                         "target_layer_ids": [0, 1, 2],
                                         "sample_from_anchor": False, "causal": False}  # fmt: skip
    else:
        assert seen["architectures"] == ["Qwen3DSparkModel"]
        assert seen["target_layer_ids"] == [0, 1, 2] and seen["sample_from_anchor"] is True
        assert seen["markov_rank"] == 8 and seen["enable_confidence_head"] is True
        assert seen["markov_head_type"] == draft.config.markov_head_type


VLLM_PARSE = """
import json, sys
from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig
hf = SpeculatorsConfig.from_pretrained(sys.argv[1])
spec = SpeculatorsConfig.extract_vllm_speculative_config(json.load(open(sys.argv[1] + "/config.json")))
keys = ("architectures", "dflash_config", "target_layer_ids", "sample_from_anchor",
        "markov_rank", "markov_head_type", "enable_confidence_head", "draft_vocab_size")
print(json.dumps({**{k: getattr(hf, k, None) for k in keys}, **spec}))
"""


def vllm_reads(out: Path, vllm_env) -> dict:
    """What vLLM 0.33's own `SpeculatorsConfig` makes of the directory (its draft model config
    and its speculative config), in a vLLM subprocess."""
    proc = subprocess.run([sys.executable, "-c", VLLM_PARSE, str(out)], cwd=ROOT, env=vllm_env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_domino_is_refused_naming_what_speculators_has(chat_target, tmp_path):
    config, draft = dflash_checkpoint(tmp_path, chat_target, "domino")
    with pytest.raises(ExportError, match=r"no speculators format for a domino draft.*dflash, "
                       r"dflash2 and dspark.*--format sglang"):  # fmt: skip
        export_speculators(draft, tmp_path / "x", verifier=chat_target)
    assert not (tmp_path / "x").exists()
    from specbus.ops.cli import main

    assert main(["export", "-c", str(config), "--out", str(tmp_path / "x"),
                 "--format", "speculators"]) != 0  # fmt: skip
    assert not (tmp_path / "x").exists()


def test_sglang_stays_the_default_and_other_drafts_are_refused(chat_target, tmp_path):
    config, draft = trained_checkpoint(tmp_path, chat_target)
    export(config, tmp_path / "sg")
    assert json.loads((tmp_path / "sg" / "config.json").read_text())["architectures"] == [
        "LlamaForCausalLMEagle3"
    ]
    with pytest.raises(ExportError, match=r"no speculators export for a Linear draft"):
        export_speculators(torch.nn.Linear(2, 2), tmp_path / "x", verifier=chat_target)
    assert not (tmp_path / "x").exists()
