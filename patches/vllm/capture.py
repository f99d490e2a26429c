"""The vLLM capture layer's rules: engine-version free, no vllm import (connector.py adapts them).

Scheduler side (one per engine):
- `check_vllm_config` refuses, at startup and naming the flag, a server whose captures could
  not be whole: no `extract_hidden_states` speculative method (it is what writes the hidden
  states), chunked prefill, prefix caching (a cached prefix is never computed), more than one
  pipeline stage. It returns the server's layer ids (vLLM's `eagle_aux_hidden_state_layer_ids`).
- `decide(request, rate)`: a finished request is captured iff it finished normally (stop or
  length; an aborted or failed one is not) and `wire.capture_decision(capture_id, rate)`, with
  the launch-time rate: one decision, in the scheduler, that every TP rank then follows (it
  rides to the workers in the connector metadata). `capture_id` is the request's
  `kv_transfer_params["specbus_rid"]` when a driving producer set it (a driven id:
  `specbus-task:<seq>:<sample id>`, always captured, its sample id the task's), else vLLM's
  request id. A captured request's blocks stay allocated until the worker copied its rows.

Worker side (TP rank 0 of each engine writes; the others only report nothing):
- `rows_of(kv_cache, block_ids, n)`: the first `n` rows of a request out of the hidden-state
  cache (`[blocks, layers, block_size, H]`, vLLM's layout for it), `[n, layers, H]`: one row per
  token fed, `prompt + output[:-1]`, prefill and decode alike;
- `LayerPlan`: which cache columns are the handshake's aux layers (in its order) and which is
  the final one. vLLM's id `k` is the hidden state entering decoder layer `k` (the output of
  layer `k - 1`, pre-norm), so specbus's aux layer `a` is vLLM id `a + 1` and the final
  post-norm state is vLLM id `num_layers` passed through the target's final RMSNorm here
  (`FinalNorm`). A server whose ids are not the handshake's drops its captures
  (`layer_mismatch`, one error line naming the command to restart with).
- `capture_of` builds the sink's `Capture`; the sink does the rest (store put, intake POST,
  shed/4xx/timeout drops and key removal, min/max tokens: producers/live/sink.py).
Nothing here raises into serving: the connector counts faults (`layer_error`) and logs once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from specbus.producers.engines.pins import DRIVEN_PARAM
from specbus.producers.live.wire import capture_decision

log = logging.getLogger("specbus.vllm")

LAYER_IDS = "eagle_aux_hidden_state_layer_ids"  # the extract_hidden_states draft config's key
FINISHED = ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED")  # the statuses whose rows are whole


class CaptureLayerError(ValueError):
    """The server's settings make a whole-sequence capture impossible (names the flag)."""


def check_vllm_config(vllm_config) -> tuple[int, ...]:
    """The server's capture layer ids (vLLM's); `CaptureLayerError` naming every flag to change
    (module doc)."""
    problems = []
    spec = getattr(vllm_config, "speculative_config", None)
    ids: tuple[int, ...] = ()
    if spec is None or getattr(spec, "method", None) != "extract_hidden_states":
        problems.append("--speculative-config must use method extract_hidden_states (it writes "
                        "the hidden states the connector reads)")  # fmt: skip
    else:
        hf = getattr(getattr(spec, "draft_model_config", None), "hf_config", None)
        ids = tuple(int(i) for i in (getattr(hf, LAYER_IDS, None) or ()))
        if not ids:
            problems.append(
                f"--speculative-config names no draft_model_config.hf_config.{LAYER_IDS}"
            )
    if getattr(vllm_config.scheduler_config, "enable_chunked_prefill", False):
        problems.append("chunked prefill is on: add --no-enable-chunked-prefill (with "
                        "--max-num-batched-tokens at least --max-model-len)")  # fmt: skip
    if getattr(vllm_config.cache_config, "enable_prefix_caching", False):
        problems.append("prefix caching is on: add --no-enable-prefix-caching (a cached prefix "
                        "is not computed, so a capture would miss its rows)")  # fmt: skip
    if int(getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1) or 1) != 1:
        problems.append("--pipeline-parallel-size must be 1 (one stage holds every layer's rows)")
    if problems:
        raise CaptureLayerError("specbus capture connector: " + "; ".join(problems))
    return ids


def capture_id(request) -> str:
    """The id a request's capture is decided and named by (module doc)."""
    params = getattr(request, "kv_transfer_params", None) or {}
    rid = params.get(DRIVEN_PARAM) if isinstance(params, dict) else None
    return rid if isinstance(rid, str) and rid else str(request.request_id)


