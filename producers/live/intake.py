"""The live intake: capture records from serving servers -> SampleRefs on the run's SAMPLES.

HTTP (FastAPI on uvicorn; the composition is `ops/live.py`, `specbus intake`):

- `GET /v1/spec-capture/config`: the handshake (`wire.CaptureConfig`, from the run manifest).
- `POST /v1/spec-capture/records`: one `wire.CaptureRecord`. In order:
  1. bearer token (401 `unauthenticated`), body size (413 `oversize`), JSON (400 `garbage`),
     schema version (400 `schema`), fields (422 `invalid`);
  2. the record against the handshake (422): `wrong_run`, `wrong_store`, `fingerprint`,
     `sample_id` (not the request id's), `too_short` / `too_long` (rows), `features` (names,
     shapes, dtypes, byte sizes, keys of another sample or store);
  3. shed (429): the trainers' lag (bytes, or refs with `live.max_lag_refs`) or the store's
     residency at `live.shed_watermark` of `min(store.budget_bytes, capacity)`, or more than
     `live.max_inflight` records in work. User traffic cannot be paused: the sink drops the
     capture and removes its keys;
  4. the store holds every key at its spec's size (`store.adopt`; 422 `missing_keys` /
     `integrity`; 503 `store_unavailable`);
  5. publish the SampleRef (dedup id = run + sample id + generation, 0 or a driven task's, so
     a re-POSTed record is stored once: 200 `duplicate`), bounded by `live.publish_timeout_s` (503
     `broker_unavailable` past it: the sink gives up later than that, `record_timeout_s`);
  6. 200 `accepted` with the stream sequence.
  Every answer is a `wire.RecordAnswer` (`status`, `reason`, `detail`) and is counted; on
  every route a 4xx is the request's fault, a 503 the broker's or the store's, and no other
  5xx is answered on purpose (`producers/live/refusals.py`).
- driven capture (`producers/live/driven.py`): `GET /v1/spec-capture/tasks/<seq>` (a task for
  the sink), `GET /v1/spec-capture/outcomes/<request id>?wait_s=` (the answer, for the producer);
  a driven record's ref carries its task's id, TASKS sequence and epoch.
- `GET /metrics`: Prometheus text: records by HTTP status and reason, the shed inputs (lag,
  residency), records/s; `GET /healthz`: liveness, no auth (readiness for scripts and tests).

The shed inputs are polled in the background (`poll_s`); records accepted since the last
poll are added to the lag, so a burst cannot run past the watermark between two polls.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import math
import time
from collections import Counter
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import ValidationError
from specbus.bus.run import RunBus
from specbus.core.config import RunConfig
from specbus.core.contracts import Provenance, SampleRef
from specbus.core.errors import (
    BusError,
    FeatureMissing,
    IntegrityError,
    RecordError,
    StoreDenied,
    StoreError,
    StoreUnavailable,
)
from specbus.core.prometheus import Metrics
from specbus.core.store.base import parse_key
from specbus.producers.live.driven import DrivenBook, add_routes, check_driven, record_generation
from specbus.producers.live.refusals import (
    Rejection,
    add_handlers,
    bus_refusal,
    rejected,
    store_refusal,
    unavailable,
)
from specbus.producers.live.wire import (
    CAPTURE_SCHEMA_VERSION,
    CONFIG_PATH,
    RECORDS_PATH,
    CaptureConfig,
    CaptureRecord,
    RecordAnswer,
    driven_of,
    is_reserved,
    parse_uint,
    sample_id_of,
)

log = logging.getLogger("specbus.intake")

_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8, "int64": 8, "int32": 4,
             "uint8": 1, "bool": 1}  # fmt: skip


@dataclass
class ShedInputs:
    """What the shed decision reads: the trainers' lag, the store's residency and budget (as
    of `polled_at`), and what was accepted since that poll."""

    lag_bytes: int = 0
    lag_refs: int = 0
    resident_bytes: int = 0
    budget_bytes: int = 0
    accepted_bytes_since: int = 0  # accepted since the last poll (added to the lag)
    accepted_since: int = 0
    polled_at: float = 0.0
    error: str = ""


@dataclass
class IntakeMetrics:
    """Every answer counted by (HTTP status, reason)."""

    answers: Counter = field(default_factory=Counter)  # (http code, reason) -> count
    started: float = field(default_factory=time.monotonic)

    def count(self, code: int, reason: str) -> None:
        """Count one answer."""
        self.answers[(code, reason)] += 1

    def total(self, code: int | None = None, reason: str | None = None) -> int:
        """Answers of `code` and/or `reason` (None: any)."""
        return sum(n for (c, r), n in self.answers.items()
                   if (code is None or c == code) and (reason is None or r == reason))  # fmt: skip


class Intake:
    """Validates capture records and publishes their SampleRefs (see module doc).

    `run`: the run's `RunBus` (its publisher, the trainers' lag); `store`: the run's store,
    held open by the intake; `capture`: the handshake it serves; `token`: the bearer token;
    `poll_s`: how often the shed inputs are read; `driven_only`: a driven run's intake (records
    of serving traffic are refused, 422 `driven`)."""

    def __init__(self, cfg: RunConfig, run: RunBus, store, capture: CaptureConfig, token: str,
                 *, poll_s: float = 0.25, driven_only: bool = False):  # fmt: skip
        self.cfg, self.run, self.store, self.capture = cfg, run, store, capture
        self.driven_only = driven_only
        self.token = token
        self.poll_s = poll_s
        self.metrics = IntakeMetrics()
        self._prom: Metrics | None = None  # the /metrics registry, made at the first scrape
        self.shed = ShedInputs(budget_bytes=cfg.store.budget_bytes)
        self._inflight = self._inflight_bytes = 0
        self._accepted_total = self._accepted_bytes_total = 0
        self.driven = DrivenBook(run)  # driven captures (`producers/live/driven.py`)
        self._decls = {d.name: d for d in capture.features}
        self._poller: asyncio.Task | None = None

    # -- lifecycle ---------------------------------------------------------------------
    async def start(self) -> None:
        """Read the shed inputs once, then keep polling them in the background."""
        await self._poll()
        self._poller = asyncio.create_task(self._poll_forever())

    async def stop(self) -> None:
        """Stop polling (the run's store and bus are the caller's to close)."""
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._poller

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            await self._poll()

    async def _poll(self) -> None:
        """Refresh the shed inputs: the trainers' lag (bytes, refs) and the store's usage.
        Records accepted after the reads began may be missing from them: they stay counted
        (conservative: a record accepted meanwhile may count twice, never zero times)."""
        snap_refs, snap_bytes = self._accepted_total, self._accepted_bytes_total
        try:
            usage = await asyncio.to_thread(self.store.usage)
            budget = self.cfg.store.budget_bytes
            if usage.capacity_bytes:
                budget = min(budget, usage.capacity_bytes)
            current = await asyncio.wait_for(self.run.lag(), timeout=5.0)
        except Exception as e:  # noqa: BLE001 - an outage: keep the last view, say so once
            if not self.shed.error:
                log.warning("cannot read the shed inputs (keeping the last ones): %s", e)
            self.shed.error = str(e) or type(e).__name__
            return
        if self.shed.error:
            log.info("shed inputs readable again")
        self.shed = ShedInputs(
            lag_bytes=current.bytes, lag_refs=current.messages,
            resident_bytes=usage.resident_bytes, budget_bytes=budget, polled_at=time.monotonic(),
            accepted_since=self._accepted_total - snap_refs,
            accepted_bytes_since=self._accepted_bytes_total - snap_bytes,
        )  # fmt: skip

    # -- the record path ---------------------------------------------------------------
    def authorized(self, header: str | None) -> bool:
        """Whether an `Authorization` header carries the bearer token (constant time)."""
        if not header or not header.startswith("Bearer "):
            return False
        return hmac.compare_digest(header[7:].strip().encode(), self.token.encode())

    def parse(self, body: bytes) -> CaptureRecord:
        """A POSTed body as a `CaptureRecord`; raises `Rejection` (413 oversize, 400 garbage
        or schema, 422 invalid)."""
        if len(body) > self.capture.max_record_bytes:
            raise rejected("oversize", f"{len(body)} bytes > {self.capture.max_record_bytes}", 413)
        try:
            import orjson

            obj = orjson.loads(body)
        except Exception as e:  # noqa: BLE001 - any decode failure is garbage
            raise rejected("garbage", f"not JSON: {e}", 400) from None
        if not isinstance(obj, dict):
            raise rejected("garbage", f"a record is a JSON object, not {type(obj).__name__}", 400)
        if obj.get("schema_version") != CAPTURE_SCHEMA_VERSION:
            raise rejected("schema", f"schema_version {obj.get('schema_version')!r} is not "
                           f"{CAPTURE_SCHEMA_VERSION} (GET {CONFIG_PATH})", 400)  # fmt: skip
        try:
            return CaptureRecord.model_validate_json(body)
        except ValidationError as e:
            err = e.errors()[0]
            loc = ".".join(str(p) for p in err["loc"]) or "<record>"
            raise rejected("invalid", f"{loc}: {err['msg']}") from None

    def check(self, rec: CaptureRecord) -> None:
        """The record against the handshake (no I/O). Raises `Rejection`."""
        cap = self.capture
        if rec.run_id != cap.run_id:
            raise rejected(
                "wrong_run", f"record of run {rec.run_id!r}, this intake serves {cap.run_id!r}"
            )
        if rec.store_uri != cap.store_uri:
            raise rejected(
                "wrong_store", f"store {rec.store_uri!r}, the handshake says {cap.store_uri!r}"
            )
        if (rec.target_fingerprint, rec.tokenizer_fingerprint) != (
            cap.target_fingerprint, cap.tokenizer_fingerprint,
        ):  # fmt: skip
            raise rejected("fingerprint", f"target/tokenizer {rec.target_fingerprint}/"
                           f"{rec.tokenizer_fingerprint} != {cap.target_fingerprint}/{cap.tokenizer_fingerprint}")  # fmt: skip
        if rec.sample_id != sample_id_of(rec.request_id):
            raise rejected(
                "sample_id",
                f"{rec.sample_id!r} is not the request id's ({sample_id_of(rec.request_id)})",
            )
        if driven_of(rec.request_id) is not None:  # a task's prefill: `driven.check_driven`
            pass
        elif is_reserved(rec.request_id):
            raise rejected("driven", f"{rec.request_id[:80]!r} has the driven prefix but no "
                           "TASKS sequence (1 .. 2^63-1) and task sample id")  # fmt: skip
        elif self.driven_only:
            raise rejected("driven", f"{rec.request_id} is not a task's request: a driven run "
                           "trains its tasks only")  # fmt: skip
        elif rec.num_generated < cap.min_num_tokens:
            raise rejected(
                "too_short",
                f"{rec.num_generated} generated rows < min_num_tokens {cap.min_num_tokens}",
            )
        elif rec.num_tokens > cap.max_num_tokens:
            raise rejected("too_long", f"sample {rec.sample_id} has {rec.num_tokens} rows, over the run's "
                           f"maximum of {cap.max_num_tokens} (max_num_tokens: live.max_num_tokens, "
                           "else data.max_length)")  # fmt: skip
        if set(rec.features) != set(self._decls):
            raise rejected(
                "features",
                f"features {sorted(rec.features)}, the handshake says {sorted(self._decls)}",
            )
        # a live capture is generation 0; a driven one is its task's (a recapture task's is
        # > 0: `check_driven` compares it with the task), the same for every feature
        gen = 0
        if driven_of(rec.request_id) is not None:
            try:
                gen = record_generation(rec)
            except (ValueError, StoreError) as e:
                raise rejected("features", str(e)) from None
        for name, spec in rec.features.items():
            decl = self._decls[name]
            want = decl.resolve(rec.num_tokens)
            if spec.name != name or tuple(spec.shape) != want or spec.dtype != decl.dtype:
                raise rejected("features", f"{name}: {spec.name} {tuple(spec.shape)} "
                               f"{spec.dtype}, expected {name} {want} {decl.dtype}")  # fmt: skip
            if spec.nbytes != math.prod(want) * _ITEMSIZE[spec.dtype]:
                raise rejected(
                    "features", f"{name}: nbytes {spec.nbytes} != {math.prod(want)} x {spec.dtype}"
                )
            try:
                parts = parse_key(spec.key, cap.store_id)
            except StoreError as e:
                raise rejected("features", f"{name}: {e}") from None
            if (parts.sample_id, parts.gen, parts.name) != (rec.sample_id, gen, name):
                raise rejected("features", f"{name}: key {spec.key!r} is not "
                               f"{rec.sample_id}/g{gen}/{name}")  # fmt: skip

    def over_watermark(self) -> str | None:
        """The reason to shed now, or None."""
        s, live = self.shed, self.cfg.live
        limit = live.shed_watermark * s.budget_bytes
        if s.resident_bytes >= limit:
            return "store_residency"
        # records in work count as if accepted: concurrent records cannot all pass the mark
        if s.lag_bytes + s.accepted_bytes_since + self._inflight_bytes >= limit:
            return "trainers_lag"
        refs = s.lag_refs + s.accepted_since + self._inflight
        if live.max_lag_refs is not None and refs >= live.max_lag_refs:
            return "trainers_lag"
        return None

    async def handle(self, body: bytes, authorization: str | None) -> tuple[int, RecordAnswer]:
        """One POSTed record -> (HTTP status, answer); counted."""
        try:
            code, answer = 200, await self._handle(body, authorization)
        except Rejection as r:
            code, answer = r.code, r.answer()
        except Exception as e:  # noqa: BLE001 - a bug must not take the service down
            log.exception("record failed")
            code, answer = (
                500,
                RecordAnswer(status="unavailable", reason="internal", detail=str(e)[:300]),
            )
        self.metrics.count(code, answer.reason)
        return code, answer

    async def _handle(self, body: bytes, authorization: str | None) -> RecordAnswer:
        if not self.authorized(authorization):
            raise Rejection(401, "rejected", "unauthenticated", "a bearer token is required")
        rec = self.parse(body)
        try:
            answer = await self._checked(rec)
        except Rejection as r:
            self.driven.note(rec.request_id, r.code, r.answer())
            raise
        self.driven.note(rec.request_id, 200, answer)
        return answer

    async def _checked(self, rec: CaptureRecord) -> RecordAnswer:
        self.check(rec)
        why = self.over_watermark()
        if why is None and self._inflight >= self.cfg.live.max_inflight:
            why = "inflight"
        if why is not None:
            raise Rejection(429, "shed", why, self._shed_detail())
        nbytes = sum(s.nbytes for s in rec.features.values())
        self._inflight += 1
        self._inflight_bytes += nbytes
        try:
            return await asyncio.wait_for(self._admit(rec), self.cfg.live.publish_timeout_s)
        except asyncio.TimeoutError:
            raise unavailable(
                "broker_unavailable", f"not published within {self.cfg.live.publish_timeout_s}s"
            ) from None
        finally:
            self._inflight -= 1
            self._inflight_bytes -= nbytes

    async def _admit(self, rec: CaptureRecord) -> RecordAnswer:
        try:
            await asyncio.to_thread(self.store.adopt, rec.features)
        except FeatureMissing as e:
            raise rejected("missing_keys", f"not in {self.capture.store_uri}: {e}") from None
        except IntegrityError as e:
            raise rejected("integrity", str(e)) from None
        except (StoreUnavailable, StoreDenied, OSError) as e:  # the store's, not the record's
            raise store_refusal(e) from None
        except StoreError as e:
            raise rejected("features", str(e)) from None
        nbytes = sum(s.nbytes for s in rec.features.values())
        task_id, task_seq, epoch = f"live:{rec.request_id}", 0, 0
        generation = 0
        if driven_of(rec.request_id) is not None:
            try:
                task = await check_driven(self.driven, rec, rejected)
            except BusError as e:
                raise bus_refusal(e) from None
            task_id, task_seq, epoch = task.task_id, driven_of(rec.request_id)[0], task.epoch
            generation = task.generation
        ref = SampleRef(
            sample_id=rec.sample_id, run_id=rec.run_id, task_id=task_id, generation=generation,
            task_seq=task_seq, epoch=epoch, store_uri=rec.store_uri, features=rec.features, nbytes=nbytes,
            num_tokens=rec.num_tokens, strategy=self.capture.strategy,
            target_fingerprint=rec.target_fingerprint,
            tokenizer_fingerprint=rec.tokenizer_fingerprint,
            provenance=Provenance(producer_id=rec.server_id, engine=rec.engine,
                                  created_at=rec.created_at),
        )  # fmt: skip
        try:
            ack = await self.run.publisher.publish(self.run.names.samples, ref)
        except RecordError as e:
            raise rejected("oversize", str(e), 413) from None
        except BusError as e:
            raise bus_refusal(e) from None
        if ack.duplicate:
            return RecordAnswer(status="duplicate", reason="duplicate", seq=ack.seq)
        self.shed.accepted_bytes_since += nbytes
        self.shed.accepted_since += 1
        self._accepted_total += 1
        self._accepted_bytes_total += nbytes
        return RecordAnswer(status="accepted", reason="accepted", seq=ack.seq)

    def _shed_detail(self) -> str:
        s = self.shed
        return (f"trainers lag {s.lag_refs} refs / {s.lag_bytes + s.accepted_bytes_since} bytes, "
                f"store {s.resident_bytes} bytes, watermark {self.cfg.live.shed_watermark:g} x "
                f"{s.budget_bytes} bytes, {self._inflight} in work")  # fmt: skip

    # -- metrics -----------------------------------------------------------------------
    def prometheus(self) -> str:
        """`GET /metrics`: the answers, the shed inputs and records/s in Prometheus text
        (`core.prometheus.Metrics`, with the process's own `process_*` series)."""
        if self._prom is None:
            self._prom = self._registry()
        return self._prom.exposition()[0].decode()

    def _registry(self) -> Metrics:
        from prometheus_client import ProcessCollector

        m, s = self.metrics, self.shed
        prom = Metrics()
        ProcessCollector(registry=prom.registry)
        prom.read("specbus_intake_records", "Capture records answered, by HTTP status and reason.",
                  lambda: {(str(c), r): n for (c, r), n in sorted(m.answers.items())},
                  kind="counter", labels=("code", "reason"))  # fmt: skip

        def uptime() -> float:
            return max(time.monotonic() - m.started, 1e-9)

        def shed() -> int:
            return sum(n for (c, _), n in m.answers.items() if c == 429)

        gauges = {
            "specbus_intake_accepted_per_second": lambda: m.total(200, "accepted") / uptime(),
            "specbus_intake_shed_ratio": lambda: shed() / max(m.total(200, "accepted") + shed(), 1),
            "specbus_intake_trainers_lag_bytes": lambda: s.lag_bytes + s.accepted_bytes_since,
            "specbus_intake_trainers_lag_refs": lambda: s.lag_refs + s.accepted_since,
            "specbus_intake_store_resident_bytes": lambda: s.resident_bytes,
            "specbus_intake_store_budget_bytes": lambda: s.budget_bytes,
            "specbus_intake_inflight": lambda: self._inflight,
        }
        for name, read in gauges.items():
            prom.read(name, name.removeprefix("specbus_intake_").replace("_", " "), read)
        return prom


def build_app(intake: Intake):
    """The intake's FastAPI app (routes in the module doc)."""
    app = FastAPI(title="specbus intake", docs_url=None, redoc_url=None, openapi_url=None)

    def unauthorized() -> Response:
        intake.metrics.count(401, "unauthenticated")
        return JSONResponse(
            RecordAnswer(status="rejected", reason="unauthenticated",
                         detail="a bearer token is required").model_dump(),
            status_code=401, headers={"WWW-Authenticate": "Bearer"},
        )  # fmt: skip

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"ok": True, "run": intake.cfg.run}

    @app.get(CONFIG_PATH)
    async def config(request: Request) -> Response:
        if not intake.authorized(request.headers.get("authorization")):
            return unauthorized()
        intake.metrics.count(200, "config")
        return JSONResponse(intake.capture.model_dump(mode="json"))

    @app.post(RECORDS_PATH)
    async def records(request: Request) -> Response:
        if not intake.authorized(request.headers.get("authorization")):
            return unauthorized()
        limit = intake.capture.max_record_bytes
        declared = request.headers.get("content-length")
        size = parse_uint(declared)  # strict: h11 checks it, another server may not
        if size is not None and size > limit:
            intake.metrics.count(413, "oversize")
            return JSONResponse(
                RecordAnswer(status="rejected", reason="oversize",
                             detail=f"{declared} bytes > {limit}").model_dump(), status_code=413,
            )  # fmt: skip
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                intake.metrics.count(413, "oversize")
                return JSONResponse(
                    RecordAnswer(status="rejected", reason="oversize",
                                 detail=f"more than {limit} bytes").model_dump(), status_code=413,
                )  # fmt: skip
        code, answer = await intake.handle(bytes(body), request.headers.get("authorization"))
        headers = {"Retry-After": "1"} if code == 429 else None
        return JSONResponse(answer.model_dump(), status_code=code, headers=headers)

    add_routes(app, intake, unauthorized)  # driven capture (`producers/live/driven.py`)

    add_handlers(app, intake.metrics)  # a broker error no route mapped: 503; a bug: JSON 500

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        if not intake.authorized(request.headers.get("authorization")):
            return unauthorized()
        return PlainTextResponse(intake.prometheus())

    return app
