"""The capture's prefill as CUDA graphs, one per (batch, padded length): `target.cuda_graphs`.

Why: a colocated rank captures in a thread beside the training step, and both launch their
kernels from Python under one GIL. On an H200 the colocated EAGLE3 sample at 2048 tokens took
about the sum of the step's kernels and the prefill's (129.8 ms against 79 + ~50), while the
same two halves in two processes overlapped (106.7 ms; docs/benchmarks.md, "EAGLE3's flash
TTT attention"). A replayed graph is one launch: the capture thread then needs the GIL for
microseconds a prefill, and its kernels run on its stream beside the step's.

Contract:
- A batch `[B, n]` (right-padded by the caller, `n` its longest sequence) is padded again to
  `L = bucket_length(n)` (the next multiple of `bucket` tokens, not past the target's context
  length) and run *without* an attention mask. Causal attention: a real position never
  attends to a later one, so right padding leaves every real position's features unchanged
  (the caller slices `[:, :n]` and each sample to its own length); the pad positions'
  features are computed and dropped.
- One graph per `(B, L, aux layers)`, captured the first time that key is seen (a warm-up
  forward first: it compiles `target.compile`'s layers and sizes cuBLAS' workspace), replayed
  after. Every graph draws on one memory pool: replays run one at a time (capture is one
  thread's) and each replay's outputs are cloned before the next, so one graph's scratch
  overwriting another's outputs is harmless.
- Returned tensors are fresh (cloned on the current stream after the replay), `[B, n, ...]`.
- Not a graph (the same padded maskless forward, run eagerly): a key past `max_graphs`, a
  batch over `max_tokens` tokens (long context: launches are a rounding error there, and a
  graph would pin its activations), a device that is not CUDA (the CPU tests of this path),
  and every batch after a capture that failed (logged once with the cause; nothing lost).
- The layers of full causal attention get no mask (`MasklessLayers`): transformers up to
  at least 5.17 counts a capturing stream as tracing and then builds the `[B, 1, L, L]` causal
  mask it skips otherwise, so the layers would see a mask in the capture and none in the
  warm-up (a masked attention kernel in the graph; with `target.compile`, a recompile inside
  the capture, which invalidated it on an H200 on 2026-12-03).
- A capture never compiles: it runs under `torch.compiler.set_stance("eager_on_recompile")`
  (process-wide while it lasts: a recompile elsewhere in that window runs eagerly once).
  Compiling inside a capture invalidates it, and a capture that fails inside
  `cudaStreamEndCapture` leaves torch's CUDA generator marked as capturing (any later CUDA
  random draw in the process raises "Offset increment outside graph capture"); the fallback
  above covers failures raised before that point.
- During a capture the device's default CUDA generator is registered with the graph: another
  thread drawing from it then fails. specbus' training steps draw from CPU generators only.
- Not thread-safe: one capturing thread at a time, as `HFEngine.capture` is.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

log = logging.getLogger("specbus.capture")

# (ids [B, L] on the device, aux layers) -> (aux [B, L, A], final [B, L, H]); no attention mask
Forward = Callable[[torch.Tensor, tuple[int, ...]], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    ids_BL: torch.Tensor  # the static input
    aux_BLA: torch.Tensor  # the static outputs
    final_BLH: torch.Tensor


class PrefillGraphs:
    """See the module doc. `forward` runs the model (hooks, SDPA backends and compiled
    layers included) on device ids without a mask; `pad_id` fills the padding."""

    def __init__(
        self,
        forward: Forward,
        device: torch.device,
        *,
        pad_id: int,
        bucket: int = 256,
        max_tokens: int = 16384,
        max_graphs: int = 32,
        max_length: int | None = None,
    ):
        if bucket < 1 or max_tokens < 1 or max_graphs < 0:
            raise ValueError(f"bucket {bucket}, max_tokens {max_tokens}, max_graphs {max_graphs}")
        self.forward, self.device, self.pad_id = forward, torch.device(device), int(pad_id)
        self.bucket, self.max_tokens, self.max_graphs = bucket, max_tokens, max_graphs
        self.max_length = max_length  # the target's context: padding never goes past it
        self.graphs: dict[tuple[int, int, tuple[int, ...]], _Graph] = {}
        self.use_graphs = self.device.type == "cuda"
        self.failed: str | None = None  # why graphs were turned off, if they were
        self._pool = None
        self.replays = self.captures = self.eager = 0  # counts, for tests and benches

    def bucket_length(self, n: int) -> int:
        """`n` rounded up to a multiple of the bucket, but not past `max_length` (then `n`)."""
        rounded = -(-n // self.bucket) * self.bucket
        return n if self.max_length is not None and rounded > self.max_length else rounded

    def __call__(
        self, ids_BL: torch.Tensor, aux_layers: tuple[int, ...] | list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(aux `[B, n, A]`, final `[B, n, H]`) of the right-padded `ids_BL` `[B, n]` (any device)."""
        B, n = ids_BL.shape
        L = self.bucket_length(n)
        layers = tuple(aux_layers)
        key = (B, L, layers)
        padded = F.pad(ids_BL, (0, L - n), value=self.pad_id)
        graph = self.graphs.get(key)
        if graph is None and self._may_capture(B * L):
            graph = self._capture(key, padded)
        if graph is None:
            self.eager += 1
            aux_BLA, final_BLH = self.forward(padded.to(self.device), layers)
            return aux_BLA[:, :n], final_BLH[:, :n]
        graph.ids_BL.copy_(padded, non_blocking=True)
        graph.graph.replay()
        self.replays += 1
        # fresh tensors: the static outputs are rewritten by the next replay of any graph
        return graph.aux_BLA[:, :n].clone(), graph.final_BLH[:, :n].clone()

    def _may_capture(self, tokens: int) -> bool:
        return (
            self.use_graphs
            and self.failed is None
            and tokens <= self.max_tokens
            and len(self.graphs) < self.max_graphs
        )

    def _capture(self, key, padded: torch.Tensor) -> _Graph | None:
        B, L, layers = key
        ids_BL = padded.to(self.device)
        try:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):  # warm-up off the graph: compiles, cuBLAS workspace
                self.forward(ids_BL, layers)
            torch.cuda.current_stream(self.device).wait_stream(side)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            # thread_local: the training thread goes on launching (and allocating) meanwhile
            with (
                torch.compiler.set_stance("eager_on_recompile"),
                torch.cuda.graph(
                    graph, pool=self._pool, stream=side, capture_error_mode="thread_local"
                ),
            ):
                aux_BLA, final_BLH = self.forward(ids_BL, layers)
        except Exception as e:  # an op that cannot be captured (or no CUDA): eager from now on
            self.failed = f"{type(e).__name__}: {e}"
            log.warning("target.cuda_graphs: capturing the prefill of %d x %d tokens failed "
                        "(%s); the prefill runs without graphs from now on", B, L, self.failed)  # fmt: skip
            return None
        self.captures += 1
        log.info("target.cuda_graphs: captured the prefill of %d x %d tokens (%d graphs)",
                 B, L, len(self.graphs) + 1)  # fmt: skip
        self.graphs[key] = _Graph(graph, ids_BL, aux_BLA, final_BLH)
        return self.graphs[key]