@dataclass
class Pending:
    """A finished request whose rows the writer takes (scheduler -> worker, in the metadata)."""

    req_id: str
    capture_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    block_ids: list[int]
    num_computed: int

    @property
    def num_rows(self) -> int:
        """Rows a whole capture holds: `prompt + output[:-1]`."""
        return len(self.prompt_ids) + len(self.output_ids) - 1


def decide(request, block_ids: list[int], rate: float) -> Pending | None:
    """The capture of a finished request, or None (module doc)."""
    status = getattr(getattr(request, "status", None), "name", str(getattr(request, "status", "")))
    if status not in FINISHED or request.prompt_token_ids is None or not block_ids:
        return None
    cid = capture_id(request)
    if not capture_decision(cid, rate):
        return None
    return Pending(req_id=str(request.request_id), capture_id=cid,
                   prompt_ids=list(request.prompt_token_ids),
                   output_ids=list(request.output_token_ids), block_ids=list(block_ids),
                   num_computed=int(request.num_computed_tokens))  # fmt: skip


def rows_of(kv_cache: torch.Tensor, block_ids: list[int], num_rows: int) -> torch.Tensor:
    """Rows `0..num_rows-1` of a request out of the hidden-state cache, `[n, layers, H]`, on the
    cache's device (module doc)."""
    block_size = kv_cache.shape[2]
    pos = torch.arange(num_rows, dtype=torch.long)
    blocks = torch.tensor(block_ids, dtype=torch.long)[pos // block_size]
    return kv_cache[blocks.to(kv_cache.device), :, (pos % block_size).to(kv_cache.device)]


@dataclass(frozen=True)
class FinalNorm:
    """The target's final RMSNorm (what the model applies after its last layer)."""

    weight: torch.Tensor
    eps: float

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """`x` normed as the model norms it (fp32 statistics, the weight in `x`'s dtype)."""
        from specbus.core.models.kernels import rms_norm

        return rms_norm(x, self.weight.to(x.dtype), self.eps)


@dataclass(frozen=True)
class LayerPlan:
    """Cache columns of the handshake's aux layers (its order) and of the final state."""

    aux: tuple[int, ...]
    final: int | None = None

    @classmethod
    def of(cls, server_ids, aux_layers, want_final: bool, num_layers: int) -> LayerPlan | None:
        """The plan, or None when the server's ids are not the handshake's (module doc).
        vLLM writes its layers in ascending id order (it sorts them)."""
        order = sorted(set(int(i) for i in server_ids))
        wanted = [int(a) + 1 for a in aux_layers] + ([num_layers] if want_final else [])
        if sorted(set(wanted)) != order:
            return None
        final = order.index(num_layers) if want_final else None
        return cls(aux=tuple(order.index(int(a) + 1) for a in aux_layers), final=final)


@dataclass
class Copy:
    """Rows of one pending capture on their way to host memory."""

    pending: Pending
    rows: torch.Tensor | None  # [n, layers, H] on the host; None: nothing to submit
    event: object = None  # a CUDA event while the copy runs
    why: str = ""  # why nothing is submitted
    done: bool = field(default=False)

    def ready(self) -> bool:
        """The copy is complete (the request's blocks may be freed)."""
        return self.event is None or bool(self.event.query())


def copy_rows(pending: Pending, kv_cache: torch.Tensor, stream=None) -> Copy:
    """Start copying `pending`'s rows to the host: on CUDA on a side stream after the forward
    that wrote them (an event marks the end), on the CPU at once. Rows short of `num_rows`
    (a request that finished before its last fed token was computed) give nothing, `incomplete`."""
    n = pending.num_rows
    if n < 1 or pending.num_computed < n:
        return Copy(pending, None, why="incomplete")
    if not kv_cache.is_cuda:
        return Copy(pending, rows_of(kv_cache, pending.block_ids, n).clone())
    ready = torch.cuda.Event()
    ready.record()
    stream.wait_event(ready)
    with torch.cuda.stream(stream):
        rows = rows_of(kv_cache, pending.block_ids, n)
        host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
        host.copy_(rows, non_blocking=True)
    done = torch.cuda.Event()
    done.record(stream)
    return Copy(pending, host, event=done)


def capture_of(copy: Copy, plan: LayerPlan, final_norm: FinalNorm | None):
    """The sink's `Capture` of a completed copy (aux columns concatenated in handshake order,
    the final column normed)."""
    from specbus.producers.live.sink import Capture

    rows = copy.rows
    aux = rows[:, list(plan.aux)].reshape(rows.shape[0], -1)
    final = []
    if plan.final is not None:
        if final_norm is None:
            raise ValueError("the final hidden state needs the target's final norm")
        final = [final_norm(rows[:, plan.final])]
    p = copy.pending
    return Capture(request_id=p.capture_id, prompt_ids=p.prompt_ids, output_ids=p.output_ids,
                   aux=[aux], final=final)  # fmt: skip
