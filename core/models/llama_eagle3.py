"""The EAGLE3 draft, `LlamaForCausalLMEagle3`-compatible (the names SGLang loads).

Shape legend: B batch, L sequence, T new positions (decode), H draft hidden, Ht target hidden,
N attention heads, Nkv key/value heads, D head dim, I intermediate, V target vocab,
Vd draft vocab, K TTT step.

    embed_tokens  [V, H]          frozen copy of the target's input embedding (never exported)
    fc            [H, 3*Ht]       projects the three concatenated aux hidden states
    midlayer      one decoder layer: input_layernorm(emb) ++ hidden_norm(hidden) -> 2H inputs of
                  q/k/v; residual on the hidden stream; SwiGLU MLP after post_attention_layernorm
    norm          [H]             final RMSNorm before lm_head
    lm_head       [Vd, H]
    d2t [Vd] int64, t2d [V] bool  vocab mapping buffers

Attention has two modes (eagle3_attention.py): training (TTT, `TTTCache`; rotary positions
offset by the step K) and decoding (`DecodeCache`, plain causal attention over a growing KV
cache, the same function at inference positions).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from specbus.core.errors import ConfigError
from specbus.core.models.eagle3_attention import (  # noqa: F401  (part of this module's API)
    TILE,
    DecodeCache,
    TTTCache,
    TTTMask,
    _ttt_eager,
    _ttt_flash,
    _ttt_flex,
    block_mask_from_tiles,
    step0_mask,
    ttt_block_masks,
    ttt_mask_mod,
)
from specbus.core.models.kernels import rms_norm, rms_norm_to, rope, swiglu
from torch import nn


@dataclass
class Eagle3Config:
    """Architecture of one draft; `to_hf_dict()` is the exported config.json."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    aux_layers: list[int] = field(default_factory=list)
    initializer_range: float = 0.02
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    def to_hf_dict(self) -> dict[str, Any]:
        """The `config.json` SGLang loads as `LlamaForCausalLMEagle3`."""
        out: dict[str, Any] = {
            "architectures": ["LlamaForCausalLMEagle3"],
            "model_type": "llama",
            "num_hidden_layers": 1,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": self.hidden_act,
            "rms_norm_eps": self.rms_norm_eps,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "initializer_range": self.initializer_range,
            "attention_bias": False,
            "mlp_bias": False,
            "pretraining_tp": 1,
            "tie_word_embeddings": False,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
        }
        if self.aux_layers:
            out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(self.aux_layers)}
        return out

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> Eagle3Config:
        """The config of an exported draft (rope settings in either transformers spelling)."""
        rope_theta, rope_scaling = d.get("rope_theta"), d.get("rope_scaling")
        if rope_theta is None and isinstance(d.get("rope_parameters"), dict):
            params = dict(d["rope_parameters"])
            rope_theta = params.pop("rope_theta", 10000.0)
            rope_scaling = None if params.get("rope_type", "default") == "default" else params
        num_heads = int(d["num_attention_heads"])
        return cls(
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_attention_heads=num_heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or num_heads),
            head_dim=int(d.get("head_dim") or d["hidden_size"] // num_heads),
            vocab_size=int(d["vocab_size"]),
            draft_vocab_size=int(d.get("draft_vocab_size") or d["vocab_size"]),
            target_hidden_size=int(d.get("target_hidden_size") or d["hidden_size"]),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            hidden_act=str(d.get("hidden_act", "silu")),
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=rope_scaling,
            aux_layers=list(
                (d.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or []
            ),
            initializer_range=float(d.get("initializer_range", 0.02)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
            pad_token_id=d.get("pad_token_id"),
        )


# ---------------------------------------------------------------------------------------------
# Building blocks


class RMSNorm(nn.Module):
    """Llama's RMSNorm, computed in fp32 (fp64 kept).

    `matmul_input`: the output is read only by matmuls (`nn.Linear`), so under autocast it is
    returned in autocast's dtype, the cast fused into the norm's kernel. Autocast would make
    that same cast before every matmul that reads it (three times for q/k/v, twice for the
    MLP; activations are not in its cast cache), and the fp32 output's gradient would come
    back through as many casts and fp32 adds: the same values, ~100 fewer kernels a TTT
    step on CUDA. Off for a norm whose output feeds anything else (a rotary embedding)."""

    def __init__(self, size: int, eps: float, *, matmul_input: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.variance_epsilon = eps
        self.matmul_input = matmul_input

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x` normalised by its RMS over the last dimension, scaled, in `x`'s dtype (fp32
        compute, fp64 kept for tests; one fused kernel on CUDA, `core.models.kernels`); in
        autocast's dtype under autocast when `matmul_input` (class docstring)."""
        return norm(x, self.weight, self.variance_epsilon, matmul_input=self.matmul_input)


def norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, matmul_input: bool) -> torch.Tensor:
    """`RMSNorm`'s function of its weight (`matmul_input`: its class docstring)."""
    device = x.device.type
    if matmul_input and torch.is_autocast_enabled(device):
        return rms_norm_to(x, weight, eps, torch.get_autocast_dtype(device))
    return rms_norm(x, weight, eps)


def stacked_logits(
    hiddens: list[torch.Tensor], norm_weight: torch.Tensor, eps: float, lm_head_weight: torch.Tensor
) -> torch.Tensor:
    """The draft's `head=` giving every TTT step's logits as one `[K, B, L, Vd]` tensor: the
    final norm and the lm_head once over the stacked pre-norm hidden states, so the lm_head's
    weight gradient is one product (K products summed by K - 1 adds of the weight's size
    before). Row k equals `compute_logits(hiddens[k])`."""
    return F.linear(norm(torch.stack(hiddens), norm_weight, eps, matmul_input=True), lm_head_weight)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies `[D/2]` fp32 for default, linear and llama3 rope."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return inv_freq
    factor = float(scaling.get("factor", 1.0))
    if kind == "linear":
        return inv_freq / factor
    if kind == "llama3":
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        orig = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        smooth = (
            (orig / wavelen - low) / (high - low) if low != high else torch.zeros_like(inv_freq)
        )
        scaled = torch.where(
            wavelen > orig / low,
            inv_freq / factor,
            (1 - smooth) * inv_freq / factor + smooth * inv_freq,
        )
        return torch.where(wavelen < orig / high, inv_freq, scaled)
    raise ConfigError(
        f"rope_scaling type {kind!r} is not supported by the EAGLE3 draft (default/linear/llama3)"
    )


def _on_device(inv_freq: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The fp32 frequencies on `device`, copied once (kept on the CPU tensor itself): a
    host-to-device copy per rotary call was a blocking copy per TTT step."""
    if inv_freq.device == device:
        return inv_freq
    copies = inv_freq.__dict__.setdefault("_specbus_on", {})
    if device not in copies:
        copies[device] = inv_freq.to(device, torch.float32)
    return copies[device]


def apply_rope(
    q_BNLD: torch.Tensor,
    k_BNLD: torch.Tensor,
    inv_freq: torch.Tensor,
    position_ids_BL: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(q, k)` rotated by the rotary embedding of `position_ids_BL` (`kernels.rope`: fp32
    frequencies, tables in q's dtype)."""
    return rope(q_BNLD, k_BNLD, _on_device(inv_freq, position_ids_BL.device), position_ids_BL)


def _repeat_kv(x_BNkvLD: torch.Tensor, n_rep: int) -> torch.Tensor:
    if n_rep == 1:
        return x_BNkvLD
    b, n, seq, d = x_BNkvLD.shape
    return x_BNkvLD[:, :, None].expand(b, n, n_rep, seq, d).reshape(b, n * n_rep, seq, d)


class Attention(nn.Module):
    """The draft's attention over [embedding; hidden] (2H wide), with a TTT cache when training and a
    causal cache when decoding."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        self.q_proj = nn.Linear(2 * cfg.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        # Not a buffer: module.to(bf16) must not round the frequencies (positions are exact).
        self.inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)

    def forward(
        self, x_BL2H: torch.Tensor, position_ids_BL: torch.Tensor, cache: TTTCache | DecodeCache
    ) -> torch.Tensor:
        """Attention output `[B, L, H]`; the step's keys/values are appended to `cache`."""
        b, seq, _ = x_BL2H.shape
        q = self.q_proj(x_BL2H).view(b, seq, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x_BL2H).view(b, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x_BL2H).view(b, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        rep = self.num_heads // self.num_kv_heads
        if isinstance(cache, TTTCache):
            q, k = apply_rope(q, k, self.inv_freq, position_ids_BL + cache.step)
            if cache.attention in ("flex", "flash"):  # grouped-query attention inside
                cache.keys.append(k)
                cache.values.append(v)
                out = _ttt_flash(q, cache) if cache.attention == "flash" else _ttt_flex(q, cache)
            else:
                cache.keys.append(_repeat_kv(k, rep))
                cache.values.append(_repeat_kv(v, rep))
                out = _ttt_eager(q, cache)
        else:
            q, k = apply_rope(q, k, self.inv_freq, position_ids_BL)
            past = cache.length
            cache.k = (
                _repeat_kv(k, rep)
                if cache.k is None
                else torch.cat([cache.k, _repeat_kv(k, rep)], dim=2)
            )
            cache.v = (
                _repeat_kv(v, rep)
                if cache.v is None
                else torch.cat([cache.v, _repeat_kv(v, rep)], dim=2)
            )
            # New queries sit at positions past..past+T-1: causal over everything cached.
            allowed = torch.ones(seq, past + seq, dtype=torch.bool, device=q.device).tril(
                diagonal=past
            )
            if cache.valid_BL is not None:  # a ragged batch: padding and dropped columns
                allowed = allowed[None, None] & cache.valid_BL[:, None, None, :]
            out = F.scaled_dot_product_attention(q, cache.k, cache.v, attn_mask=allowed)
        return self.o_proj(out.transpose(1, 2).reshape(b, seq, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """Llama's SwiGLU MLP."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        if cfg.hidden_act != "silu":
            raise ConfigError(f"draft hidden_act {cfg.hidden_act!r} is not supported (silu)")
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """down(silu(gate(x)) * up(x)) (a compiled kernel on CUDA, `core.models.kernels`)."""
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class DecoderLayer(nn.Module):
    """EAGLE3's decoder layer: the normed token embedding and hidden state concatenated into attention,
    then the MLP, each with a residual on the hidden state."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        # each feeds only matmuls (q/k/v, the MLP): under autocast, handed over in its dtype
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, matmul_input=True)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, matmul_input=True)
        self.post_attention_layernorm = RMSNorm(
            cfg.hidden_size, cfg.rms_norm_eps, matmul_input=True
        )

    def forward(self, emb_BLH, hidden_BLH, position_ids_BL, cache) -> torch.Tensor:
        """The layer's hidden state `[B, L, H]` for one TTT step (or one decode step)."""
        residual = hidden_BLH
        x = torch.cat((self.input_layernorm(emb_BLH), self.hidden_norm(hidden_BLH)), dim=-1)
        hidden_BLH = residual + self.self_attn(x, position_ids_BL, cache)
        return hidden_BLH + self.mlp(self.post_attention_layernorm(hidden_BLH))


# ---------------------------------------------------------------------------------------------
# The draft


class LlamaEagle3Draft(nn.Module):
    """One-layer EAGLE3 draft. `embed_tokens` is frozen; everything else trains."""

    #: state_dict keys written by the SGLang exporter (everything but embed_tokens)
    EXPORT_KEYS = (
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
    )

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = DecoderLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, matmul_input=True)  # lm_head's
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool))
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Linear and embedding weights N(0, initializer_range), norms 1."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                module.weight.normal_(0.0, self.config.initializer_range)
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)
        self.embed_tokens.weight.normal_(0.0, self.config.initializer_range)

    @torch.no_grad()
    def load_embedding(self, embed_VH: torch.Tensor) -> None:
        """Copy the target's embedding into the frozen `embed_tokens`; `ConfigError` for another shape."""
        if tuple(embed_VH.shape) != tuple(self.embed_tokens.weight.shape):
            raise ConfigError(
                f"target embedding {tuple(embed_VH.shape)} != draft embed_tokens {tuple(self.embed_tokens.weight.shape)}"
            )
        self.embed_tokens.weight.copy_(embed_VH)

    @torch.no_grad()
    def load_vocab_mapping(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Copy the run's `d2t`/`t2d` into the draft's buffers; `ConfigError` for another shape."""
        if d2t.shape != self.d2t.shape or t2d.shape != self.t2d.shape:
            raise ConfigError(
                f"vocab mapping d2t{tuple(d2t.shape)}/t2d{tuple(t2d.shape)} does not fit the draft "
                f"(d2t{tuple(self.d2t.shape)}/t2d{tuple(self.t2d.shape)})"
            )
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def embed(self, ids_BL: torch.Tensor) -> torch.Tensor:
        """The frozen target embedding of `ids_BL`."""
        return self.embed_tokens(ids_BL)

    def project(self, aux_BL3H: torch.Tensor) -> torch.Tensor:
        """The 3 aux hidden states `[B, L, 3H]` projected to `[B, L, H]`; `ConfigError` for another
        width."""
        if aux_BL3H.shape[-1] != self.fc.in_features:
            raise ConfigError(
                f"aux hidden states width {aux_BL3H.shape[-1]} != 3 * target hidden {self.fc.in_features}"
            )
        return self.fc(aux_BL3H)

    def backbone(
        self, emb_BLH, hidden_BLH, position_ids_BL, cache: TTTCache | DecodeCache
    ) -> torch.Tensor:
        """One pass of the decoder layer; returns the pre-norm hidden (fed to the next step)."""
        return self.midlayer(emb_BLH.to(hidden_BLH.dtype), hidden_BLH, position_ids_BL, cache)

    def compute_logits(self, hidden_BLH: torch.Tensor) -> torch.Tensor:
        """Draft-vocab logits `[B, L, Vd]`."""
        return self.lm_head(self.norm(hidden_BLH))

    def forward(
        self,
        input_ids_BL: torch.Tensor,
        hidden_states_BL3H: torch.Tensor,
        attention_mask_BL: torch.Tensor,
        ttt_length: int = 7,
        attention: str = "eager",
        *,
        block: int | None = None,
        checkpoint: bool = False,
        head: Callable[..., Any] | None = None,
    ) -> Any:
        """Unroll `ttt_length` TTT steps; returns each step's logits `[B, L, Vd]`.

        `input_ids_BL` are the ids the first step embeds (already shifted by one against the
        aux features); they shift left by one more after every step. One forward call covers
        all steps so DDP/FSDP wrappers see a single forward per backward.

        Long sequences: `block` attends that many queries at a time on the eager path (no
        L x L tensor); `checkpoint` recomputes each step in the backward (only its inputs,
        output and keys/values are kept); `head(hiddens, norm_weight, eps, lm_head_weight)`
        replaces the logits: it gets every step's pre-norm hidden state and returns what the
        forward returns (the chunked loss, `core/strategies/eagle3_long.py`, which never holds
        a step's `[B, L, Vd]` logits).
        """
        position_ids = torch.arange(input_ids_BL.shape[1], device=input_ids_BL.device)[None]
        aux = hidden_states_BL3H
        if not torch.is_autocast_enabled(aux.device.type):  # autocast casts it itself
            aux = aux.to(self.fc.weight.dtype)
        hidden = self.project(aux)
        cache = TTTCache(key_padding_BL=attention_mask_BL, attention=attention, block=block)
        if attention == "flex":  # every step's block mask, once per forward
            cache.block_masks = ttt_block_masks(attention_mask_BL, ttt_length)
        outputs = []
        # step k embeds the ids shifted left k times (id 0 entering at the end): views of one
        # embedding of the ids padded with K - 1 zeros (the embedding is frozen), not K lookups
        # and K - 1 shifts
        seq = input_ids_BL.shape[1]
        # (cast once to the hidden state's dtype, not in every step's `backbone`)
        embs = self.embed(F.pad(input_ids_BL, (0, ttt_length - 1))).to(hidden.dtype)
        for k in range(ttt_length):
            emb = embs[:, k : k + seq]
            if checkpoint and torch.is_grad_enabled():
                hidden, key, value = torch.utils.checkpoint.checkpoint(
                    self._step, emb, hidden, position_ids, cache, k, use_reentrant=False
                )
                cache.keys.append(key)
                cache.values.append(value)
            else:
                hidden = self.backbone(emb, hidden, position_ids, cache)
            outputs.append(hidden if head is not None else self.compute_logits(hidden))
        if head is not None:
            return head(outputs, self.norm.weight, self.norm.variance_epsilon, self.lm_head.weight)
        return outputs

    def _step(self, emb_BLH, hidden_BLH, position_ids_BL, cache: TTTCache, step: int):
        """TTT step `step` on a cache of the earlier steps only (nothing is mutated, so its
        recomputation in the backward is the same function): (hidden, its keys, its values)."""
        view = cache.upto(step)
        hidden = self.backbone(emb_BLH, hidden_BLH, position_ids_BL, view)
        if cache.mask_B1LL is None:
            cache.mask_B1LL = view.mask_B1LL  # the dense step-0 mask, built once per forward
        return hidden, view.keys[-1], view.values[-1]


def shift_left(x: torch.Tensor) -> torch.Tensor:
    """`x[:, 1:]` followed by one zero position (dim 1)."""
    return torch.cat((x[:, 1:], torch.zeros_like(x[:, -1:])), dim=1)
