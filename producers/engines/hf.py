"""The `hf` target engine: a transformers causal LM on CPU or GPU, forward hooks on the aux layers.

Sequences are captured `capture_batch` at a time, right-padded (causal attention: the real
positions never see the padding, and the padding is sliced off before a sample is built); one
longer than `SOLO_TOKENS` is captured alone (`batches`: no `[B, 1, L, L]` padding mask).
The aux features are the outputs of the contract's decoder layers (0-based), concatenated in
contract order; the final feature is the base model's post-norm last hidden state (the
lm_head is not run: the trainer recomputes logits from it).

dtype "auto": bf16 on GPU, fp32 on CPU. Raises `CaptureError` for an empty or over-long
sequence, a mask of another length, or features that fail the contract.

`target.tp_size > 1`: the engine takes the TP mesh of its island (`tp_mesh=`, every rank of
it builds the engine) and shards the decoder over it (`producers/engines/tp.py`); every TP
rank must then capture the same sequences in the same order (the forward runs collectives),
and every rank gets the full features.

The prefill's SDPA backends: on a GPU flash first (then memory-efficient, cuDNN, math), not
torch's own order. torch 2.11 prefers cuDNN attention on sm90, and cuDNN builds an execution
plan per new sequence length: on an H200 a Qwen3-8B-shaped prefill of a length not seen before
took ~55 ms per 1k tokens against ~35 for a length seen before or under flash
(`ops/bench/mixed_lengths.py`, docs/benchmarks.md "Mixed lengths"); real traffic and the
seed's uniform 512-4096 setup are nearly all new lengths. A long prefill (from
`kernels.CUDNN_ATTENTION_TOKENS`, 16k) runs cuDNN first: its attention is most of the prefill
there, cuDNN's kernel runs it ~1.7x flash's, and a plan per length is small against seconds
(`ops/bench/attention_kernels.py`). `SPECBUS_SDPA_BACKENDS` (e.g.
`cudnn,flash,math`; `default` = torch's order) overrides it; the CPU keeps torch's order.

`target.compile`: capture runs each decoder layer `torch.compile`d (`CompiledLayers`); the
features equal the eager ones up to the fused kernels' rounding. Measure it before relying on
it: `python -m specbus.ops.bench.capture` times both in one process.

`target.quantize: fp8`: the decoder's linear layers run in FP8 (`core/models/fp8.py`: per-
channel weight and per-token activation scales, as FP8 serving runs them); the features are
the FP8 target's. Applied at load, so the live server's decoding uses the same layers.

`target.cuda_graphs`: the prefill replays a CUDA graph per (batch, length rounded up to
`target.graph_bucket`), run without a mask (right padding under causal attention changes no
real position); see `producers/engines/prefill_graphs.py`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time

import torch
from specbus.core.config import TargetConfig
from specbus.core.errors import CaptureError, ConfigError
from specbus.core.models.kernels import causal_kernel
from specbus.core.models.target import (
    AuxCapture,
    decoder_layers,
    load_causal_lm,
    load_target_info,
    load_tokenizer,
    resolve_target_dir,
    target_fingerprint,
    tokenizer_fingerprint,
)
from specbus.core.strategies.base import FeatureContract

log = logging.getLogger("specbus.capture")
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
SDPA_ENV = "SPECBUS_SDPA_BACKENDS"
_SDPA_NAMES = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
               "cudnn": "CUDNN_ATTENTION", "math": "MATH"}  # fmt: skip


GPU_SDPA_ORDER = "flash,efficient,cudnn,math"
LONG_SDPA_ORDER = "cudnn,flash,efficient,math"


def sdpa_order(device: torch.device | None = None, seq_len: int = 0) -> str:
    """The SDPA backend order of a prefill of `seq_len` positions on `device`:
    `$SPECBUS_SDPA_BACKENDS` if set, else on CUDA `LONG_SDPA_ORDER` from
    `kernels.CUDNN_ATTENTION_TOKENS` (cuDNN's kernel runs the attention, most of a long
    prefill, ~1.7x flash's, and its plan per new shape is paid back) and `GPU_SDPA_ORDER`
    below it (where it is not), else "" (torch's own order)."""
    if device is None or torch.device(device).type != "cuda":
        return os.environ.get(SDPA_ENV, "")
    long = causal_kernel(device, seq_len) == "cudnn"
    return os.environ.get(SDPA_ENV, LONG_SDPA_ORDER if long else GPU_SDPA_ORDER)


def sdpa_backends(spec: str | None = None, device: torch.device | None = None, seq_len: int = 0):
    """The SDPA context of a prefill or a decoding loop: `sdpa_kernel` over the backends of
    `spec` (default: `sdpa_order(device, seq_len)`) in that priority order, or a null
    context (torch's own order) for "" / `default`. `ConfigError` names the valid ones."""
    if spec is None:
        spec = sdpa_order(device, seq_len)
    names = [n.strip() for n in spec.split(",") if n.strip()]
    if not names or names == ["default"]:
        return contextlib.nullcontext()
    bad = [n for n in names if n not in _SDPA_NAMES]
    if bad:
        raise ConfigError(f"{SDPA_ENV}: unknown SDPA backend(s) {bad}; valid: {list(_SDPA_NAMES)}")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, _SDPA_NAMES[n]) for n in names], set_priority=True)


