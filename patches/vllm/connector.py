"""`SpecbusCaptureConnector`: the vLLM KV connector that hands captured hidden states to specbus.

Loaded by vLLM from `--kv-transfer-config '{"kv_connector": "SpecbusCaptureConnector",
"kv_connector_module_path": "specbus.patches.vllm.connector", "kv_role": "kv_producer"}'`
with `--speculative-config '{"method": "extract_hidden_states", "num_speculative_tokens": 1,
"draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [...]}}}'`: that
method caches the hidden states of every token in a cache-only KV layer; this connector reads
the rows of the sampled requests when they finish. One instance per role: the scheduler's
decides and keeps a captured request's blocks until the writer copied them; each worker's
(TP rank 0 writes) copies the rows and hands them to the `CaptureSink`. The rules are in
`capture.py` (no vllm import); this module is the adapter to vLLM 0.33's connector API
(`KVConnectorBase_V1`, `SupportsHMA`), whose every name `specbus vllm check` verifies.

Capture is off (nothing delayed, nothing copied) unless the server was started with
`SPECBUS_CAPTURE_INTAKE_URL` or `SPECBUS_CAPTURE_ENDPOINT` (`producers/live/sink_env.py`).
Responses are never touched: the connector returns no transfer params and never raises in a
step; a fault is counted (`layer_error`) and logged once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from specbus.patches.vllm.capture import (
    CaptureLayerError,
    Copy,
    FinalNorm,
    LayerPlan,
    Pending,
    capture_of,
    check_vllm_config,
    copy_rows,
    decide,
)
from specbus.producers.engines.pins import VLLM_VERSION
from specbus.producers.live import sink_env
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

log = logging.getLogger("specbus.vllm")

__all__ = ["CaptureLayerError", "SpecbusCaptureConnector", "SpecbusCaptureMetadata"]


@dataclass
class SpecbusCaptureMetadata(KVConnectorMetadata):
    """One step's captures to take (scheduler -> workers)."""

    pending: list[Pending] = field(default_factory=list)


