"""SGLang EAGLE3 export: exact tensor names, config fields, refusal, loader round trip."""

import json
import os
import stat

import pytest
import torch
from safetensors import safe_open
from specbus.core.config import DraftConfig
from specbus.core.errors import ExportError
from specbus.core.export.sglang import export_draft, export_state_dict, load_export
from specbus.core.models.llama_eagle3 import LlamaEagle3Draft
from specbus.core.models.registry import build_draft
from specbus.core.models.target import TargetInfo

EXPECTED = {
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.post_attention_layernorm.weight",
    "fc.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
}


def draft() -> LlamaEagle3Draft:
    torch.manual_seed(0)
    target = TargetInfo(
        name="tiny",
        path=".",
        model_type="llama",
        num_layers=8,
        hidden_size=16,
        vocab_size=40,
        intermediate_size=24,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=4,
        rms_norm_eps=1e-5,
        hidden_act="silu",
        max_position_embeddings=64,
        rope_theta=10000.0,
        eos_token_ids=(2,),
    )
    model = build_draft("llama_eagle3", DraftConfig(draft_vocab_size=24), target, [1, 3, 4])
    with torch.no_grad():
        model.d2t.copy_(torch.arange(24) % 3)
        model.t2d.zero_()
        model.t2d[(torch.arange(24) + model.d2t)] = True
    return model


def test_export_writes_exactly_the_sglang_names_and_config(tmp_path):
    out = export_draft(draft(), tmp_path / "draft")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert set(f.keys()) == EXPECTED
        assert f.get_tensor("fc.weight").dtype == torch.bfloat16
        assert f.get_tensor("d2t").dtype == torch.int64 and f.get_tensor("t2d").dtype == torch.bool
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 1
    assert (config["hidden_size"], config["intermediate_size"]) == (16, 24)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)
    assert (config["vocab_size"], config["draft_vocab_size"]) == (40, 24)
    assert config["rope_theta"] == 10000.0 and config["rms_norm_eps"] == 1e-5
    assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}


def test_the_export_is_readable_like_any_file_the_user_writes(tmp_path):
    """Issue 34: model.safetensors came out 0600 (safetensors' own temp file) in a 0700
    directory (mkdtemp): an SGLang server running as another user could not read it."""
    umask = os.umask(0o022)
    try:
        out = export_draft(draft(), tmp_path / "draft")
    finally:
        os.umask(umask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    for name in ("config.json", "model.safetensors"):
        assert stat.S_IMODE((out / name).stat().st_mode) == 0o644, name


def test_round_trip_restores_weights_and_outputs(tmp_path):
    original = draft()
    out = export_draft(original, tmp_path / "draft", dtype="float32")
    loaded = load_export(out, embed_tokens=original.embed_tokens.weight)
    for name, tensor in original.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    ids, aux = torch.randint(0, 40, (1, 6)), torch.randn(1, 6, 48)
    with torch.no_grad():
        for a, b in zip(
            original(ids, aux, torch.ones(1, 6), ttt_length=2),
            loaded(ids, aux, torch.ones(1, 6), ttt_length=2),
            strict=True,
        ):
            torch.testing.assert_close(a, b)


def test_export_refuses_missing_or_extra_names(tmp_path):
    model = draft()
    state = {k: v for k, v in model.state_dict().items() if k != "embed_tokens.weight"}
    with pytest.raises(ExportError, match="missing.*norm.weight"):
        export_state_dict(
            {k: v for k, v in state.items() if k != "norm.weight"}, model.config, tmp_path / "a"
        )
    with pytest.raises(ExportError, match="extra.*embed_tokens"):
        export_state_dict(
            {**state, "embed_tokens.weight": model.embed_tokens.weight},
            model.config,
            tmp_path / "b",
        )
    with pytest.raises(ExportError, match="extra.*draft_model.fc.weight"):
        export_state_dict(
            {
                **{k: v for k, v in state.items() if k != "fc.weight"},
                "draft_model.fc.weight": state["fc.weight"],
            },
            model.config,
            tmp_path / "c",
        )
    assert not any(tmp_path.iterdir())  # nothing half-written


def test_loader_refuses_a_directory_with_foreign_names(tmp_path):
    from safetensors.torch import load_file, save_file

    out = export_draft(draft(), tmp_path / "draft")
    tensors = load_file(str(out / "model.safetensors"))
    tensors["extra.weight"] = torch.zeros(1)
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(ExportError, match="extra.weight"):
        load_export(out)
