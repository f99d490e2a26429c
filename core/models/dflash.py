"""DFlash-family drafts (DFlash, Domino, DSpark): Qwen3-style layers with target-context KV injection.

Shape legend: B batch, L context (target sequence), N blocks (anchors), K block size,
Q = N*K draft queries, T new positions (decode), H hidden (draft = target), A aux width
(= number of target layers * H), Nh attention heads, Nkv key/value heads, D head dim,
V target vocab, G Domino GRU width, E Domino projection width, R DSpark Markov rank.

    fc           [H, A]        projects the concatenated target-layer outputs (the context)
    hidden_norm  [H]           RMSNorm of the projected context
    layers.i     Qwen3 decoder layer: q/k/v/o projections with per-head q_norm/k_norm, SwiGLU
                 MLP, pre-norm residuals. The same k/v projections read the context and the
                 draft tokens: context keys/values are injected in front of the block's own.
    norm         [H]           final RMSNorm; logits come from the target's frozen lm_head
    Domino:      prefix_gru (GRU H -> G over earlier block tokens' embeddings, no bias),
                 embed_proj.0 [E, H+G], SiLU, embed_proj.2 [V, E]: a residual on the base logits
    DSpark:      markov_head.markov_w1 [V, R], markov_head.markov_w2 [V, R] (a low-rank bias
                 from the previous token; "gated" adds gate_proj, "rnn" joint_proj), and
                 confidence_head.proj [1, H (+R)] (predicted acceptance probability)

The names are those SpecForge 0.2.0 trains and SGLang loads (`DFlashDraftModel`,
`Qwen3DSparkModel`). The target's `embed_tokens` and `lm_head` are not part of the draft: the
strategy passes them in (frozen), and decoding reads them from the target.

Training attention (`forward`): the queries are N blocks of K positions; block n sees the
context keys strictly before its anchor and every key of its own block. A query row with no
allowed key (a padding block) gets a zero attention output, as the reference's eager path.
Three paths: "eager" (explicit scores, the reference's arithmetic), "sdpa" (the dense boolean
mask `[B, Q, L + Q]`) and "flex" (`FlexBlocks`: a flex-attention BlockMask built from the
anchors at the tile level, no dense mask; context and queries padded to whole tiles; compiled
kernel on CUDA, on the CPU the same tiles and mask as a dense SDPA, for tests).
Decoding (`ContextCache`): the context K/V of every verified position is kept per layer; a
block attends to all of it and to itself (no mask).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from specbus.core.errors import ConfigError
from specbus.core.models.dflash_attention import (  # noqa: F401  (part of this module's API)
    FLEX_TILE,
    FlexBlocks,
    _flex_dense,
    _repeat_kv,
    flex_attend,
    flex_blocks,
)
from specbus.core.models.kernels import swiglu
from specbus.core.models.llama_eagle3 import RMSNorm, apply_rope, rope_inv_freq
from torch import nn

log = logging.getLogger("specbus.dflash")

PROJECTORS = ("dflash", "domino", "dspark")
MARKOV_HEADS = ("vanilla", "gated", "rnn")


@dataclass
class DFlashConfig:
    """Architecture of one DFlash-family draft; `core/export/dflash.py` writes it for SGLang."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    target_layer_ids: list[int]
    num_target_layers: int
    block_size: int = 16
    mask_token_id: int = 0
    projector: str = "dflash"
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    initializer_range: float = 0.02
    # Domino (label layout: SpecForge's draft-config defaults; the strategy sets its recipe's)
    emb_dim: int = 256
    gru_hidden_dim: int = 256
    shift_label: bool = False
    pure_draft_prefix_len: int = 0
    # DSpark
    markov_rank: int = 0
    markov_head_type: str = "vanilla"
    confidence_head: bool = False
    confidence_with_markov: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.projector not in PROJECTORS:
            raise ConfigError(f"DFlash projector {self.projector!r} is not one of {PROJECTORS}")
        if self.markov_head_type not in MARKOV_HEADS:
            raise ConfigError(
                f"strategy.dspark.markov_head_type {self.markov_head_type!r} is not one of {MARKOV_HEADS}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"draft heads {self.num_attention_heads} are not a multiple of kv heads {self.num_key_value_heads}"
            )
        if self.confidence_with_markov and self.markov_rank <= 0:
            raise ConfigError("strategy.dspark.confidence_with_markov needs markov_rank > 0")
        if self.projector == "domino" and (
            self.pure_draft_prefix_len < 0 or self.suffix_start >= self.block_size
        ):
            raise ConfigError(
                f"strategy.domino.pure_draft_prefix_len={self.pure_draft_prefix_len} leaves no "
                f"corrected position in a block of {self.block_size}"
            )
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ConfigError(
                f"strategy.mask_token_id {self.mask_token_id} is outside the vocabulary [0, {self.vocab_size})"
            )

    @property
    def suffix_start(self) -> int:
        """Domino: the first block position whose logits get the GRU correction (SpecForge's
        `DominoDraftModel.suffix_start`): the pure-draft prefix, after position 0 when
        position 0 predicts nothing (labels not shifted)."""
        return self.pure_draft_prefix_len + (0 if self.shift_label else 1)


