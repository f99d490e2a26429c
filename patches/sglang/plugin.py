"""The SGLang plugin: hooks that hand captured rows of sampled requests to the capture sink.

Loaded by SGLang's plugin loader (`sglang.srt.plugins.load_plugins`, run at the start of every
scheduler process) through the `sglang.srt.plugins` entry point `specbus capture` that
`specbus sglang apply` installs. `register()` does nothing unless the server was started with
`SPECBUS_CAPTURE_INTAKE_URL` or `SPECBUS_CAPTURE_ENDPOINT` (so an applied layer costs nothing
when capture is off), and refuses (logs, registers nothing) on another SGLang version.

The hooks (`SGLANG_HOOKS` of `producers/engines/pins.py`; SGLang's `HookRegistry` applies
them):
- `Req.__init__` (after): a request whose id `capture_decision` samples, at the launch-time
  rate `SPECBUS_CAPTURE_SAMPLE_RATE` (the same on every TP rank, no handshake needed, so every
  rank builds the same forward batches; a driven id `specbus-task:<seq>:<sample id>` of a
  `sglang_server` producer always, even at rate 0), asks for full hidden-state capture
  (`return_hidden_states_mode = FULL`) without `return_hidden_states`, so nothing reaches
  the response; the writer rank also gives it a `Rows` book (`rows.py`);
- `Scheduler.__init__` (before): `check_server_args` refuses a server whose capture would be
  wrong (no aux capture, radix cache on, speculative decoding, PD disaggregation, pp > 1);
  (after): the writer rank (attention-TP rank 0) starts the `CaptureSink`;
- `SchedulerBatchResultProcessor.process_batch_result_prefill` / `_decode` (around): rows of
  the sampled requests (upstream's packed aux states in `logits_output.hidden_states`, the
  post-norm last layer in `logits_output.last_hidden_states`) are copied to CPU with their
  positions; a finished request's capture goes to `sink.submit`. Chunked prefill is captured
  chunk by chunk; a prefix hit or a gap breaks the capture (never submitted, counted).

Nothing here raises into SGLang's serving path: failures are counted (`sink.counts`, keys
`layer_*`) and logged once.
"""

from __future__ import annotations

import logging

import torch
from specbus.patches.sglang.rows import Rows, row_slices
from specbus.producers.engines.pins import SGLANG_HOOKS, SGLANG_VERSION
from specbus.producers.live.sink_env import configured, launch_rate, sink_from_env
from specbus.producers.live.wire import capture_decision, sample_id_of

log = logging.getLogger("specbus.sglang")


class CaptureLayerError(ValueError):
    """The server's arguments make a whole-sequence capture impossible (names the flag)."""


class _State:
    """The layer's state in one scheduler process (one scheduler per process)."""

    on: bool = False  # registered: capture configured in this process
    rate: float = 0.0  # of user requests; driven ids (`wire.driven_rid`) are always captured
    writer: bool = False  # this rank submits captures (the others only mark requests)
    sink = None
    layer_ids: tuple[int, ...] | None = None  # the server's --return-aux-hidden-state-layer-ids
    warned: set = set()


STATE = _State()


def register() -> None:
    """The `sglang.srt.plugins` entry point (module doc). Never raises."""
    try:
        if not configured():
            return
        import sglang

        version = getattr(sglang, "__version__", "?")
        if version != SGLANG_VERSION:
            log.error("specbus capture layer is for SGLang %s, not %s: capture is OFF "
                      "(`specbus sglang check`)", SGLANG_VERSION, version)  # fmt: skip
            return
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        STATE.rate = launch_rate()
        STATE.on = True
        for target, kind, name in SGLANG_HOOKS:
            HookRegistry.register(target, globals()[name], HookType[kind])
    except Exception as e:  # noqa: BLE001 - a plugin must not stop the server
        log.error("specbus capture layer not registered: %s", e)


