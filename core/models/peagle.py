"""The P-EAGLE draft (parallel EAGLE): speculators 0.9's `PEagleDraftModel`, the names it saves and
vLLM loads (`Eagle3LlamaForCausalLM` / `Eagle3Qwen3ForCausalLM` with parallel drafting).

Shape legend: T packed tokens (every sample of a micro-batch, one after the other), S rows
(T depth-0 rows + the COD-sampled rows of depths 1..D-1), H hidden (draft = target), A = n * H
(n aux layers), Nh / Nkv heads, Dh head dim, V target vocab, Vd draft vocab, D depths.

    embed_tokens  [V, H]      the target's embedding, trained (speculators' P-EAGLE default)
    fc            [H, A]      projects the concatenated aux hidden states
    mask_hidden   [1, 1, A]   the aux features of a row whose token is not known yet (depth >= 1)
    layers.0      EAGLE3's first layer: input_layernorm(emb) ++ hidden_norm(hidden) -> q/k/v
                  (2H wide); residual on the hidden (its normed copy with norm_before_residual)
    layers.i>0    plain pre-norm decoder layers (H wide)
    norm [H], lm_head [Vd, H] (frozen: the target's lm_head rows of the draft vocabulary),
    d2t [Vd] int64, t2d [V] bool
`layer_type` "qwen3" adds per-head q_norm / k_norm before the rotary embedding (Qwen3
attention); "llama" has none.

A row is (token, aux features, position): depth-0 row p holds token p+1's embedding and the aux
features of position p (the data is shifted as speculators' `shift_batch`); a row at depth d of
the chain anchored at a holds the MASK token and `mask_hidden` at position a + d and predicts
token a + d + 2. Attention (`peagle_allow`): a row sees the depth-0 rows of its sample at or
before its anchor (inside `sliding_window`, when set) and the rows of its own chain at or below
its depth. Decoding (core/eval/peagle.py) is the same attention with a per-layer KV cache of the
depth-0 rows: one forward over the new depth-0 rows and D-1 mask rows drafts D tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from specbus.core.errors import ConfigError
from specbus.core.models.llama_eagle3 import MLP as _MLP
from specbus.core.models.llama_eagle3 import RMSNorm, _repeat_kv, apply_rope, rope_inv_freq
from torch import nn

LAYER_TYPES = ("llama", "qwen3")


@dataclass
class PEagleConfig:
    """Architecture of one P-EAGLE draft (`core/export/peagle.py` writes it for vLLM)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    aux_layers: list[int]
    mask_token_id: int
    num_depths: int = 8
    layer_type: str = "qwen3"
    norm_before_residual: bool = True
    sliding_window: int | None = None
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    initializer_range: float = 0.02
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.layer_type not in LAYER_TYPES:
            raise ConfigError(
                f"strategy.peagle.layer_type {self.layer_type!r} is not one of {LAYER_TYPES}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"draft heads {self.num_attention_heads} are not a multiple of kv heads {self.num_key_value_heads}"
            )
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ConfigError(
                f"strategy.mask_token_id {self.mask_token_id} is outside the vocabulary"
            )
        if not self.aux_layers:
            raise ConfigError("a P-EAGLE draft reads at least one aux layer")


