"""The EAGLE3 draft: TTT attention mask structure, training/decoding consistency, registry."""

import pytest
import torch
from specbus.core.config import DraftConfig
from specbus.core.errors import ConfigError
from specbus.core.models.llama_eagle3 import (
    DecodeCache,
    LlamaEagle3Draft,
    TTTCache,
    _ttt_eager,
    shift_left,
)
from specbus.core.models.registry import available_drafts, build_draft
from specbus.core.models.target import TargetInfo

B, L, N, STEPS = 2, 5, 2, 3


def tiny_target(**kw) -> TargetInfo:
    base = dict(
        name="tiny",
        path=".",
        model_type="llama",
        num_layers=6,
        hidden_size=16,
        vocab_size=32,
        intermediate_size=24,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=4,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        max_position_embeddings=64,
        rope_theta=500.0,
    )
    return TargetInfo(**{**base, **kw})


def attended_keys(attention_fn, key_padding):
    """Which (step, position) keys each query sees, read off uniform attention over one-hot values.

    With zero queries every allowed key gets the same weight, so the output of query i at step
    k is the mean of the one-hot codes of exactly the keys it may attend to.
    """
    code = lambda s, j: s * L + j  # noqa: E731
    dim = STEPS * L
    cache = TTTCache(key_padding_BL=key_padding)
    seen = []
    for step in range(STEPS):
        values = torch.zeros(B, N, L, dim, dtype=torch.float64)
        for j in range(L):
            values[:, :, j, code(step, j)] = 1.0
        cache.keys.append(torch.zeros(B, N, L, dim, dtype=torch.float64))
        cache.values.append(values)
        out = attention_fn(torch.zeros(B, N, L, dim, dtype=torch.float64), cache)
        seen.append(out[:, 0] > 0)  # [B, L, dim]: key codes with non-zero weight
    return seen, code


def test_ttt_attention_mask_is_causal_at_step0_then_adds_only_the_diagonal():
    padding = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    seen, code = attended_keys(_ttt_eager, padding)
    for step in range(STEPS):
        for b in range(B):
            for i in range(L):
                expected = {code(0, j) for j in range(i + 1) if padding[b, j]}
                expected |= {code(s, i) for s in range(1, step + 1)}
                got = set(torch.nonzero(seen[step][b, i]).flatten().tolist())
                assert got == expected, (step, b, i)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex attention path needs CUDA")
def test_flex_attention_matches_the_eager_path():
    from specbus.core.models.llama_eagle3 import _ttt_flex

    torch.manual_seed(0)
    padding = torch.tensor([[1] * 64, [1] * 40 + [0] * 24], device="cuda")
    eager, flex = (
        TTTCache(key_padding_BL=padding),
        TTTCache(key_padding_BL=padding, attention="flex"),
    )
    for _ in range(3):
        k, v = torch.randn(2, 2, 2, 64, 16, device="cuda").unbind(0)
        q = torch.randn(2, 2, 64, 16, device="cuda")
        eager.keys.append(k), eager.values.append(v), flex.keys.append(k), flex.values.append(v)
        torch.testing.assert_close(_ttt_flex(q, flex), _ttt_eager(q, eager), rtol=1e-4, atol=1e-4)


def test_ttt_step_k_equals_decoding_a_chain_of_k_tokens():
    """Training and inference compute the same function: TTT step k at position j is the draft
    decoding position j+k after a verified prefix 0..j and a chain of k true next tokens."""
    torch.manual_seed(0)
    target = tiny_target()
    draft = (
        build_draft("llama_eagle3", DraftConfig(draft_vocab_size=32), target, [1, 2, 2])
        .double()
        .eval()
    )
    seq = 7
    ids = torch.randint(0, 32, (1, seq))
    aux = torch.randn(1, seq, 48, dtype=torch.float64)
    shifted = shift_left(ids)  # position j embeds token j+1
    with torch.no_grad():
        ttt_logits = draft(shifted, aux, torch.ones(1, seq, dtype=torch.long), ttt_length=3)
        for j in range(seq - 3):
            cache = DecodeCache()
            hidden = draft.backbone(
                draft.embed(shifted[:, : j + 1]),
                draft.project(aux[:, : j + 1]),
                torch.arange(j + 1)[None],
                cache,
            )[:, -1:]
            torch.testing.assert_close(draft.compute_logits(hidden)[0, 0], ttt_logits[0][0, j])
            for k in range(1, 3):
                token = shifted[:, j + k : j + k + 1]
                hidden = draft.backbone(draft.embed(token), hidden, torch.tensor([[j + k]]), cache)
                torch.testing.assert_close(draft.compute_logits(hidden)[0, 0], ttt_logits[k][0, j])


def test_draft_parameter_names_are_the_sglang_names():
    draft = build_draft("llama_eagle3", DraftConfig(draft_vocab_size=20), tiny_target(), [1, 2, 2])
    names = set(draft.state_dict())
    assert names == set(LlamaEagle3Draft.EXPORT_KEYS) | {"embed_tokens.weight"}
    assert draft.fc.weight.shape == (16, 48)
    assert draft.midlayer.self_attn.q_proj.weight.shape == (16, 32)  # 2H inputs
    assert draft.midlayer.self_attn.k_proj.weight.shape == (8, 32)
    assert draft.lm_head.weight.shape == (20, 16)
    assert draft.t2d.dtype == torch.bool and draft.t2d.shape == (32,)
    assert draft.d2t.dtype == torch.int64 and draft.d2t.shape == (20,)
    assert not draft.embed_tokens.weight.requires_grad


