"""Driven capture through a serving server: the intake's and the sink's side of it.

A producer on `target.engine: sglang_server` (`producers/engines/sglang_server.py`) takes a
task from TASKS and sends its exact token ids to a running, layer-applied SGLang server as a
prefill (`max_new_tokens: 1`) under the request id `wire.driven_rid(task seq, sample id)`.
The layer always captures such an id; the capture sink then:
1. GETs the task from the intake (`GET /v1/spec-capture/tasks/<seq>`: its sample id, token ids
   and loss mask, read from the run's TASKS stream), and refuses a capture whose token ids are
   not the task's (`driven_tensors`): a request id alone cannot inject features;
2. puts the features (every row the task's, the task's loss mask) under the task's generation
   (a recapture task's is > 0: its keys never meet the lost generation's) and POSTs the record
   as for any capture. The intake publishes the SampleRef under the task's sample id and
   generation (dedup id = run + sample id + generation), with the task's id, TASKS sequence and
   epoch, and remembers its answer per request id (`DrivenBook`, the last `keep` ones);
3. the producer asks for that answer (`GET /v1/spec-capture/outcomes/<request id>?wait_s=
   &after=<n>`, `n`: the latest answer number before its request, so an earlier attempt's
   answer is never taken for this one's) and acks its task only once it is `accepted` or
   `duplicate`. The answers live in the intake's memory: an intake restarted meanwhile makes
   the producer time out and nak; the retry is deduplicated by the broker.
A retried request (a server killed mid-request, a producer killed before its ack) has the same
request id, so the same sample id and dedup id: the broker keeps one ref.
"""

import asyncio
import logging
import time
from collections import OrderedDict
from typing import Any

from specbus.core.contracts import PromptTask
from specbus.core.errors import BusError, RecordError
from specbus.producers.live.wire import (
    MAX_SEQ,
    CaptureConfig,
    RecordAnswer,
    driven_of,
    parse_seconds,
    parse_seq,
    parse_uint,
)

log = logging.getLogger("specbus.intake")

TASKS_PATH = "/v1/spec-capture/tasks"
OUTCOMES_PATH = "/v1/spec-capture/outcomes"
MAX_WAIT_S = 60.0  # an outcome's long poll waits at most this long


def task_sample_id(task: PromptTask) -> str:
    """The sample id of a task in its epoch (the same as `producers.capture.sample_id_of`)."""
    return f"{task.task_id}-e{task.epoch}"


def driven_tensors(capture, cfg: CaptureConfig, task: dict, build) -> dict:
    """The features of a driven capture: rows = the task's tokens (the prefill), the task's loss
    mask; `build(sources, rows, cfg)` makes them as the handshake declares. Raises ValueError when
    the request is not the task's."""
    import torch

    ids = list(capture.prompt_ids)
    if task["sample_id"] != capture.sample_id or list(task["input_ids"]) != ids:
        raise ValueError(f"driven request {capture.request_id}: its tokens are not the task's")
    rows = len(ids)
    mask = task.get("loss_mask") or [1] * rows
    sources: dict[str, Any] = {"input_ids": torch.tensor(ids, dtype=torch.long),
                               "loss_mask": torch.tensor(mask, dtype=torch.long)}  # fmt: skip
    for name, chunks in (("aux", capture.aux), ("final", capture.final)):
        if chunks:
            sources[name] = torch.cat([c.reshape(-1, c.shape[-1]) for c in chunks])[:rows]
    return build(sources, rows, cfg)


class DrivenBook:
    """The intake's view of driven captures: tasks by TASKS sequence (cached) and the answers
    to driven records by request id (the last `keep`)."""

    def __init__(self, run, keep: int = 1 << 16):
        self.run, self.keep = run, keep
        self._tasks: OrderedDict[int, PromptTask] = OrderedDict()
        self.answers: OrderedDict[str, tuple[int, RecordAnswer, int]] = OrderedDict()
        self._n = 0  # answers noted so far: an answer's number orders it against a retry

    async def task(self, seq: int) -> PromptTask | None:
        """The task at TASKS `seq` (1 .. `MAX_SEQ`; None once it is gone, or when what is
        stored there is not a task). Raises the broker's `BusError`."""
        task = self._tasks.get(seq)
        if task is None:
            stored = await self.run.task(seq)
            if stored is None:
                return None
            try:
                task = PromptTask.from_bytes(stored.data)
            except RecordError as e:  # not the feeder's: no task a capture can claim
                log.warning("TASKS seq %d is not a task (%s): %s", seq, e.reason, e)
                return None
            self._tasks[seq] = task
            while len(self._tasks) > 1024:
                self._tasks.popitem(last=False)
        return task

    def note(self, request_id: str, code: int, answer: RecordAnswer) -> None:
        """Remember the answer to a driven record (others are ignored)."""
        if driven_of(request_id) is None:
            return
        self._n += 1
        self.answers[request_id] = (code, answer, self._n)
        self.answers.move_to_end(request_id)
        while len(self.answers) > self.keep:
            self.answers.popitem(last=False)

    async def wait(self, request_id: str, wait_s: float, after: int = 0):
        """(code, answer, number) of the latest answer to `request_id`'s record numbered above
        `after` (an earlier attempt's answer is not this one's), waiting up to `wait_s`."""
        deadline = time.monotonic() + max(0.0, min(wait_s, MAX_WAIT_S))
        while True:
            got = self.answers.get(request_id)
            if got is not None and got[2] <= after:
                got = None
            if got is not None or time.monotonic() >= deadline:
                return got
            await asyncio.sleep(0.05)


