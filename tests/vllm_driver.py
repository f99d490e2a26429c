"""Drive the specbus vLLM connector inside vLLM 0.33.0's own engine-core objects, on the CPU.

Run by tests/test_vllm_connector.py as `python -m tests.vllm_driver '<json>'` with the pinned
wheel's directory on PYTHONPATH and `VLLM_TARGET_DEVICE=cpu` (tests/fixtures/vllm.py). What
is real vLLM code here:
- the server's configuration: the `vllm serve` argv `specbus serve --engine vllm` printed, parsed
  by vLLM's own CLI parser (`make_arg_parser`) into `AsyncEngineArgs` and `create_engine_config()`
  (a `VllmConfig`), which also imports the connector by module path (`KVConnectorFactory`);
- the KV cache plan: the real `CacheOnlyAttentionLayer` of `extract_hidden_states` (made as
  `ExtractHiddenStatesModel` makes it), its `HiddenStateCacheSpec`, `get_global_kv_cache_groups`,
  `get_kv_cache_configs`, `generate_scheduler_kv_cache_config`, `resolve_kv_cache_block_sizes`;
- the scheduler: `vllm.v1.core.sched.scheduler.Scheduler` with its `KVCacheManager`, real
  `Request`s and `SamplingParams`; it builds the scheduler-side connector itself and calls
  `request_finished_all_groups`, `build_connector_meta`, and frees a captured request's blocks
  only when a worker reports it in `KVConnectorOutput.finished_sending`;
- the worker side: the connector made by `KVConnectorFactory.create_connector(WORKER)`,
  `register_kv_caches` finding the layer with `get_layers_from_vllm_config`, vLLM's TP group
  (gloo, world 1) for the writer-rank choice; the hidden states are written into the cache by
  the real `CacheOnlyAttentionLayer.forward` (vLLM's `unified_kv_cache_update` /
  `basic_cache`) inside vLLM's `set_forward_context` with the step's slot mapping.
Not real: the target's forward and the sampler (a stand-in writes `rows_at` of each fed
token's position into every captured layer, so the test knows every stored value, and samples
token 7, or the stop token where a scenario asks), and the GPU (CPU tensors; the CUDA copy
stream of `capture.copy_rows` does not run). No draft tokens are proposed (the stand-in runner
returns none), so every decode step feeds one token.

Also reads a speculators export as vLLM's engine config does (`--speculative-config
'{"model": DIR, "method": "eagle3"}'`: `SpeculatorsConfig`, the draft's architecture and ids).

Prints one JSON line: the refusals, each scenario's tokens, the block pool before and after,
the sink's counts, the draft as vLLM read it; then (with a port) serves `/v1/completions`.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from tests.sglang_driver import rows_at


def engine_config(argv: list[str]):
    """vLLM's own parse of the `vllm serve` argv (after `vllm serve`)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    model, rest = argv[0], argv[1:]
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", model, *rest])
    return AsyncEngineArgs.from_cli_args(args).create_engine_config()


def refusal(argv: list[str], change: dict, kv_cache_config=None) -> str:
    """What the connector says when vLLM builds it for a server started with `argv` changed by
    `change` (flags to drop or replace)."""
    from specbus.patches.vllm.capture import CaptureLayerError
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    words = list(argv)
    for flag, value in change.items():
        if flag in words:
            i = words.index(flag)
            del words[i : i + (2 if flag.startswith("--speculative") else 1)]
        if value:
            words += value
    try:
        cfg = engine_config(words)
        KVConnectorFactory.create_connector(cfg, KVConnectorRole.SCHEDULER, kv_cache_config)
    except CaptureLayerError as e:
        return str(e)
    except Exception as e:  # noqa: BLE001 - vLLM's own refusal of the argv: reported as such
        return f"vllm: {type(e).__name__}: {e}"
    return ""


def pipeline_refusal(cfg) -> str:
    """The connector's refusal of two pipeline stages (set on the parsed config: a second
    stage needs a second device to configure)."""
    from specbus.patches.vllm.capture import CaptureLayerError
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    stages = cfg.parallel_config.pipeline_parallel_size
    cfg.parallel_config.pipeline_parallel_size = 2
    try:
        KVConnectorFactory.create_connector(cfg, KVConnectorRole.SCHEDULER, None)
    except CaptureLayerError as e:
        return str(e)
    finally:
        cfg.parallel_config.pipeline_parallel_size = stages
    return ""