class SpecbusCaptureConnector(KVConnectorBase_V1, SupportsHMA):
    """The specbus capture connector (module doc)."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        import vllm

        if getattr(vllm, "__version__", "?") != VLLM_VERSION:
            raise CaptureLayerError(f"the specbus capture connector is for vLLM {VLLM_VERSION}, "
                                    f"not {vllm.__version__} (`specbus vllm check`)")  # fmt: skip
        self.layer_ids = check_vllm_config(vllm_config)  # refuses at startup, naming the flag
        self.on = sink_env.configured()
        self.rate = sink_env.launch_rate()
        self.num_layers = vllm_config.model_config.get_total_num_hidden_layers()
        self.model_path = str(vllm_config.model_config.model)
        self._group = self._hidden_state_group(kv_cache_config)
        # scheduler side
        self._pending: dict[str, Pending] = {}
        # worker side
        self.sink = None
        self.writer = False
        self._kv_cache: torch.Tensor | None = None
        self._copies: dict[str, Copy] = {}
        self._finished: set[str] = set()
        self._stream = None
        self._final_norm: FinalNorm | None = None
        self._warned: set[str] = set()

    @staticmethod
    def _hidden_state_group(kv_cache_config) -> int:
        """The KV cache group holding the hidden states: by its spec type, else by the layer
        `ExtractHiddenStatesModel` names `cache_only_layers.<N>` (vLLM merges it into the
        attention group when their specs unify), 0 when there is one group."""
        if kv_cache_config is None:
            return 0
        from vllm.v1.kv_cache_interface import HiddenStateCacheSpec

        groups = kv_cache_config.kv_cache_groups
        found = [
            i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, HiddenStateCacheSpec)
        ]
        found = found or [i for i, g in enumerate(groups)
                          if any("cache_only_layers." in n for n in g.layer_names)]  # fmt: skip
        if len(found) == 1 or (not found and len(groups) == 1):
            return found[0] if found else 0
        raise CaptureLayerError(f"no single hidden-state KV cache group among {len(groups)}")

    # ------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        """Nothing is ever loaded."""
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        """Nothing is ever loaded."""

    def build_connector_meta(self, scheduler_output) -> SpecbusCaptureMetadata:
        """Hand this step's finished captures to the workers."""
        meta = SpecbusCaptureMetadata(pending=list(self._pending.values()))
        self._pending.clear()
        return meta

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """A captured request keeps its blocks until the writer copied its rows (True)."""
        if not self.on:
            return False, None
        try:
            pending = decide(request, block_ids, self.rate)
        except Exception as e:  # noqa: BLE001 - never in the way of serving
            self._warn("decide", f"specbus capture decision failed, serving goes on: {e!r}")
            return False, None
        if pending is None:
            return False, None
        self._pending[pending.req_id] = pending
        return True, None

    def request_finished_all_groups(self, request, block_ids: tuple[list[int], ...]):
        """`request_finished` with the hidden-state group's blocks."""
        if not 0 <= self._group < len(block_ids):
            return False, None
        return self.request_finished(request, block_ids[self._group])

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config) -> str | None:
        """Every token's hidden states together (`LBNHC`), as vLLM's own hidden-state
        connector asks: one row is one contiguous read."""
        return "LBNHC"

    def get_finished_count(self) -> int:
        """Only TP rank 0 copies rows, so one completion per captured request."""
        return 1

    # ------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Find the hidden-state cache; TP rank 0 starts the sink (when capture is on)."""
        from vllm.config import get_layers_from_vllm_config
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
        from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionLayer

        layers = get_layers_from_vllm_config(self._vllm_config, CacheOnlyAttentionLayer,
                                             list(kv_caches))  # fmt: skip
        if len(layers) != 1:
            raise CaptureLayerError(
                f"expected one cache-only hidden-state layer, got {list(layers)}"
            )
        self._kv_cache = kv_caches[next(iter(layers))]
        self.writer = get_tensor_model_parallel_rank() == 0
        if self.writer and self.on and self.sink is None:
            self.sink = sink_env.sink_from_env("vllm")

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        """Nothing to load."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to load."""

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        """The hidden states are already in the cache (the cache-only layer wrote them)."""

    def wait_for_save(self) -> None:
        """Copies start in `get_finished`, after the step's forward."""

    def get_finished(self, finished_req_ids: set[str]):
        """Start copying this step's finished captures; report those copied (their blocks may
        then be freed) and hand their rows to the sink."""
        if not self.writer:
            return None, None
        if self.has_connector_metadata():
            meta = self._get_connector_metadata()
            for pending in getattr(meta, "pending", ()):
                self._copies[pending.req_id] = self._start(pending)
        self._finished.update(finished_req_ids)
        done = set()
        for req_id, copy in list(self._copies.items()):
            if req_id not in self._finished or not copy.ready():
                continue
            del self._copies[req_id]
            self._finished.discard(req_id)
            done.add(req_id)
            self._submit(copy)
        return done or None, None

    def _start(self, pending: Pending) -> Copy:
        try:
            if self._stream is None and self._kv_cache is not None and self._kv_cache.is_cuda:
                self._stream = torch.cuda.Stream()
            return copy_rows(pending, self._kv_cache, self._stream)
        except Exception as e:  # noqa: BLE001
            self._fault("copy", e)
            return Copy(pending, None, why="error")

    def _submit(self, copy: Copy) -> None:
        sink = self.sink
        if sink is None:
            return
        try:
            if copy.rows is None:
                sink._count(f"layer_{copy.why}")
                return
            cfg = sink.config
            if cfg is None:
                sink._count("no_handshake")
                return
            want_final = any(d.source == "final" for d in cfg.features)
            plan = LayerPlan.of(self.layer_ids, cfg.aux_layers, want_final, self.num_layers)
            if plan is None:
                sink._count("layer_mismatch")
                wanted = [a + 1 for a in cfg.aux_layers] + ([self.num_layers] if want_final else [])
                self._warn("mismatch", f"the server captures vLLM layers {list(self.layer_ids)} "
                           f"but the run's handshake asks for {wanted}: captures are dropped; "
                           "restart the server with the command `specbus serve --engine vllm` "
                           "prints")  # fmt: skip
                return
            if plan.final is not None and self._final_norm is None:
                from specbus.core.models.target import load_final_norm

                self._final_norm = FinalNorm(*load_final_norm(self.model_path))
            sink.submit(capture_of(copy, plan, self._final_norm))
        except Exception as e:  # noqa: BLE001
            self._fault("submit", e)

    def shutdown(self) -> None:
        """Finish what the sink holds (bounded), then let it go."""
        if self.sink is not None:
            self.sink.close(timeout_s=10.0)
            self.sink = None

    # ------------------------------------------------------------ faults
    def _fault(self, where: str, e: Exception) -> None:
        if self.sink is not None:
            self.sink._count("layer_error")
        self._warn(f"fault:{where}", f"specbus capture connector ({where}) failed, serving goes "
                   f"on: {e!r}")  # fmt: skip

    def _warn(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.error(message)
