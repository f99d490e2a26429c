"""Drive the SGLang capture layer on real SGLang 0.5.23 objects, in a process that has SGLang.

Run by tests/test_sglang_layer.py as `python -m tests.sglang_driver '<json>'` with the pinned
wheel's directory on PYTHONPATH (tests/fixtures/sglang.py installs it). What is real here:
SGLang's plugin loader (`load_plugins`, entry-point discovery of what `specbus sglang apply`
wrote), its `HookRegistry` (the hooks wrap SGLang's own `Req.__init__`, `Scheduler.__init__`
and batch-result methods), `ServerArgs`, `Req`, `SamplingParams`, `ScheduleBatch`,
`LogitsProcessorOutput`, `GenerationBatchResult`, `get_batch_return_hidden_states_mode`, and
on the specbus side the `CaptureSink` posting to the real intake. What is not: the GPU forward
and the scheduler's own result processing (CUDA-only); `commit` below plays that step (append
the sampled token, SGLang's own `Req.update_finish_state`), and rows are `rows_at` of the
position, so the test can tell every row's place in the stored features.

Prints one JSON line: what each scenario did and the sink's counts.
"""

from __future__ import annotations

import json
import sys
import time

import torch


def rows_at(positions: list[int], tokens: list[int], width: int) -> torch.Tensor:
    """The rows the fake forward 'captures': row p is p + token/1000 + column/1e6 (exact in fp32
    for the sizes used)."""
    p = torch.tensor(positions, dtype=torch.float64)[:, None]
    t = torch.tensor(tokens, dtype=torch.float64)[:, None]
    return (p + t / 1000 + torch.arange(width, dtype=torch.float64)[None, :] / 1e6).float()