class Attention(nn.Module):
    """Attention over an explicit boolean mask (training rows or cache + new rows); `in_mult` 2 in
    the first layer (q/k/v read [emb; hidden])."""

    def __init__(self, cfg: PEagleConfig, in_mult: int):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            d,
        )
        self.q_proj = nn.Linear(in_mult * h, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(in_mult * h, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(in_mult * h, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)
        if cfg.layer_type == "qwen3":
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        # Not a buffer: module.to(bf16) must not round the frequencies.
        self.inv_freq = rope_inv_freq(d, cfg.rope_theta, cfg.rope_scaling)

    def forward(
        self, x_1SI: torch.Tensor, positions_1S: torch.Tensor, allow_SK: torch.Tensor, cache=None
    ) -> torch.Tensor:
        """`allow_SK`: query row s may see key k, the keys being [cached | these rows]. `cache`
        (decoding): a list [keys, values] of earlier rows (kv heads not repeated, None when
        empty) to which these rows' keys/values are appended, in place."""
        b, seq, _ = x_1SI.shape
        q = self.q_proj(x_1SI).view(b, seq, self.num_heads, self.head_dim)
        k = self.k_proj(x_1SI).view(b, seq, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x_1SI).view(b, seq, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = apply_rope(q, k, self.inv_freq, positions_1S)
        if cache is not None:
            if cache[0] is not None:
                k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
            cache[0], cache[1] = k, v
        rep = self.num_heads // self.num_kv_heads
        # the reference's eager arithmetic: scores + a 0/min float mask, softmax in fp32
        scores = torch.matmul(q, _repeat_kv(k, rep).transpose(2, 3)) * self.head_dim**-0.5
        mask = torch.zeros(allow_SK.shape, dtype=scores.dtype, device=scores.device)
        scores = scores + mask.masked_fill(~allow_SK, torch.finfo(scores.dtype).min)
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(probs, _repeat_kv(v, rep))
        return self.o_proj(out.transpose(1, 2).reshape(b, seq, -1))


class DecoderLayer(nn.Module):
    """A pre-norm decoder layer; the first reads [input_layernorm(emb); hidden_norm(hidden)]."""

    def __init__(self, cfg: PEagleConfig, first: bool):
        super().__init__()
        self.first = first
        self.norm_before_residual = cfg.norm_before_residual
        self.self_attn = Attention(cfg, 2 if first else 1)
        self.mlp = _MLP(cfg)  # SwiGLU (silu only), the same module as EAGLE3's
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if first:
            self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, emb_1SH, hidden_1SH, positions_1S, allow_SK, cache=None) -> torch.Tensor:
        """The layer's output `[1, S, H]` (`emb_1SH` is read by the first layer only)."""
        if self.first:
            normed = self.hidden_norm(hidden_1SH)
            residual = normed if self.norm_before_residual else hidden_1SH
            x = torch.cat([self.input_layernorm(emb_1SH), normed], dim=-1)
        else:
            residual, x = hidden_1SH, self.input_layernorm(hidden_1SH)
        h = residual + self.self_attn(x, positions_1S, allow_SK, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


def peagle_allow(
    anchor_S: torch.Tensor,
    depth_S: torch.Tensor,
    document_T: torch.Tensor,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """`[S, S]` training mask (speculators' `create_peagle_mask_mod`): same sample, and either a
    depth-0 key at or before the query's anchor (inside the window) or a key of the query's own
    chain at or below its depth."""
    qa, ka = anchor_S[:, None], anchor_S[None, :]
    qd, kd = depth_S[:, None], depth_S[None, :]
    same_doc = document_T[qa] == document_T[ka]
    context = (kd == 0) & (qa >= ka)
    if sliding_window is not None:
        context = context & (ka > qa + qd - sliding_window)
    return (document_T[qa] != -1) & same_doc & (context | ((qa == ka) & (qd >= kd)))


class PEagleDraft(nn.Module):
    """A P-EAGLE draft: embedding, fc, mask_hidden, norm, layers train; lm_head is frozen."""

    def __init__(self, cfg: PEagleConfig):
        super().__init__()
        self.config = cfg
        h, a = cfg.hidden_size, len(cfg.aux_layers) * cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h)
        self.fc = nn.Linear(a, h, bias=False)
        self.layers = nn.ModuleList(
            [DecoderLayer(cfg, first=i == 0) for i in range(cfg.num_layers)]
        )
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        self.lm_head.weight.requires_grad_(False)
        self.mask_hidden = nn.Parameter(torch.randn(1, 1, a))
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool))
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Linear and embedding weights N(0, initializer_range), norms 1; `mask_hidden` keeps its
        standard-normal draw (speculators' `torch.randn`)."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.normal_(0.0, self.config.initializer_range)
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)

    @torch.no_grad()
    def load_target_heads(self, embed_VH: torch.Tensor, lm_head_VH: torch.Tensor) -> None:
        """The target's embedding into `embed_tokens` and its lm_head rows of the draft
        vocabulary (`t2d`) into the frozen `lm_head` (speculators' `load_verifier_weights`)."""
        if tuple(embed_VH.shape) != tuple(self.embed_tokens.weight.shape):
            raise ConfigError(f"target embedding {tuple(embed_VH.shape)} != draft embed_tokens "
                              f"{tuple(self.embed_tokens.weight.shape)}")  # fmt: skip
        self.embed_tokens.weight.copy_(embed_VH)
        self.lm_head.weight.copy_(lm_head_VH[self.t2d.to(lm_head_VH.device)])

    @torch.no_grad()
    def load_vocab_mapping(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """The run's `d2t`/`t2d` into the buffers; `ConfigError` for another shape."""
        if d2t.shape != self.d2t.shape or t2d.shape != self.t2d.shape:
            raise ConfigError(f"vocab mapping d2t{tuple(d2t.shape)}/t2d{tuple(t2d.shape)} does not fit "
                              f"the draft (d2t{tuple(self.d2t.shape)}/t2d{tuple(self.t2d.shape)})")  # fmt: skip
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def rows(self, ids_1S: torch.Tensor, aux_1SA: torch.Tensor, is_mask_S: torch.Tensor):
        """(token embeddings, fc(aux features)) of rows: a mask row (depth >= 1) gets the MASK
        token's embedding (its id is in `ids_1S`) and `mask_hidden` instead of its features."""
        emb = self.embed_tokens(ids_1S)
        mask_hidden = self.mask_hidden.to(aux_1SA.dtype).squeeze(0).expand(aux_1SA.shape[1], -1)
        aux = torch.where(is_mask_S[:, None], mask_hidden, aux_1SA[0])[None]
        hidden = self.fc(aux.to(self.fc.weight.dtype))
        return emb.to(hidden.dtype), hidden

    def forward(
        self,
        ids_1S: torch.Tensor,
        aux_1SA: torch.Tensor,
        is_mask_S: torch.Tensor,
        positions_1S: torch.Tensor,
        allow_SK: torch.Tensor,
        caches: list | None = None,
    ) -> torch.Tensor:
        """The rows' draft-vocabulary logits `[1, S, Vd]` (every trained parameter is used inside
        this call: a DDP/FSDP wrapper sees one forward). `caches[i]` (decoding): layer i's
        keys/values of earlier rows, `allow_SK` then spans them."""
        emb, h = self.rows(ids_1S, aux_1SA, is_mask_S)
        for i, layer in enumerate(self.layers):
            h = layer(emb, h, positions_1S, allow_SK, None if caches is None else caches[i])
        return self.lm_head(self.norm(h))