def test_registry_clamps_draft_vocab_and_refuses_unknown_architectures():
    assert "llama_eagle3" in available_drafts()
    draft = build_draft("llama_eagle3", DraftConfig(), tiny_target(), [1, 2, 2])  # 32000 > V
    assert draft.config.draft_vocab_size == 32
    with pytest.raises(ConfigError, match="nope"):
        build_draft("nope", DraftConfig(), tiny_target(), [1, 2, 2])
    with pytest.raises(ConfigError, match="rope_scaling"):
        build_draft(
            "llama_eagle3",
            DraftConfig(),
            tiny_target(rope_scaling={"rope_type": "yarn", "factor": 2.0}),
            [1, 2, 2],
        )


def test_llama3_rope_scaling_matches_transformers():
    from specbus.core.models.llama_eagle3 import rope_inv_freq
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    cfg = LlamaConfig(
        hidden_size=512,
        num_attention_heads=4,
        max_position_embeddings=131072,
        rope_parameters={"rope_theta": 500000.0, **scaling},
    )
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    torch.testing.assert_close(rope_inv_freq(128, 500000.0, scaling), expected.float())


def _tiles(bm):
    """Dense partial / full tiles `[B, H, Qt, Kt]` of a BlockMask."""

    def dense(num, idx):
        kt = idx.shape[-1]
        out = torch.zeros(*num.shape, kt + 1, dtype=torch.bool)
        sel = torch.where(torch.arange(kt) < num[..., None], idx.long(), kt)
        return out.scatter_(-1, sel, True)[..., :kt]

    return dense(bm.kv_num_blocks, bm.kv_indices), dense(bm.full_kv_num_blocks, bm.full_kv_indices)


@pytest.mark.parametrize(
    "seq,lengths", [(300, (300, 200)), (256, (256, 100)), (1000, (1000,)), (130, (130, 1))]
)
def test_ttt_block_masks_are_create_block_masks_tiles_built_once(seq, lengths):
    """The tile-level builder gives exactly create_block_mask's partial and full tiles for
    every TTT step (lengths that are and are not whole tiles, padded rows)."""
    from specbus.core.models.llama_eagle3 import ttt_block_masks, ttt_mask_mod
    from torch.nn.attention.flex_attention import create_block_mask

    pad = torch.zeros(len(lengths), seq, dtype=torch.long)
    for i, n in enumerate(lengths):
        pad[i, :n] = 1
    masks = ttt_block_masks(pad, 4)
    for k, m in enumerate(masks):
        ref = create_block_mask(ttt_mask_mod(pad), len(lengths), None, seq, (k + 1) * seq, "cpu")
        for ours, theirs in zip(_tiles(m.block_mask), _tiles(ref), strict=True):
            assert torch.equal(ours, theirs), (k, seq)


def test_flex_ttt_forward_matches_the_eager_path_on_cpu():
    """The flex TTT path (grouped-query keys, the per-step masks of the forward) computes the
    eager path's attention (CPU: the unfused flex forward; CUDA: tests/test_eagle3_gpu.py)."""
    import warnings

    from specbus.core.models.llama_eagle3 import _ttt_flex

    warnings.filterwarnings("ignore", message=".*without torch.compile.*")
    torch.manual_seed(0)
    padding = torch.tensor([[1] * 200, [1] * 150 + [0] * 50])
    eager = TTTCache(key_padding_BL=padding)
    flex = TTTCache(key_padding_BL=padding, attention="flex")
    with torch.no_grad():
        for _ in range(3):
            k, v = torch.randn(2, 2, 2, 200, 16).unbind(0)  # 2 kv heads
            q = torch.randn(2, 4, 200, 16)  # 4 query heads
            eager.keys.append(k.repeat_interleave(2, 1)), eager.values.append(v.repeat_interleave(2, 1))  # fmt: skip
            flex.keys.append(k), flex.values.append(v)
            torch.testing.assert_close(
                _ttt_flex(q, flex), _ttt_eager(q, eager), rtol=1e-5, atol=1e-5
            )


def test_norms_read_by_matmuls_give_autocasts_dtype_with_the_same_values():
    """Under autocast the draft's norms that only matmuls read return autocast's dtype
    (`RMSNorm(matmul_input=True)`): the logits are bit for bit those of fp32 norms cast by
    autocast before each matmul, and the gradients differ by bf16 rounding only (the three
    q/k/v gradients of the norms' output now add in bf16)."""
    from specbus.core.models.llama_eagle3 import RMSNorm

    torch.manual_seed(0)
    draft = build_draft("llama_eagle3", DraftConfig(draft_vocab_size=32), tiny_target(), [1, 2, 2])
    norms = [m for m in draft.modules() if isinstance(m, RMSNorm)]
    assert len(norms) == 4 and all(m.matmul_input for m in norms)
    ids = torch.randint(0, 32, (2, 24))
    aux = torch.randn(2, 24, 48)
    mask = torch.ones(2, 24, dtype=torch.long)

    def run(matmul_input: bool):
        for m in norms:
            m.matmul_input = matmul_input
        draft.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            x = draft.midlayer.input_layernorm(torch.randn(3, 16))
            logits = draft(ids, aux, mask, ttt_length=3)
        sum(lg.float().pow(2).mean() for lg in logits).backward()
        grads = {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}
        return x.dtype, [lg.detach() for lg in logits], grads

    dtype, fused, fused_grads = run(True)
    plain_dtype, plain, plain_grads = run(False)
    assert (dtype, plain_dtype) == (torch.bfloat16, torch.float32)
    for a, b in zip(fused, plain, strict=True):
        assert torch.equal(a, b)
    assert fused_grads.keys() == plain_grads.keys() and len(fused_grads) == 13
    for name, g in plain_grads.items():
        torch.testing.assert_close(
            fused_grads[name], g, rtol=2e-2, atol=2e-2 * g.abs().max().item()
        )