def resolve_device(device: str) -> torch.device:
    """`target.device` as a torch device: auto is the first GPU, else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """`target.dtype` as a torch dtype: auto is bf16 on GPU, fp32 on CPU."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[dtype]


def _maybe_tokenizer(path):
    """The directory's tokenizer, or None for a weights-only directory (tiny test targets)."""
    if not any(
        (path / name).is_file()
        for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    ):
        return None
    return load_tokenizer(path)


SOLO_TOKENS = 8192


def batches(lengths: list[int], size: int) -> list[tuple[int, int]]:
    """(start, stop) of each forward's sequences, in order: up to `size` at a time, but a
    sequence longer than `SOLO_TOKENS` alone. A padded batch needs a `[B, 1, L, L]` mask (and
    attention kernels that take one): 8 GiB at 64k tokens; a sequence alone needs none (the
    causal kernel), and fills the GPU by itself."""
    spans, start = [], 0
    for i, n in enumerate(lengths):
        if n > SOLO_TOKENS:
            if start < i:
                spans.append((start, i))
            spans.append((i, i + 1))
            start = i + 1
        elif i + 1 - start == size:
            spans.append((start, i + 1))
            start = i + 1
    if start < len(lengths):
        spans.append((start, len(lengths)))
    return spans


class CompiledLayers:
    """Context manager: the target's decoder layers run `torch.compile`d forwards inside it.

    Each layer's `forward` is compiled once (in `__init__`) and bound as an instance attribute
    only while the context is open, so capture runs compiled while anything else using the
    model (the live server's cached decode) keeps the eager forward. Only `forward` is
    compiled, not the module call: the hooks `AuxCapture` registers per capture stay outside
    the compiled code (new hooks would otherwise recompile every capture). The layers share
    one code object, so one graph (static, then dynamic in the length after a second length
    is seen) serves every layer. Not re-entrant; one thread at a time, as capture is."""

    def __init__(self, model) -> None:
        from specbus.core.models.kernels import raise_recompile_limit

        raise_recompile_limit()  # size-range guards recompile now and then (kernels.py's doc)
        self.layers = list(decoder_layers(model))
        self.forwards = [torch.compile(layer.forward) for layer in self.layers]

    def __enter__(self) -> CompiledLayers:
        for layer, forward in zip(self.layers, self.forwards, strict=True):
            layer.forward = forward
        return self

    def __exit__(self, *exc) -> None:
        for layer in self.layers:
            layer.__dict__.pop("forward", None)  # the class's eager forward again