def record_generation(rec) -> int:
    """The generation a record's keys are stored under (the sink puts a driven capture under
    its task's); `ValueError` if its features disagree."""
    from specbus.core.store.base import parse_key

    gens = {parse_key(spec.key).gen for spec in rec.features.values()}
    if len(gens) != 1:
        raise ValueError(f"{rec.request_id}: features of generations {sorted(gens)}")
    return gens.pop()


async def check_driven(book: DrivenBook, rec, reject) -> PromptTask:
    """The task a driven record claims to be, checked (`reject(reason, detail)` -> exception):
    its sample id, and the generation its keys were stored under (a recapture task's > 0)."""
    seq, sample_id = driven_of(rec.request_id)
    task = await book.task(seq)
    if task is None:
        raise reject("driven", f"no task at TASKS seq {seq}")
    gen = record_generation(rec)
    if task_sample_id(task) != sample_id or task.generation != gen:
        raise reject("driven", f"TASKS seq {seq} is {task_sample_id(task)} generation "
                     f"{task.generation}, the record says {sample_id} generation {gen}")  # fmt: skip
    if rec.num_tokens != len(task.input_ids or ()) or rec.num_prompt_tokens != 0:
        raise reject("driven", f"{rec.num_tokens} rows, the task has {len(task.input_ids or ())}")
    return task


def add_routes(app, intake, unauthorized) -> None:
    """`GET TASKS_PATH/<seq>` (for sinks) and `GET OUTCOMES_PATH/<request id>` (for producers).
    Ids and numbers are parsed strictly (`wire.parse_seq`, `parse_uint`, `parse_seconds`: 400
    `bad_seq` / `bad_after` / `bad_wait_s`); a task not (or no longer) on TASKS is a 404
    `not_found`; the broker's errors are 503s (`refusals.bus_refusal`), and so is a lookup
    the broker does not answer within `live.publish_timeout_s` (`broker_unavailable`)."""
    # here, not at the top: producers import this module for its names, and a producer host
    # (the GPU machine) need not have the intake's web stack; the annotations are evaluated
    # here (no postponed annotations in this module), so FastAPI sees the real `Request`
    from fastapi import Request
    from fastapi.responses import JSONResponse
    from specbus.producers.live.refusals import Rejection, bus_refusal, rejected, unavailable

    def refuse(r: Rejection, **extra) -> JSONResponse:
        intake.metrics.count(r.code, r.reason)
        return JSONResponse({**r.answer().model_dump(), **extra}, status_code=r.code)

    @app.get(TASKS_PATH + "/{seq}")
    async def task(seq: str, request: Request):
        if not intake.authorized(request.headers.get("authorization")):
            return unauthorized()
        n = parse_seq(seq)
        if n is None:
            return refuse(rejected("bad_seq", f"{seq[:40]!r} is not a TASKS sequence "
                                   f"(ASCII digits, 1 .. {MAX_SEQ})", 400))  # fmt: skip
        timeout_s = intake.cfg.live.publish_timeout_s
        try:
            found = await asyncio.wait_for(intake.driven.task(n), timeout_s)
        except asyncio.TimeoutError:
            return refuse(unavailable("broker_unavailable", f"TASKS seq {n} not read within "
                                      f"live.publish_timeout_s={timeout_s:g}s"))  # fmt: skip
        except BusError as e:
            return refuse(bus_refusal(e))
        if found is None:
            return refuse(rejected("not_found", f"no task at seq {n}", 404))
        return JSONResponse({"sample_id": task_sample_id(found), "generation": found.generation,
                             "input_ids": list(found.input_ids or ()),
                             "loss_mask": list(found.loss_mask or ())})  # fmt: skip

    @app.get(OUTCOMES_PATH + "/{request_id}")
    async def outcome(request_id: str, request: Request):
        if not intake.authorized(request.headers.get("authorization")):
            return unauthorized()
        query = request.query_params
        wait_s = parse_seconds(query.get("wait_s", "0"))
        after = parse_uint(query.get("after", "0"))
        if wait_s is None:
            return refuse(rejected("bad_wait_s", "wait_s: seconds, e.g. 2.5 (at most "
                                   f"{MAX_WAIT_S:g} are waited)", 400))  # fmt: skip
        if after is None:
            return refuse(rejected("bad_after", f"after: an answer number, 0 .. {MAX_SEQ}", 400))
        got = await intake.driven.wait(request_id, wait_s, after)
        if got is None:
            return JSONResponse({"status": "rejected", "reason": "not_found",
                                 "detail": f"no record of {request_id} yet",
                                 "latest": intake.driven._n}, status_code=404)  # fmt: skip
        code, answer, n = got
        return JSONResponse({"code": code, "n": n, **answer.model_dump()})