def main(opts: dict) -> dict:
    from array import array

    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.managers.schedule_batch import (
        Req,
        ScheduleBatch,
        get_batch_return_hidden_states_mode,
    )
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.managers.scheduler_components.batch_result_processor import (
        SchedulerBatchResultProcessor as Results,
    )
    from sglang.srt.managers.utils import GenerationBatchResult
    from sglang.srt.plugins import load_plugins
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from specbus.patches.sglang import plugin

    report: dict = {}
    originals = {"req": Req.__init__, "sched": Scheduler.__init__,
                 "prefill": Results.process_batch_result_prefill}  # fmt: skip
    load_plugins()  # SGLang's loader: finds the entry point `specbus sglang apply` wrote
    report["hooked"] = {
        "req": Req.__init__ is not originals["req"],
        "sched": Scheduler.__init__ is not originals["sched"],
        "prefill": Results.process_batch_result_prefill is not originals["prefill"],
        "targets": sorted(HookRegistry._hooks),
    }
    layers, hidden = opts["layer_ids"], opts["hidden"]
    good = dict(model_path=opts["model"], enable_return_aux_hidden_states=True,
                speculative_algorithm="EAGLE3", return_aux_hidden_state_layer_ids=layers,
                disable_radix_cache=True)  # fmt: skip
    refused = {}
    for name, change in {"radix": {"disable_radix_cache": False},
                         "no_aux": {"enable_return_aux_hidden_states": False,
                                    "speculative_algorithm": None,
                                    "return_aux_hidden_state_layer_ids": None}}.items():  # fmt: skip
        try:
            plugin.before_scheduler(None, ServerArgs(**{**good, **change}))
            refused[name] = ""
        except plugin.CaptureLayerError as e:
            refused[name] = str(e)
    report["refused"] = refused
    args = ServerArgs(**good)
    report["server_args"] = {"speculative_algorithm": str(args.speculative_algorithm),
                             "aux_capture": args.aux_hidden_state_capture}  # fmt: skip
    plugin.before_scheduler(None, args)  # passes
    plugin.after_scheduler(None, None, args)  # starts the sink (this process is its rank 0)
    sink = plugin.STATE.sink
    deadline = time.monotonic() + 60
    while sink.config is None and time.monotonic() < deadline:
        time.sleep(0.05)
    report["handshake"] = sink.config is not None
    width = len(layers) * hidden

    def request(rid: str, prompt: list[int], max_new: int) -> Req:
        sp = SamplingParams(max_new_tokens=max_new, temperature=0)
        sp.normalize(None)
        return Req(rid, "", array("q", prompt), sp, eos_token_ids={2}, vocab_size=128)

    def commit(reqs: list[Req], tokens: list[int] | None):
        def original(self, batch, result):  # the scheduler's commit of this forward
            for req, tok in zip(reqs, tokens or [None] * len(reqs), strict=True):
                if tok is None:  # a middle chunk commits nothing
                    continue
                if not req.finished():
                    req.output_ids.append(tok)
                    req.update_finish_state(1)

        return original

    def prefill(reqs, chunks, tokens, prefix=None):
        """One extend forward: `chunks[i]` = (first position, token ids fed) of reqs[i]."""
        batch = ScheduleBatch(reqs=reqs, req_to_token_pool=None, token_to_kv_pool_allocator=None,
                              tree_cache=None, model_config=None, enable_overlap=False,
                              spec_algorithm=SpeculativeAlgorithm.NONE)  # fmt: skip
        mode = get_batch_return_hidden_states_mode(reqs)  # SGLang's own batch decision
        batch.return_hidden_states_mode, batch.return_hidden_states = mode, mode.need_capture()
        batch.prefix_lens = prefix or [c[0] for c in chunks]
        batch.extend_lens = [len(c[1]) for c in chunks]
        pos = [c[0] + k for c in chunks for k in range(len(c[1]))]
        toks = [t for c in chunks for t in c[1]]
        out = LogitsProcessorOutput(next_token_logits=None, hidden_states=rows_at(pos, toks, width),
                                    last_hidden_states=-rows_at(pos, toks, hidden))  # fmt: skip
        result = GenerationBatchResult(logits_output=out, next_token_ids=torch.tensor(tokens or []),
                                       extend_input_len_per_req=list(batch.extend_lens))  # fmt: skip
        plugin.around_prefill(commit(reqs, tokens), None, batch, result)
        return batch

    def decode(batch, tokens):
        live = [r for r in batch.reqs]
        fed = [r.output_ids[-1] for r in live]
        pos = [len(r.origin_input_ids) + len(r.output_ids) - 1 for r in live]
        out = LogitsProcessorOutput(next_token_logits=None, hidden_states=rows_at(pos, fed, width),
                                    last_hidden_states=-rows_at(pos, fed, hidden))  # fmt: skip
        result = GenerationBatchResult(logits_output=out, next_token_ids=torch.tensor(tokens))
        plugin.around_decode(commit(live, tokens), None, batch, result)

    def run(rids_prompts, max_new, chunked=False, prefix_hit=0, overshoot=False):
        reqs = [request(rid, p, max_new) for rid, p in rids_prompts]
        report.setdefault("modes", {}).update(
            {r.rid: int(r.return_hidden_states_mode) for r in reqs}
        )
        report.setdefault("return_hidden_states", {}).update(
            {r.rid: r.return_hidden_states for r in reqs}
        )
        if chunked:  # two chunks; the request's first token comes with the last one
            half = [len(p) // 2 for _, p in rids_prompts]
            prefill(reqs, [(0, p[:h]) for (_, p), h in zip(rids_prompts, half, strict=True)], None)
            b = prefill(reqs, [(h, p[h:]) for (_, p), h in zip(rids_prompts, half, strict=True)],
                        [10 + i for i in range(len(reqs))])  # fmt: skip
        else:
            b = prefill(reqs, [(prefix_hit, p[prefix_hit:]) for _, p in rids_prompts],
                        [10 + i for i in range(len(reqs))])  # fmt: skip
        step = 0
        while not all(r.finished() for r in reqs):
            step += 1
            decode(b, [10 + step * 7 % 50 + i for i in range(len(reqs))])
        if overshoot:  # an overlap scheduler's extra tick over finished requests
            decode(b, [99] * len(reqs))
        return {
            r.rid: {"prompt": list(r.origin_input_ids), "output": list(r.output_ids)} for r in reqs
        }

    plugin.STATE.rate = opts["rate"]
    seen = {}
    seen.update(run([("whole-1", list(range(20, 31))), ("whole-2", list(range(40, 47)))], 6))
    seen.update(run([("chunked-1", list(range(50, 63)))], 5, chunked=True))
    seen.update(run([("prefix-1", list(range(30, 42)))], 5, prefix_hit=4))
    seen.update(run([("overshoot-1", list(range(60, 69)))], 4, overshoot=True))
    plugin.STATE.rate = 0.0  # a request the rate does not sample is not marked at all
    seen.update(run([("unsampled-1", list(range(20, 26)))], 4))
    deadline = time.monotonic() + 60
    while not sink.idle() and time.monotonic() < deadline:
        time.sleep(0.05)
    report["requests"] = seen
    report["counts"] = dict(sink.counts)
    sink.close()
    return report


if __name__ == "__main__":
    torch.set_num_threads(1)
    print(json.dumps(main(json.loads(sys.argv[1]))), flush=True)
