"""Model FLOPs per sample of the GPU benches, the GPUs' peak rates, and MFU.

MFU (model-FLOPs utilisation) = the FLOPs a sample needs x samples/s / the GPU's peak dense
bf16 rate: the figure that compares across GPUs and tells how far a bench is from the chip.

**Convention: "model FLOPs"**, as in PaLM (Chowdhery et al. 2022, appendix B) and Megatron-LM
(Narayanan et al. 2021, section 5.1):
- only matrix products count, 2*m*k*n for `[m, k] @ [k, n]`; norms, activations, softmax,
  rotary embeddings, masks and the optimizer are left out;
- attention counts its two products (scores, weighted values) over every query-key pair as
  if unmasked: 4 * queries * keys * heads * head_dim per layer, **not halved for a causal
  mask** (PaLM's 12 * layers * heads * head_dim * T per token of training is three times
  this); the DFlash family's block mask is counted the same way (every block query against
  the whole context and its own block);
- a backward pass costs 2x its forward for a product whose weight trains and whose input
  needs a gradient (PaLM's 6N per token = 2N forward + 4N backward), 1x when only one of the
  two does (a frozen head such as the target lm_head the DFlash family drafts through: the
  input's gradient only; the first projection of captured features: the weight's only), 0
  when neither (the target's prefill, a teacher's logits);
- recomputation (activation checkpointing, flash attention's backward) is not counted: these
  are the FLOPs the model needs, not the FLOPs an implementation spends.

Models: a dense decoder-only target from its Hugging Face config (`config.json` keys; the
prefill runs every layer and no lm_head, as the `hf` engine captures); the EAGLE3 draft's
TTT step (`core/models/llama_eagle3.py`, `core/strategies/eagle3.py`); the DFlash and DSpark
drafts' step (`core/models/dflash.py`, `core/strategies/dflash_loss.py`). The draft's widths
follow the same rules as `core.models.registry.eagle3_config` and
`DFlashFamilyStrategy.model_config` (the target's unless `strategy.draft` sets them).

Worked figures, Qwen3-8B-shaped target (ops/bench/random_target.py), 2048 tokens: prefill
30.9 TFLOP (28.5 in the 6.95 B layer weights, 2.5 in attention); EAGLE3 step (7 TTT steps,
32k draft vocabulary) 34.4 TFLOP, of which the teacher's logits 2.55; DFlash step (512 blocks
of 16) 31.0, DSpark 34.5 (mean over lengths uniform in 512-4096 with the prefill: 70.5).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# Peak dense bf16 tensor-core rates per GPU, from NVIDIA's datasheets (H100 / H200 / A100
# product pages), which quote the sparse rate: dense is half of it (H100 SXM and H200:
# 1,979 TFLOP/s "with sparsity" -> 989.5; H100 and H200 NVL: 1,671 -> 835.5; H100 PCIe:
# 1,513 -> 756.5; A100: 312 dense). Matched as substrings of `torch.cuda.get_device_name()`,
# the first match wins (most specific first). The H200's measured ceiling on these benches'
# shapes is lower (~750-790 TFLOP/s, docs/benchmarks.md): MFU is against the datasheet.
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H200 NVL", 835.5),
    ("H100 NVL", 835.5),
    ("H100 PCIe", 756.5),
    ("H200", 989.5),
    ("H100", 989.5),
    ("A100", 312.0),
)
PEAK_SOURCE = "NVIDIA datasheet, dense bf16 (half the quoted sparse rate)"
PEAK_ENV = "SPECBUS_PEAK_TFLOPS"  # overrides the table (TFLOP/s), e.g. for another GPU
CONVENTION = (
    "model FLOPs (PaLM appendix B / Megatron-LM): matmuls only, attention unmasked "
    "(not causal-halved), backward 2x forward for trained weights, no recomputation"
)


@dataclass(frozen=True)
class Shape:
    """The widths a FLOP count needs, of a target or of a draft layer."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @property
    def attn_width(self) -> int:
        """Query width: heads x head_dim (not necessarily the hidden size)."""
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        """Key (or value) width: kv heads x head_dim."""
        return self.kv_heads * self.head_dim