# ---------------------------------------------------------------- startup
def check_server_args(args) -> None:
    """Raise `CaptureLayerError` (naming the flag to change) unless every captured request's
    rows can be whole: upstream aux capture on (with it, `--speculative-algorithm` only names
    the capture convention and no draft runs), no radix cache (a prefix hit is never
    prefilled, so its rows cannot be captured), no prefill/decode disaggregation, one
    pipeline stage."""
    problems = []
    if not getattr(args, "enable_return_aux_hidden_states", False):
        problems.append("--enable-return-aux-hidden-states is off (the layer captures the "
                        "aux hidden states upstream computes in that mode)")  # fmt: skip
    if not getattr(args, "disable_radix_cache", False):
        problems.append("the radix cache is on: add --disable-radix-cache (a cached prefix is "
                        "not prefilled, so a capture would miss its rows)")  # fmt: skip
    if str(getattr(args, "disaggregation_mode", "null")) != "null":
        problems.append("prefill/decode disaggregation is not supported by the capture layer")
    if int(getattr(args, "pp_size", 1) or 1) != 1:
        problems.append("--pp-size must be 1 (upstream aux capture needs one pipeline stage)")
    if problems:
        raise CaptureLayerError("specbus capture layer: " + "; ".join(problems))


def writer_rank() -> bool:
    """Whether this scheduler process submits captures: attention-TP rank 0 (the others
    compute the same rows; one of each DP group writes)."""
    try:
        from sglang.srt.runtime_context import get_parallel

        return int(get_parallel().attn_tp_rank) == 0
    except Exception:  # noqa: BLE001 - before the groups exist: a single-rank server
        return True


def start_sink(args, *, sink=None) -> None:
    """Start the capture sink of this process when it is the writer (`sink`: a prepared one,
    tests). The intake and token come from the environment (asked again at every handshake)."""
    STATE.layer_ids = tuple(getattr(args, "return_aux_hidden_state_layer_ids", None) or ()) or None
    STATE.writer = writer_rank()
    if not STATE.writer:
        return
    STATE.sink = sink if sink is not None else sink_from_env("sglang")


def before_scheduler(self, server_args, *args, **kwargs):
    """`Scheduler.__init__` (before): refuse impossible captures at startup."""
    if STATE.on:
        check_server_args(server_args)


def after_scheduler(result, self, server_args, *args, **kwargs):
    """`Scheduler.__init__` (after): the writer rank starts its sink."""
    if STATE.on:
        start_sink(server_args)


# ---------------------------------------------------------------- per request
def on_request(result, req, rid=None, *args, **kwargs):
    """`Req.__init__` (after): mark a sampled request (module doc)."""
    try:
        mark(req)
    except Exception as e:  # noqa: BLE001
        _fault("mark", e)


def mark(req) -> bool:
    """Ask for full capture of `req` when its id is sampled; True when marked."""
    rid = getattr(req, "rid", None)
    if not STATE.on or not isinstance(rid, str) or not capture_decision(rid, STATE.rate):
        return False
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

    req.return_hidden_states_mode = max(req.return_hidden_states_mode, CaptureHiddenMode.FULL)
    req.specbus_rows = Rows(rid, sample_id_of(rid)) if STATE.writer else None
    return True


def around_prefill(original, self, batch, result, *args, **kwargs):
    """`process_batch_result_prefill` (around): take each sampled request's chunk rows."""
    jobs = _safely("prefill", _prefill_jobs, batch, result) or []
    out = original(self, batch, result, *args, **kwargs)
    if jobs:
        _safely("prefill", _take, jobs, getattr(result, "logits_output", None))
        _safely("prefill", _submit_finished, [req for req, *_ in jobs])
    return out


def around_decode(original, self, batch, result, *args, **kwargs):
    """`process_batch_result_decode` (around): take each sampled request's decode row."""
    jobs = _safely("decode", _decode_jobs, batch) or []
    out = original(self, batch, result, *args, **kwargs)
    if jobs:
        _safely("decode", _take, jobs, getattr(result, "logits_output", None))
        _safely("decode", _submit_finished, [req for req, *_ in jobs])
    return out


def _live(req) -> Rows | None:
    rows = getattr(req, "specbus_rows", None)
    if rows is None or req.finished() or getattr(req, "is_retracted", False):
        return None
    return rows