# ---------------------------------------------------------------------------------------------
# Layers


class MLP(nn.Module):
    """The draft's SwiGLU MLP (silu only)."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        if cfg.hidden_act != "silu":
            raise ConfigError(f"draft hidden_act {cfg.hidden_act!r} is not supported (silu)")
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """down(silu(gate(x)) * up(x)) (a compiled kernel on CUDA, `core.models.kernels`)."""
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class Attention(nn.Module):
    """Block attention: a block's queries see the injected context keys/values (projected target
    states) and their own block."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        # Not a buffer: module.to(bf16) must not round the frequencies.
        self.inv_freq = rope_inv_freq(d, cfg.rope_theta, cfg.rope_scaling)

    def context_kv(
        self, ctx_BLH: torch.Tensor, positions_BL: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (normed, rotated) and values of the context `[B, Nkv, L, D]`."""
        b, seq, _ = ctx_BLH.shape
        k = self.k_norm(self.k_proj(ctx_BLH).view(b, seq, self.num_kv_heads, self.head_dim))
        v = self.v_proj(ctx_BLH).view(b, seq, self.num_kv_heads, self.head_dim)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        _, k = apply_rope(k, k, self.inv_freq, positions_BL)
        return k, v

    def forward(
        self,
        x_BQH: torch.Tensor,
        kv_ctx: tuple[torch.Tensor, torch.Tensor],
        positions_BQ: torch.Tensor,
        allow_BQS: torch.Tensor | None,
        attention: str = "sdpa",
    ) -> torch.Tensor:
        """`allow_BQS` (S = L + Q) is the boolean mask over [context | block keys], None (all), or
        `FlexBlocks` (flex attention; queries already padded to its `q_pad`). `attention`:
        "sdpa" (any backend) or "eager" (explicit scores, the reference's arithmetic) for a
        boolean mask."""
        b, q_len, _ = x_BQH.shape
        q = self.q_norm(self.q_proj(x_BQH).view(b, q_len, self.num_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x_BQH).view(b, q_len, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x_BQH).view(b, q_len, self.num_kv_heads, self.head_dim)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = apply_rope(q, k, self.inv_freq, positions_BQ)
        rep = self.num_heads // self.num_kv_heads
        if isinstance(allow_BQS, FlexBlocks):
            pad = allow_BQS.ctx_len - kv_ctx[0].shape[2]
            keys = torch.cat([F.pad(kv_ctx[0], (0, 0, 0, pad)), k], dim=2)
            values = torch.cat([F.pad(kv_ctx[1], (0, 0, 0, pad)), v], dim=2)
            out = flex_attend(q, keys, values, allow_BQS, rep)
            return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))
        keys = _repeat_kv(torch.cat([kv_ctx[0], k], dim=2), rep)
        values = _repeat_kv(torch.cat([kv_ctx[1], v], dim=2), rep)
        empty_BQ1 = None if allow_BQS is None else ~allow_BQS.any(-1, keepdim=True)
        if attention == "eager":  # the reference's eager arithmetic (CPU, parity)
            scores = torch.matmul(q, keys.transpose(2, 3)) * self.head_dim**-0.5
            if allow_BQS is not None:
                scores = scores.masked_fill(~allow_BQS[:, None], torch.finfo(scores.dtype).min)
            probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            out = torch.matmul(probs, values)
        else:
            # A row with no allowed key (a padding block) attends everywhere, then is zeroed:
            # no NaN on any SDPA backend, and the reference's eager result (0) exactly.
            mask = None if allow_BQS is None else (allow_BQS | empty_BQ1)[:, None]
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        out = self.o_proj(out.transpose(1, 2).reshape(b, q_len, self.num_heads * self.head_dim))
        if empty_BQ1 is not None:
            out = out.masked_fill(empty_BQ1, 0.0)
        return out


class DecoderLayer(nn.Module):
    """One draft layer: attention over context + block, then the MLP, pre-norm with residuals."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        # each feeds only matmuls (q/k/v, the MLP): under autocast, handed over in its dtype
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, matmul_input=True)
        self.post_attention_layernorm = RMSNorm(
            cfg.hidden_size, cfg.rms_norm_eps, matmul_input=True
        )

    def forward(self, x_BQH, kv_ctx, positions_BQ, allow_BQS, attention="sdpa") -> torch.Tensor:
        """The block's hidden states `[B, Q, H]` after this layer."""
        h = x_BQH + self.self_attn(
            self.input_layernorm(x_BQH), kv_ctx, positions_BQ, allow_BQS, attention
        )
        return h + self.mlp(self.post_attention_layernorm(h))


# ---------------------------------------------------------------------------------------------
# Heads


class MarkovHead(nn.Module):
    """DSpark's previous-token bias: `w2(w1[prev])` ("vanilla"), gated by hidden ("gated"), or an
    RNN unrolled over the block ("rnn")."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        r, h = cfg.markov_rank, cfg.hidden_size
        self.kind = cfg.markov_head_type
        self.markov_rank = r
        self.markov_w1 = nn.Embedding(cfg.vocab_size, r)
        self.markov_w2 = nn.Linear(r, cfg.vocab_size, bias=False)
        if self.kind == "gated":
            self.gate_proj = nn.Linear(h + r, r)
        elif self.kind == "rnn":
            self.joint_proj = nn.Linear(2 * r + h, 3 * r)

    def prev_embeddings(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The Markov head's embedding of the previous tokens."""
        return self.markov_w1(token_ids.long())

    def _rnn_step(self, state, prev_emb, hidden):
        gate_raw, cand_raw, out_raw = self.joint_proj(
            torch.cat([state, prev_emb, hidden], dim=-1)
        ).chunk(3, dim=-1)
        gate = torch.sigmoid(gate_raw)
        state = gate * state + (1.0 - gate) * torch.tanh(cand_raw)
        return state, self.markov_w2(torch.tanh(out_raw))

    def step_bias(self, prev_B, hidden_BH, state):
        """One decoding step: the bias `[B, V]` from the previous token, and the next state."""
        emb = self.prev_embeddings(prev_B)
        if self.kind == "vanilla":
            return self.markov_w2(emb), state
        if self.kind == "gated":
            gate = torch.sigmoid(self.gate_proj(torch.cat([hidden_BH, emb], dim=-1)))
            return self.markov_w2(gate.to(emb.dtype) * emb), state
        if state is None:
            state = emb.new_zeros(emb.shape[0], self.markov_rank).to(hidden_BH.dtype)
        state, bias = self._rnn_step(state, emb, hidden_BH)
        return bias, state

    def block_logits(self, base_BNKV, prev_BNK, hidden_BNKH) -> torch.Tensor:
        """Teacher-forced block logits: base + bias of each position's previous token."""
        if self.kind != "rnn":
            emb = self.prev_embeddings(prev_BNK)
            if self.kind == "gated":
                gate = torch.sigmoid(self.gate_proj(torch.cat([hidden_BNKH, emb], dim=-1)))
                emb = gate.to(emb.dtype) * emb
            return base_BNKV + self.markov_w2(emb)
        state = hidden_BNKH.new_zeros(*base_BNKV.shape[:-2], self.markov_rank)
        out = []
        for k in range(base_BNKV.shape[-2]):
            emb = self.prev_embeddings(prev_BNK[..., k])
            state, bias = self._rnn_step(state, emb, hidden_BNKH[..., k, :])
            out.append(base_BNKV[..., k, :] + bias)
        return torch.stack(out, dim=-2)


class ConfidenceHead(nn.Module):
    """DSpark's acceptance predictor: one logit per draft position."""

    def __init__(self, input_dim: int):
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """One acceptance logit per position."""
        return self.proj(features).squeeze(-1)


# ---------------------------------------------------------------------------------------------
# The draft


@dataclass
class ContextCache:
    """Decoding: per layer, the context keys/values `[1, Nkv, T, D]` of the verified positions."""

    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)

    @property
    def length(self) -> int:
        """Verified context positions cached."""
        return 0 if not self.keys else int(self.keys[0].shape[2])