def target_shape(config: Mapping[str, Any]) -> Shape:
    """The shape of a dense decoder-only target from its HF config (`config.json` keys, or a
    multimodal config's `text_config`); `ValueError` for a mixture of experts, whose FLOPs per
    token depend on its routing and are not modelled here."""
    config = config.get("text_config") or config
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if config.get(key):
            raise ValueError(f"{key}={config[key]}: only dense targets have a FLOP model")
    heads = int(config["num_attention_heads"])
    return Shape(
        hidden=int(config["hidden_size"]),
        intermediate=int(config["intermediate_size"]),
        layers=int(config["num_hidden_layers"]),
        heads=heads,
        kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or config["hidden_size"] // heads),
        vocab=int(config["vocab_size"]),
    )


def matmul(rows: float, k: int, n: int) -> float:
    """Forward FLOPs of `[rows, k] @ [k, n]`."""
    return 2.0 * rows * k * n


def attention(queries: float, keys: float, heads: int, head_dim: int) -> float:
    """Forward FLOPs of one attention layer's two products over `queries x keys` pairs."""
    return 4.0 * queries * keys * heads * head_dim


@dataclass(frozen=True)
class StepFlops:
    """A train step's model FLOPs: `forward` (teachers included), `backward`."""

    forward: float
    backward: float

    @property
    def total(self) -> float:
        """Forward + backward."""
        return self.forward + self.backward


class _Tally:
    """Forward and backward FLOPs added product by product (the module docstring's rules)."""

    def __init__(self) -> None:
        self.forward = 0.0
        self.backward = 0.0

    def add(self, fwd: float, *, weight_trains: bool = True, input_grad: bool = True) -> None:
        self.forward += fwd
        self.backward += fwd * (int(weight_trains) + int(input_grad))

    def result(self) -> StepFlops:
        return StepFlops(self.forward, self.backward)


def prefill_flops(config: Mapping[str, Any], seq: int, *, lm_head: bool = False) -> float:
    """Forward FLOPs of one `seq`-token prefill: every decoder layer's projections and MLP,
    their attention over all `seq` keys (not halved, module docstring), and the lm_head only
    with `lm_head` (the `hf` engine's capture does not run it)."""
    t = target_shape(config)
    per_layer = (
        matmul(seq, t.hidden, t.attn_width)  # q
        + 2 * matmul(seq, t.hidden, t.kv_width)  # k, v
        + matmul(seq, t.attn_width, t.hidden)  # o
        + 3 * matmul(seq, t.hidden, t.intermediate)  # gate, up, down
        + attention(seq, seq, t.heads, t.head_dim)
    )
    return t.layers * per_layer + (matmul(seq, t.hidden, t.vocab) if lm_head else 0.0)


def _draft_shape(draft: Any, t: Shape) -> Shape:
    """A draft layer's widths: the target's unless `draft` (a `DraftConfig`) sets them; the
    head dim is the target's unless the hidden size or head count is overridden (as
    `core.models.registry.eagle3_config` and `DFlashFamilyStrategy.model_config`)."""
    hidden = draft.hidden_size or t.hidden
    heads = draft.num_attention_heads or t.heads
    overridden = draft.hidden_size is not None or draft.num_attention_heads is not None
    return Shape(
        hidden=hidden,
        intermediate=draft.intermediate_size or t.intermediate,
        layers=draft.num_layers,
        heads=heads,
        kv_heads=draft.num_key_value_heads or t.kv_heads,
        head_dim=hidden // heads if overridden else t.head_dim,
        vocab=t.vocab,
    )


