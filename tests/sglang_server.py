"""A stand-in SGLang HTTP server for driven capture: real SGLang request parsing and real hooks.

Run by tests/test_sglang_drive.py as `python -m tests.sglang_server '<json>'` with the pinned
wheel's directory on PYTHONPATH (tests/fixtures/sglang.py) and the layer applied. Real here:
SGLang's plugin loader and `HookRegistry` (the entry point `specbus sglang apply` wrote), the
layer's startup check on real `ServerArgs`, the body of `POST /generate` parsed into SGLang's
own `GenerateReqInput` and normalised as its tokenizer manager does
(`normalize_batch_and_arguments`), `SamplingParams` (`normalize`, `verify`), a real `Req` made by
the hooked constructor, and the layer's prefill hook on a real `ScheduleBatch` /
`LogitsProcessorOutput` / `GenerationBatchResult`, whose finish is SGLang's own
`Req.update_finish_state`; the sink is the real `CaptureSink`. Not real: the GPU forward (rows
are `sglang_driver.rows_at`, so the test knows every stored row) and the scheduler's own result
processing (the driver's stand-in `commit`). Requests are served one at a time, each taking
`delay_s` (the time a test needs to kill the server mid-run).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from array import array

import torch


def main(opts: dict) -> None:
    import uvicorn
    from fastapi import FastAPI
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.managers.schedule_batch import (
        Req,
        ScheduleBatch,
        get_batch_return_hidden_states_mode,
    )
    from sglang.srt.managers.utils import GenerationBatchResult
    from sglang.srt.plugins import load_plugins
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from specbus.patches.sglang import plugin

    from tests.sglang_driver import rows_at

    load_plugins()  # SGLang's loader: the layer's hooks, or none when it is not applied
    args = ServerArgs(model_path=opts["model"], enable_return_aux_hidden_states=True,
                      speculative_algorithm="EAGLE3", disable_radix_cache=True,
                      return_aux_hidden_state_layer_ids=opts["layer_ids"])  # fmt: skip
    plugin.before_scheduler(None, args)  # what the hooked Scheduler.__init__ runs
    plugin.after_scheduler(None, None, args)
    deadline = time.monotonic() + 60  # ready (healthy) once the sink has its handshake
    while plugin.STATE.sink is not None and plugin.STATE.sink.config is None:
        if time.monotonic() > deadline:
            raise SystemExit("no capture handshake with the intake")
        time.sleep(0.05)
    width = len(opts["layer_ids"]) * opts["hidden"]
    lock = threading.Lock()
    app = FastAPI()

    def prefill(req: Req) -> None:
        ids = list(req.origin_input_ids)
        batch = ScheduleBatch(reqs=[req], req_to_token_pool=None, token_to_kv_pool_allocator=None,
                              tree_cache=None, model_config=None, enable_overlap=False,
                              spec_algorithm=SpeculativeAlgorithm.NONE)  # fmt: skip
        mode = get_batch_return_hidden_states_mode([req])
        batch.return_hidden_states_mode, batch.return_hidden_states = mode, mode.need_capture()
        batch.prefix_lens, batch.extend_lens = [0], [len(ids)]
        pos = list(range(len(ids)))
        out = LogitsProcessorOutput(next_token_logits=None, hidden_states=rows_at(pos, ids, width),
                                    last_hidden_states=-rows_at(pos, ids, opts["hidden"]))  # fmt: skip
        result = GenerationBatchResult(logits_output=out, next_token_ids=torch.tensor([7]),
                                       extend_input_len_per_req=[len(ids)])  # fmt: skip

        def commit(self, batch, result):  # the scheduler's commit of the sampled token
            req.output_ids.append(7)
            req.update_finish_state(1)

        plugin.around_prefill(commit, None, batch, result)

    @app.get("/health")
    def health() -> dict:
        return {"ok": True}

    @app.post("/generate")
    def generate(body: dict) -> dict:
        obj = GenerateReqInput(**body)
        obj.normalize_batch_and_arguments()  # as SGLang's tokenizer manager does
        with lock:
            sp = SamplingParams(**obj.sampling_params)
            sp.normalize(None)
            sp.verify(128)
            req = Req(obj.rid, "", array("q", obj.input_ids), sp, eos_token_ids={2}, vocab_size=128)
            time.sleep(opts.get("delay_s", 0.0))
            prefill(req)
        return {"text": "", "output_ids": list(req.output_ids),
                "meta_info": {"id": obj.rid, "prompt_tokens": len(obj.input_ids),
                              "finish_reason": req.finished_reason.to_json()}}  # fmt: skip

    uvicorn.run(app, host="127.0.0.1", port=opts["port"], log_level="warning")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(json.loads(sys.argv[1]))