class DFlashDraft(nn.Module):
    """A DFlash-family draft (`projector` dflash | domino | dspark); everything here trains."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.layers = nn.ModuleList([DecoderLayer(cfg) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.fc = nn.Linear(len(cfg.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        if cfg.projector == "domino":
            self.prefix_gru = nn.GRU(
                h, cfg.gru_hidden_dim, num_layers=1, batch_first=True, bias=False
            )
            self.embed_proj = nn.Sequential(
                nn.Linear(h + cfg.gru_hidden_dim, cfg.emb_dim, bias=False),
                nn.SiLU(),
                nn.Linear(cfg.emb_dim, cfg.vocab_size, bias=False),
            )
        if cfg.projector == "dspark":
            self.markov_head = MarkovHead(cfg) if cfg.markov_rank > 0 else None
            self.confidence_head = (
                ConfidenceHead(h + (cfg.markov_rank if cfg.confidence_with_markov else 0))
                if cfg.confidence_head
                else None
            )
        self.reset_parameters()

    @property
    def block_size(self) -> int:
        """Tokens per drafted block (K)."""
        return self.config.block_size

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Linear and embedding weights N(0, initializer_range), biases 0, norms 1; the GRU keeps
        PyTorch's own initialisation."""
        std = self.config.initializer_range
        for module in self.modules():
            if isinstance(module, nn.Linear):
                module.weight.normal_(0.0, std)
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, nn.Embedding):
                module.weight.normal_(0.0, std)
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)

    def project(self, aux_BLA: torch.Tensor) -> torch.Tensor:
        """The injected context: hidden_norm(fc(concatenated target-layer outputs))."""
        if aux_BLA.shape[-1] != self.fc.in_features:
            raise ConfigError(
                f"context features width {aux_BLA.shape[-1]} != {len(self.config.target_layer_ids)} target layers x hidden"
            )
        return self.hidden_norm(self.fc(aux_BLA.to(self.fc.weight.dtype)))

    def forward(
        self,
        noise_BQH: torch.Tensor,
        aux_BLA: torch.Tensor,
        positions_BS: torch.Tensor,
        allow_BQS: torch.Tensor,
        attention: str = "sdpa",
    ) -> torch.Tensor:
        """Training pass over all blocks at once; returns the post-norm hidden `[B, Q, H]`.

        `noise_BQH`: the blocks' token embeddings ([anchor, MASK x (K-1)] per block);
        `positions_BS`: [context positions | block positions] (S = L + Q).
        """
        ctx = self.project(aux_BLA)
        seq = ctx.shape[1]
        ctx_pos, q_pos = positions_BS[:, :seq], positions_BS[:, seq:]
        h = noise_BQH.to(ctx.dtype)
        q_len = h.shape[1]
        if isinstance(allow_BQS, FlexBlocks):  # whole query tiles (the padding sees nothing)
            h = F.pad(h, (0, 0, 0, allow_BQS.q_pad - q_len))
            q_pos = F.pad(q_pos, (0, allow_BQS.q_pad - q_len))
        for layer in self.layers:
            kv = layer.self_attn.context_kv(ctx, ctx_pos)
            h = layer(h, kv, q_pos, allow_BQS, attention)
        return self.norm(h[:, :q_len])

    # -- decoding ------------------------------------------------------------------------
    @torch.no_grad()
    def extend_context(self, cache: ContextCache, aux_1TA: torch.Tensor, start: int) -> None:
        """Inject the target features of positions start..start+T-1 into every layer's cache."""
        ctx = self.project(aux_1TA)
        positions = torch.arange(start, start + ctx.shape[1], device=ctx.device)[None]
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.context_kv(ctx, positions)
            if i < len(cache.keys):
                cache.keys[i] = torch.cat([cache.keys[i][:, :, :start], k], dim=2)
                cache.values[i] = torch.cat([cache.values[i][:, :, :start], v], dim=2)
            else:
                cache.keys.append(k)
                cache.values.append(v)

    @torch.no_grad()
    def block_hidden(self, cache: ContextCache, emb_1KH: torch.Tensor, start: int) -> torch.Tensor:
        """One block at positions start..start+K-1 over the whole cached context: `[1, K, H]`."""
        positions = torch.arange(start, start + emb_1KH.shape[1], device=emb_1KH.device)[None]
        h = emb_1KH.to(self.fc.weight.dtype)
        for i, layer in enumerate(self.layers):
            h = layer(h, (cache.keys[i], cache.values[i]), positions, None)
        return self.norm(h)

    # -- heads ---------------------------------------------------------------------------
    def domino_logits(
        self, base_BNKV: torch.Tensor, hidden_BNKH: torch.Tensor, prev_emb_BNKH: torch.Tensor
    ) -> torch.Tensor:
        """Domino's final logits: block position k >= `suffix_start` adds
        embed_proj(hidden_k, GRU state after the previous tokens of its label); the others keep
        the base logits. `prev_emb_BNKH`: the embeddings of the tokens at anchor+0..K-1 (shifted
        labels: the GRU reads up to position k, whose label is k+1) or of the labels at
        anchor+0..K-1 (not shifted: it reads up to k-1, position 0 being the anchor)."""
        b, n, k = base_BNKV.shape[:3]
        start = self.config.suffix_start
        steps = k if self.config.shift_label else k - 1
        gru_in = prev_emb_BNKH[:, :, :steps].reshape(b * n, steps, -1)
        gru_out = self.prefix_gru(gru_in.to(self.fc.weight.dtype))[0].reshape(b, n, steps, -1)
        first = start if self.config.shift_label else start - 1  # the GRU state of position start
        residual = self.embed_proj(
            torch.cat([hidden_BNKH[:, :, start:], gru_out[:, :, first:].to(hidden_BNKH.dtype)], -1)
        )
        return torch.cat([base_BNKV[:, :, :start], base_BNKV[:, :, start:] + residual], dim=2)

    def confidence_logits(
        self, hidden: torch.Tensor, prev_ids: torch.Tensor
    ) -> torch.Tensor | None:
        """DSpark's acceptance logits for the block's positions (None without a confidence head)."""
        if getattr(self, "confidence_head", None) is None:
            return None
        features = hidden
        if self.config.confidence_with_markov:
            prev = self.markov_head.prev_embeddings(prev_ids).to(hidden.dtype)
            features = torch.cat([hidden, prev], dim=-1)
        return self.confidence_head(features).float()