class Engine:
    """vLLM's scheduler and a worker-side connector with a stand-in model runner (module doc)."""

    def __init__(self, cfg, stop_token: int = 2):
        from specbus.ops.services.common import free_port
        from vllm.config import set_current_vllm_config
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.distributed.parallel_state import (
            ensure_model_parallel_initialized,
            init_distributed_environment,
        )
        from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionLayer
        from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
        from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
        from vllm.v1.core.kv_cache_utils import (
            generate_scheduler_kv_cache_config,
            resolve_kv_cache_block_sizes,
        )
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec
        from vllm.v1.structured_output import StructuredOutputManager

        self.cfg, self.stop_token = cfg, stop_token
        self.ctx = set_current_vllm_config(cfg)
        self.ctx.__enter__()
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{free_port()}")  # fmt: skip
        ensure_model_parallel_initialized(1, 1)
        model = cfg.model_config
        self.num_layers = model.get_total_num_hidden_layers()
        self.ids = list(
            cfg.speculative_config.draft_model_config.hf_config.eagle_aux_hidden_state_layer_ids
        )
        self.hidden = model.get_hidden_size()
        # as ExtractHiddenStatesModel builds it: one head per captured layer, head size H
        self.layer = CacheOnlyAttentionLayer(num_heads=len(self.ids), head_size=self.hidden,
                                             prefix=f"cache_only_layers.{self.num_layers}")  # fmt: skip
        text = model.hf_text_config
        kv_heads = text.num_key_value_heads
        head_dim = getattr(text, "head_dim", None) or self.hidden // text.num_attention_heads
        specs = {f"model.layers.{i}.self_attn.attn": FullAttentionSpec(
            block_size=cfg.cache_config.block_size, num_kv_heads=kv_heads, head_size=head_dim,
            dtype=model.dtype) for i in range(self.num_layers)}  # fmt: skip
        specs[self.layer.layer_name] = self.layer.get_kv_cache_spec(cfg)
        connector_cls = KVConnectorFactory.get_connector_class(cfg.kv_transfer_config)
        resolve_kv_cache_layout(cfg, [[connector_cls.get_required_kvcache_layout(cfg)]],
                                list(specs.values()))  # fmt: skip
        groups = get_global_kv_cache_groups(cfg, [specs])
        worker_kv = get_kv_cache_configs(cfg, [specs], [8 << 20], groups)
        kv_config = generate_scheduler_kv_cache_config(worker_kv)
        cfg.cache_config.num_gpu_blocks = kv_config.num_blocks  # as vLLM's EngineCore does
        block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_config, cfg)
        self.scheduler = Scheduler(vllm_config=cfg, kv_cache_config=kv_config,
                                   structured_output_manager=StructuredOutputManager(cfg),
                                   block_size=block_size, hash_block_size=hash_block_size)  # fmt: skip
        self.kv_config = kv_config
        self.group = next((i for i, g in enumerate(kv_config.kv_cache_groups)
                           if self.layer.layer_name in g.layer_names))  # fmt: skip
        self.block_size = kv_config.kv_cache_groups[self.group].kv_cache_spec.block_size
        cache = torch.zeros(kv_config.num_blocks, len(self.ids), self.block_size, self.hidden,
                            dtype=model.dtype)  # fmt: skip
        self.layer.kv_cache = cache  # what vLLM's bind_kv_cache does
        self.worker = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, worker_kv[0])
        self.worker.register_kv_caches({self.layer.layer_name: cache})
        self.tables: dict[str, list[int]] = {}
        self.stop_after: dict[str, int] = {}
        self.outputs: dict[str, list[int]] = {}  # request id -> tokens the engine output
        self.finish: dict[str, str] = {}  # request id -> finish reason

    def free_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    def add(self, rid: str, prompt: list[int], max_tokens: int = 0, *,
            stop_after: int | None = None, sampling=None) -> None:  # fmt: skip
        """Add a request (its `SamplingParams`, else greedy `max_tokens` with the stop token)."""
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        sp = sampling or SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                        stop_token_ids=[self.stop_token])  # fmt: skip
        self.scheduler.add_request(Request(rid, list(prompt), sp, None))
        self.outputs[rid] = []
        if stop_after is not None:
            self.stop_after[rid] = stop_after

    def abort(self, rid: str) -> None:
        from vllm.v1.request import RequestStatus

        self.scheduler.finish_requests(rid, RequestStatus.FINISHED_ABORTED)

    def step(self) -> None:
        from vllm.forward_context import set_forward_context
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        out = self.scheduler.schedule()
        for new in out.scheduled_new_reqs:
            self.tables[new.req_id] = list(new.block_ids[self.group])
        cached = out.scheduled_cached_reqs
        for rid, blocks in zip(cached.req_ids, cached.new_block_ids, strict=True):
            if blocks is not None:
                self.tables[rid] += list(blocks[self.group])
        rows, slots, order = [], [], []
        for rid, n in out.num_scheduled_tokens.items():
            req = self.scheduler.requests[rid]
            start = req.num_computed_tokens - n  # the scheduler counted this step already
            pos = list(range(start, start + n))
            toks = [req.all_token_ids[p] for p in pos]
            width = len(self.ids) * self.hidden
            rows.append(rows_at(pos, toks, width).view(n, len(self.ids), self.hidden))
            table = self.tables[rid]
            slots += [
                table[p // self.block_size] * self.block_size + p % self.block_size for p in pos
            ]
            order.append(rid)
        if out.kv_connector_metadata is not None:
            self.worker.bind_connector_metadata(out.kv_connector_metadata)
        if rows:  # the forward: the cache-only layer writes every fed token's hidden states
            name = self.layer.layer_name
            with set_forward_context(None, self.cfg, slot_mapping={name: torch.tensor(slots)}):
                self.layer(torch.cat(rows).to(self.layer.kv_cache.dtype))
        sending, _ = self.worker.get_finished(out.finished_req_ids)
        self.worker.clear_connector_metadata()
        sampled = []
        for rid in order:
            req = self.scheduler.requests[rid]
            done = req.num_computed_tokens >= req.num_tokens  # prefill complete: a token comes
            stop = len(req.output_token_ids) + 1 >= self.stop_after.get(rid, 1 << 30)
            sampled.append([self.stop_token if stop else 7] if done else [])
        output = ModelRunnerOutput(req_ids=order, req_id_to_index={r: i for i, r in enumerate(order)},
                                   sampled_token_ids=sampled,
                                   kv_connector_output=KVConnectorOutput(finished_sending=sending))  # fmt: skip
        for outs in self.scheduler.update_from_output(out, output).values():
            for o in outs.outputs:
                self.outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finish_reason is not None:
                    self.finish[o.request_id] = str(o.finish_reason)

    def run(self, max_steps: int = 200) -> None:
        for _ in range(max_steps):
            pending = self.scheduler.has_requests() or self.worker._copies
            if not pending:
                return
            self.step()
        raise RuntimeError("the scheduler did not drain")


def main(opts: dict) -> dict:
    from specbus.producers.live.wire import capture_decision

    report: dict = {}
    argv = opts["argv"]
    cfg = engine_config(argv)
    report["config"] = {
        "chunked_prefill": cfg.scheduler_config.enable_chunked_prefill,
        "prefix_caching": cfg.cache_config.enable_prefix_caching,
        "method": cfg.speculative_config.method,
        "layer_ids": list(cfg.speculative_config.draft_model_config.hf_config.eagle_aux_hidden_state_layer_ids),
        "connector": cfg.kv_transfer_config.kv_connector,
    }  # fmt: skip
    report["refused"] = {
        "chunked": refusal(argv, {"--no-enable-chunked-prefill": ["--enable-chunked-prefill"]}),
        "prefix": refusal(argv, {"--no-enable-prefix-caching": ["--enable-prefix-caching"]}),
        "no_extract": refusal(argv, {"--speculative-config": None}),
        "pipeline": pipeline_refusal(cfg),
    }
    if opts.get("draft"):  # a `specbus export --format speculators` directory, as vLLM reads it
        served = engine_config([argv[0], "--dtype", "float32", "--speculative-config", json.dumps(
            {"model": opts["draft"], "method": "eagle3", "num_speculative_tokens": 3})])  # fmt: skip
        spec = served.speculative_config
        hf = spec.draft_model_config.hf_config
        report["draft"] = {"config": type(hf).__name__, "method": spec.method,
                           "architectures": list(hf.architectures),
                           "layer_ids": list(hf.eagle_aux_hidden_state_layer_ids),
                           "norm_before_residual": hf.norm_before_residual,
                           "draft_vocab_size": hf.draft_vocab_size,
                           "tokens": spec.num_speculative_tokens}  # fmt: skip
    engine = Engine(cfg)
    sink = engine.worker.sink
    deadline = time.monotonic() + 60  # the handshake with the intake
    while sink is not None and sink.config is None:
        if time.monotonic() > deadline:
            raise SystemExit("no capture handshake with the intake")
        time.sleep(0.05)
    free0 = engine.free_blocks()
    rate = opts["rate"]
    sampled = [f"req-{i}" for i in range(200) if capture_decision(f"req-{i}", rate)]
    unsampled = [f"req-{i}" for i in range(200) if not capture_decision(f"req-{i}", rate)]
    scen = {  # name -> (request id, prompt, max tokens, stop after n tokens)
        "whole": (sampled[0], [3, 10, 11, 12, 13, 14, 15, 16, 17], 4, None),
        "batch-a": (sampled[1], [3, 20, 21, 22, 23, 24], 3, None),
        "batch-b": (sampled[2], [3, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41], 5, None),
        "stopped": (sampled[3], [3, 50, 51, 52, 53, 54, 55], 9, 3),
        "unsampled": (unsampled[0], [3, 60, 61, 62, 63, 64, 65], 4, None),
        "short": (sampled[4], [3, 70, 71, 72], 1, None),  # no generated row: the sink's min
    }  # fmt: skip
    engine.add(*scen["whole"][:3])
    engine.run()
    for name in ("batch-a", "batch-b", "stopped", "unsampled", "short"):
        rid, prompt, n, stop = scen[name]
        engine.add(rid, prompt, n, stop_after=stop)
    engine.run()
    aborted = sampled[5]
    engine.add(aborted, [3, 80, 81, 82, 83], 50)
    engine.step()
    engine.step()
    engine.abort(aborted)
    engine.run()
    deadline = time.monotonic() + 60
    while sink is not None and not sink.idle() and time.monotonic() < deadline:
        time.sleep(0.05)
    report["free_blocks"] = [free0, engine.free_blocks()]
    report["requests"] = {
        name: {"rid": rid, "prompt": prompt} for name, (rid, prompt, *_) in scen.items()
    }
    report["aborted"] = aborted
    report["counts"] = dict(sink.counts) if sink is not None else {}
    report["writer"] = engine.worker.writer
    print(json.dumps(report), flush=True)
    return {**report, "engine": engine}


def serve(engine: Engine, port: int) -> None:
    """A stand-in vLLM HTTP server: `POST /v1/completions` parsed by vLLM's own
    `CompletionRequest` into its `SamplingParams` (`to_sampling_params`: `kv_transfer_params`
    go into `extra_args`, as in vLLM's server), run through `engine` under a request id shaped
    as vLLM's (`cmpl-<uuid>-0-<8 hex>`), one request at a time."""
    import threading
    import uuid

    import uvicorn
    from fastapi import FastAPI
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    app, lock = FastAPI(), threading.Lock()

    @app.get("/health")
    def health() -> dict:
        return {"ok": True}

    @app.post("/v1/completions")
    def completions(body: dict) -> dict:
        req = CompletionRequest(**body)
        sp = req.to_sampling_params(req.max_tokens or 16, {})
        rid = f"cmpl-{uuid.uuid4().hex}-0-{uuid.uuid4().hex[:8]}"
        with lock:
            engine.add(rid, list(req.prompt), sampling=sp)
            engine.run()
            tokens, reason = engine.outputs.pop(rid), engine.finish.pop(rid, None)
        return {
            "id": rid,
            "object": "text_completion",
            "model": body.get("model"),
            "choices": [{"index": 0, "text": "", "token_ids": tokens, "finish_reason": reason}],
        }

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


if __name__ == "__main__":
    torch.set_num_threads(1)
    options = json.loads(sys.argv[1])
    result = main(options)
    if options.get("port"):  # then a stand-in server on the same engine (driven capture)
        serve(result.pop("engine"), options["port"])