class HFEngine:
    """A frozen HF target capturing EAGLE3/DFlash-style features."""

    name = "hf"

    def __init__(
        self,
        cfg: TargetConfig,
        *,
        cache_dir: str | None = None,
        model=None,
        tokenizer=None,
        tp_mesh=None,
    ):
        self.cfg = cfg
        self.path = resolve_target_dir(
            cfg.model, cache_dir if cache_dir is not None else cfg.cache_dir
        )
        self.device = resolve_device(cfg.device)
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        self.info = load_target_info(self.path, name=cfg.model)
        self.tokenizer = tokenizer if tokenizer is not None else _maybe_tokenizer(self.path)
        self.model = (
            model if model is not None else load_causal_lm(self.path, self.dtype, self.device)
        )
        if cfg.tp_size > 1:
            if tp_mesh is None or tp_mesh.size() != cfg.tp_size:
                raise ConfigError(
                    f"target.tp_size={cfg.tp_size} needs the island's TP mesh of that size "
                    f"(got {None if tp_mesh is None else tp_mesh.size()})"
                )
            from specbus.producers.engines.tp import shard_decoder

            shard_decoder(self.model, tp_mesh)
        if cfg.quantize == "fp8":  # in place, a lent model too (idempotent)
            from specbus.core.models.fp8 import quantize_linears_fp8

            swapped = quantize_linears_fp8(decoder_layers(self.model))
            log.info("target.quantize fp8: %d decoder linear layers in e4m3", swapped)
        # entered around every capture (a nullcontext is reusable)
        self._compiled = CompiledLayers(self.model) if cfg.compile else contextlib.nullcontext()
        self.target_fingerprint = target_fingerprint(self.path, cfg.quantize)
        self.tokenizer_fingerprint = (
            tokenizer_fingerprint(self.tokenizer) if self.tokenizer is not None else "none"
        )
        self.context_length = cfg.context_length or self.info.max_position_embeddings
        pad = self.info.pad_token_id
        self.pad_id = int(pad) if pad is not None and 0 <= int(pad) < self.info.vocab_size else 0
        self._graphs = None
        self._maskless: contextlib.AbstractContextManager = contextlib.nullcontext()
        if cfg.cuda_graphs:
            from specbus.producers.engines.prefill_graphs import MasklessLayers, PrefillGraphs

            self._maskless = MasklessLayers(self.model)

            self._graphs = PrefillGraphs(self._forward, self.device, pad_id=self.pad_id,
                                         bucket=cfg.graph_bucket,
                                         max_tokens=cfg.graph_max_tokens,
                                         max_length=self.context_length)  # fmt: skip
            if not self._graphs.use_graphs:
                log.warning("target.cuda_graphs: %s is not a CUDA device; the prefill runs "
                            "bucketed without graphs", self.device)  # fmt: skip
        self.last_capture_s = 0.0

    @property
    def default_aux_layers(self) -> list[int]:
        """The EAGLE3 default capture layers for this target's depth."""
        return self.info.default_aux_layers

    @torch.no_grad()
    def capture(
        self,
        input_ids: list[torch.Tensor],
        loss_masks: list[torch.Tensor] | None,
        contract: FeatureContract,
        *,
        device: torch.device | str | None = None,
    ) -> list[dict[str, torch.Tensor]]:
        """Features for each sequence (see module docstring); `loss_masks` None means all ones."""
        if contract.hidden_size != self.info.hidden_size:
            raise ConfigError(
                f"contract hidden size {contract.hidden_size} != target hidden size {self.info.hidden_size}"
            )
        if loss_masks is not None and len(loss_masks) != len(input_ids):
            raise CaptureError(f"{len(input_ids)} sequences but {len(loss_masks)} loss masks")
        started = time.perf_counter()
        out_device = torch.device(device) if device is not None else torch.device("cpu")
        samples: list[dict[str, torch.Tensor]] = []
        for start, stop in batches([len(ids) for ids in input_ids], self.cfg.capture_batch):
            chunk = [
                torch.as_tensor(ids, dtype=torch.long).flatten() for ids in input_ids[start:stop]
            ]
            masks = None if loss_masks is None else loss_masks[start:stop]
            samples.extend(self._capture_chunk(chunk, masks, contract, out_device))
        self.last_capture_s = time.perf_counter() - started
        return samples

    def _capture_chunk(
        self, chunk, masks, contract: FeatureContract, out_device
    ) -> list[dict[str, torch.Tensor]]:
        lengths = [int(ids.numel()) for ids in chunk]
        for i, n in enumerate(lengths):
            if n == 0 or n > self.context_length:
                raise CaptureError(
                    f"sequence {i} has {n} tokens (allowed 1..{self.context_length})"
                )
            if masks is not None and int(torch.as_tensor(masks[i]).numel()) != n:
                raise CaptureError(
                    f"sequence {i}: loss mask has {torch.as_tensor(masks[i]).numel()} entries, ids {n}"
                )
            if int(chunk[i].max()) >= self.info.vocab_size or int(chunk[i].min()) < 0:
                raise CaptureError(
                    f"sequence {i} has token ids outside the vocabulary of {self.info.vocab_size}"
                )
        seq = max(lengths)
        ids_BL = torch.full((len(chunk), seq), self.pad_id, dtype=torch.long)
        for i, ids in enumerate(chunk):
            ids_BL[i, : lengths[i]] = ids
        if self._graphs is not None:  # right padding, no mask: see prefill_graphs
            aux_BLA, final_BLH = self._graphs(ids_BL, contract.aux_layers)
        else:
            attn_BL = (torch.arange(seq) < torch.tensor(lengths)[:, None]).long()
            aux_BLA, final_BLH = self._forward(
                ids_BL.to(self.device), contract.aux_layers, attn_BL.to(self.device)
            )
        expected_aux = len(contract.aux_layers) * self.info.hidden_size
        if aux_BLA.shape != (len(chunk), seq, expected_aux) or final_BLH.shape != (
            len(chunk),
            seq,
            self.info.hidden_size,
        ):
            raise CaptureError(
                f"captured aux {tuple(aux_BLA.shape)} / final {tuple(final_BLH.shape)}, expected "
                f"{(len(chunk), seq, expected_aux)} / {(len(chunk), seq, self.info.hidden_size)}"
            )
        samples = []
        for i, n in enumerate(lengths):
            mask = (
                torch.ones(n, dtype=torch.long)
                if masks is None
                else torch.as_tensor(masks[i]).flatten().clone()
            )
            sample = {"input_ids": chunk[i].clone(), "loss_mask": mask}
            sample[contract.aux_feature] = aux_BLA[i, :n].to(self.dtype)
            if contract.final_feature is not None:
                sample[contract.final_feature] = final_BLH[i, :n].to(self.dtype)
            sample = {k: v.to(out_device).contiguous() for k, v in sample.items()}
            contract.verify(sample)
            samples.append(sample)
        return samples

    def _forward(
        self, ids_BL: torch.Tensor, aux_layers, attn_BL: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(aux `[B, L, A]`, final `[B, L, H]`) of one prefill of device ids (no mask: causal,
        and then the layers of full attention get none, `MasklessLayers`)."""
        with (
            AuxCapture(self.model, aux_layers) as aux,
            sdpa_backends(device=self.device, seq_len=ids_BL.shape[1]),
            self._maskless if attn_BL is None else contextlib.nullcontext(),
            self._compiled,
        ):
            base = getattr(self.model, "model", self.model)
            outputs = base(input_ids=ids_BL, attention_mask=attn_BL, use_cache=False)
            return aux.concat(), outputs.last_hidden_state

    def close(self) -> None:
        """Drop the model (and its GPU memory); idempotent."""
        self.model = self._graphs = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