def eagle3_step_flops(strategy: Any, config: Mapping[str, Any], seq: int) -> StepFlops:
    """One EAGLE3 train step on a `seq`-token sample (`strategy`: a `StrategyConfig`):
    - the teacher, forward only: the target lm_head over all `seq` positions, full vocabulary;
    - `fc` (3 aux layers -> hidden): forward + its weight's gradient (the features need none);
    - `ttt_length` TTT steps, each forward + backward (3x): q/k/v over the 2H-wide
      [embedding; hidden] input, o, the SwiGLU MLP, the draft-vocabulary lm_head, and the
      attention of step k over `seq` + k keys (the unmasked prefix plus one key of each
      earlier step)."""
    t = target_shape(config)
    d = _draft_shape(strategy.draft, t)
    vd = min(strategy.draft.draft_vocab_size, t.vocab)
    tally = _Tally()
    tally.add(matmul(seq, t.hidden, t.vocab), weight_trains=False, input_grad=False)
    tally.add(matmul(seq, 3 * t.hidden, d.hidden), input_grad=False)
    for k in range(strategy.ttt_length):
        tally.add(matmul(seq, 2 * d.hidden, d.attn_width))
        tally.add(2 * matmul(seq, 2 * d.hidden, d.kv_width))
        tally.add(matmul(seq, d.attn_width, d.hidden))
        tally.add(3 * matmul(seq, d.hidden, d.intermediate))
        tally.add(matmul(seq, d.hidden, vd))
        tally.add(attention(seq, seq + k, d.heads, d.head_dim))
    return tally.result()


def dflash_blocks(strategy: Any, seq: int, supervised: int) -> int:
    """Blocks (anchors) per sample: `num_anchors`, or fewer when the sample has fewer anchor
    positions (a supervised position followed by another: `supervised` - 1 for one
    contiguous supervised span, the benches' layout), at least 1
    (`core.strategies.dflash_blocks.sample_anchors`)."""
    return max(1, min(strategy.num_anchors, supervised - 1, seq - 1))


def dflash_step_flops(
    strategy: Any, config: Mapping[str, Any], seq: int, supervised: int | None = None
) -> StepFlops:
    """One DFlash or DSpark train step on a `seq`-token sample with `supervised` loss-mask
    positions in one span (default: the last three quarters, as every bench writes):
    Q = blocks x block_size draft queries (`dflash_blocks`), and
    - `fc` (the aux layers -> hidden) over the `seq` context positions: forward + weight grad;
    - per draft layer: the context's k/v projections over `seq` rows, the queries' q/k/v/o
      and MLP over Q rows (3x), attention of Q queries over `seq` + block_size keys (3x);
    - the target's frozen lm_head over the Q rows: forward + the input's gradient (2x);
    - DSpark: the Markov head's `[V, rank]` product over Q rows (3x; gated / rnn add their
      projection), the confidence head (3x), and the teacher's logits, forward only, over
      min(seq, Q) rows (once per position covered by a block)."""
    name = strategy.name
    if name not in ("dflash", "dspark"):
        raise ValueError(f"no FLOP model for strategy {name!r} (dflash, dspark here; eagle3)")
    t = target_shape(config)
    d = _draft_shape(strategy.draft, t)
    supervised = seq - seq // 4 if supervised is None else supervised
    q = dflash_blocks(strategy, seq, supervised) * strategy.block_size
    tally = _Tally()
    # one aux layer per draft layer (`default_target_layers`)
    tally.add(matmul(seq, d.layers * t.hidden, d.hidden), input_grad=False)
    for _ in range(d.layers):
        tally.add(2 * matmul(seq, d.hidden, d.kv_width))
        tally.add(matmul(q, d.hidden, d.attn_width))
        tally.add(2 * matmul(q, d.hidden, d.kv_width))
        tally.add(matmul(q, d.attn_width, d.hidden))
        tally.add(3 * matmul(q, d.hidden, d.intermediate))
        tally.add(attention(q, seq + strategy.block_size, d.heads, d.head_dim))
    tally.add(matmul(q, d.hidden, t.vocab), weight_trains=False)
    if name == "dspark":
        ds = strategy.dspark
        rank = ds.markov_rank
        if rank > 0:
            tally.add(matmul(q, rank, t.vocab))
            if ds.markov_head_type == "gated":
                tally.add(matmul(q, d.hidden + rank, rank))
            elif ds.markov_head_type == "rnn":
                tally.add(matmul(q, 2 * rank + d.hidden, 3 * rank))
        if ds.confidence_head:
            tally.add(matmul(q, d.hidden + (rank if ds.confidence_with_markov else 0), 1))
        if ds.l1_alpha > 0 or (ds.confidence_alpha > 0 and ds.confidence_head):
            tally.add(matmul(min(seq, q), t.hidden, t.vocab), weight_trains=False, input_grad=False)
    return tally.result()