def _prefill_jobs(batch, result) -> list:
    """(req, rows, first position, row slice) of the sampled requests of an extend batch."""
    lens = getattr(result, "extend_input_len_per_req", None)
    if not getattr(batch, "return_hidden_states", False) or lens is None:
        return []
    prefix = getattr(batch, "prefix_lens", None)
    jobs = []
    for i, (req, rows_of) in enumerate(zip(batch.reqs, row_slices(list(lens)), strict=True)):
        rows = _live(req)
        if rows is not None:
            position = int(prefix[i]) if prefix is not None else rows.num_rows
            jobs.append((req, rows, position, rows_of))
    return jobs


def _decode_jobs(batch) -> list:
    """(req, rows, fed token's position, row slice) of the sampled requests of a decode batch."""
    jobs = []
    spec = getattr(batch, "spec_algorithm", None)
    speculative = spec is not None and not spec.is_none()
    for i, req in enumerate(batch.reqs):
        rows = _live(req)
        if rows is None:
            continue
        if speculative:
            rows.broken = "speculative decoding"
            continue
        position = len(req.origin_input_ids) + len(req.output_ids) - 1
        jobs.append((req, rows, position, slice(i, i + 1)))
    return jobs


def _take(jobs: list, logits_output) -> None:
    hidden = getattr(logits_output, "hidden_states", None)
    last = getattr(logits_output, "last_hidden_states", None)
    if hidden is None or getattr(logits_output, "hidden_states_token_indices", None) is not None:
        for _, rows, *_ in jobs:
            rows.broken = "no full aux hidden states in this forward"
        return
    index = torch.cat([torch.arange(s.start, s.stop) for *_, s in jobs]).to(hidden.device)
    # one device-to-host copy per forward for all sampled requests
    aux = hidden.index_select(0, index).to("cpu")
    final = last.index_select(0, index.to(last.device)).to("cpu") if last is not None else None
    start = 0
    for _, rows, position, s in jobs:
        n = s.stop - s.start
        rows.take(position, aux[start : start + n],
                  final[start : start + n] if final is not None else None)  # fmt: skip
        start += n


def _submit_finished(reqs: list) -> None:
    for req in reqs:
        rows = getattr(req, "specbus_rows", None)
        if rows is None or not (req.finished() or getattr(req, "is_retracted", False)):
            continue
        req.specbus_rows = None  # once; the rows go with the capture or are dropped
        submit(req, rows)


def submit(req, rows: Rows) -> bool:
    """Hand a finished request's rows to the sink; False (counted `layer_<why>`) when they are
    not whole, the request was retracted, or the server's layers are not the handshake's."""
    from specbus.producers.live.sink import Capture

    sink = STATE.sink
    if sink is None:
        return False
    output = list(req.output_ids)
    if getattr(req, "finished_len", None) is not None:
        output = output[: req.finished_len]
    why = "retracted" if getattr(req, "is_retracted", False) else ""
    why = why or rows.finish(len(req.origin_input_ids), len(output))
    cfg = sink.config
    if not why and cfg is not None and STATE.layer_ids and tuple(cfg.aux_layers) != STATE.layer_ids:
        why = "layer_mismatch"
        _warn_once(why, f"the server captures layers {list(STATE.layer_ids)} but the run's "
                   f"handshake asks for {list(cfg.aux_layers)}: captures are dropped; restart "
                   "the server with the command `specbus serve --engine sglang` prints")  # fmt: skip
    if why:
        sink._count("layer_" + why.split(":")[0].replace(" ", "_"))
        log.debug("capture of %s dropped: %s", rows.request_id, why)
        return False
    return sink.submit(Capture(request_id=rows.request_id, prompt_ids=list(req.origin_input_ids),
                               output_ids=output, aux=rows.aux, final=rows.final,
                               sample_id=rows.sample_id))  # fmt: skip


def _safely(where: str, fn, *args):
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - capture must never fail serving
        _fault(where, e)
        return None


def _fault(where: str, e: Exception) -> None:
    if STATE.sink is not None:
        STATE.sink._count("layer_error")
    _warn_once(f"fault:{where}", f"specbus capture layer ({where}) failed, serving goes on: {e!r}")


def _warn_once(key: str, message: str) -> None:
    if key not in STATE.warned:
        STATE.warned.add(key)
        log.error(message)