def full_attention_layers(config, n_layers: int) -> list[bool]:
    """Per decoder layer: does it attend fully causally (no window)? From `layer_types` where
    the config has them, else no layer when a `sliding_window` is in use (Mistral-style)."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    types = getattr(config, "layer_types", None)
    if types:
        return [t == "full_attention" for t in types[:n_layers]]
    windowed = getattr(config, "sliding_window", None) is not None and getattr(
        config, "use_sliding_window", True
    )
    return [not windowed] * n_layers


class MasklessLayers:
    """Context manager: the decoder layers of full causal attention are called with
    `attention_mask=None` (SDPA's `is_causal`), whatever mask the model built for them.

    Only for a batch that has no padding mask (right padding, `PrefillGraphs`' contract):
    there the model's mask for such a layer is the plain causal one, and dropping it changes
    nothing but the kernel. Windowed layers keep theirs. A forward pre-hook, so it runs
    outside `target.compile`'s compiled forwards, which then see the same arguments in a
    warm-up and in a capture."""

    def __init__(self, model):
        from specbus.core.models.target import decoder_layers

        layers = list(decoder_layers(model))
        full = full_attention_layers(model.config, len(layers))
        self.layers = [layer for layer, causal in zip(layers, full, strict=True) if causal]
        self._handles: list = []

    @staticmethod
    def _drop_mask(_module, args, kwargs):
        if kwargs.get("attention_mask") is None:
            return None
        return args, {**kwargs, "attention_mask": None}

    def __enter__(self) -> MasklessLayers:
        self._handles = [layer.register_forward_pre_hook(self._drop_mask, with_kwargs=True)
                         for layer in self.layers]  # fmt: skip
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