def train_step_flops(
    strategy: Any, config: Mapping[str, Any], seq: int, supervised: int | None = None
) -> StepFlops:
    """One train step of `strategy` (a `StrategyConfig`: eagle3, dflash or dspark) on one
    `seq`-token sample of the target `config`."""
    if strategy.name == "eagle3":
        return eagle3_step_flops(strategy, config, seq)
    return dflash_step_flops(strategy, config, seq, supervised)


def sample_flops(strategy: Any, config: Mapping[str, Any], seq: int) -> dict[str, float]:
    """`{"prefill", "train_step", "total"}` FLOPs of one `seq`-token sample through the
    pipeline (the capture's prefill, then one train step), the last three quarters
    supervised."""
    prefill = prefill_flops(config, seq)
    step = train_step_flops(strategy, config, seq).total
    return {"prefill": prefill, "train_step": step, "total": prefill + step}


def mean_sample_flops(strategy: Any, config: Mapping[str, Any], lo: int, hi: int) -> dict:
    """`sample_flops` averaged over lengths uniform in [lo, hi] (every integer length: the
    counts are quadratic in the length, so the mean length's count is not the mean count)."""
    rows = [sample_flops(strategy, config, n) for n in range(lo, hi + 1)]
    return {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]}


def peak_flops(device_name: str) -> tuple[float, str] | None:
    """(peak dense bf16 FLOP/s, its source) of `device_name` (`torch.cuda.get_device_name()`):
    `$SPECBUS_PEAK_TFLOPS` when set, else `PEAK_BF16_TFLOPS`; None for a device not in it
    (the CPU, an unknown GPU)."""
    override = os.environ.get(PEAK_ENV)
    if override:
        return float(override) * 1e12, f"${PEAK_ENV}"
    for key, tflops in PEAK_BF16_TFLOPS:
        if key.lower() in device_name.lower():
            return tflops * 1e12, f"{PEAK_SOURCE}: {key} {tflops:g} TFLOP/s"
    return None


def mfu(
    flops_per_sample: float | None, samples_per_s: float | None, peak: float | None
) -> float | None:
    """FLOPs achieved per second over the peak; None without a count, a rate or a peak."""
    if not peak or samples_per_s is None or flops_per_sample is None:
        return None
    return flops_per_sample * samples_per_s / peak


def fmt_mfu(value: float | None) -> str:
    """An MFU as a percentage for the benches' tables; "-" without one (no peak known)."""
    return "-" if value is None else f"{value:.0%}"


def fmt_flops(value: float) -> str:
    """A FLOP count with its SI prefix: `30.92 TFLOP`, `539.5 MFLOP` (the tiny CPU targets)."""
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M")):
        if value >= scale:
            return f"{value / scale:.4g} {prefix}FLOP"
    return f"{value:.4g} FLOP"


def describe(per_sample: dict[str, float]) -> str:
    """`prefill X + train step Y = Z` (the parts a bench wrote)."""
    names = {"prefill": "prefill", "train_step": "train step", "total": "total"}
    parts = [f"{names[k]} {fmt_flops(v)}" for k, v in per_sample.items() if k in names]
    return ", ".join(parts)


def flops_section(device_name: str) -> dict:
    """The header a bench's JSON report carries once: the convention, the peak and its
    source; the bench fills `per_sample` (its FLOPs per sample, per row key)."""
    peak = peak_flops(device_name)
    return {
        "convention": CONVENTION,
        "peak_flops": peak[0] if peak else None,
        "peak_source": peak[1] if peak else f"no peak known for {device_name!r} (${PEAK_ENV})",
        "per_sample": {},
    }
