"""The capture sink: what a serving server calls to push captured requests into a live run.

Engine-agnostic: a server (`specbus serve` on the hf engine, an SGLang layer, ...) hands it
the rows it fed the target for one request, and the sink does the rest on its own writer
thread. The contract a server implements:

1. `sink.config` (None until the handshake with the intake succeeded; the sink retries it in
   the background) says which decoder layers to capture (`aux_layers`, 0-based outputs) and
   whether the final post-norm hidden state is needed (a feature with `source == "final"`).
2. Per request, `sink.wants(request_id)` -> the sample id, or None: a pure function of the
   request id and `sample_rate` (every TP rank of a server agrees; no state).
3. After the response is complete, `sink.submit(Capture(...))` with the prompt ids, the
   generated ids and the captured rows: one row per token fed, prefill and decode alike, so
   `prompt + output[:-1]` (the last generated token is never fed). Chunks are concatenated by
   the writer, off the request path. `submit` is a bounded, non-blocking enqueue: a full
   queue drops the capture. It never raises.

The writer thread, per capture: cut to `max_num_tokens` rows (the first ones: a causal
model's rows do not depend on later tokens), skip captures with fewer than `min_num_tokens`
generated rows, build the features the handshake declares (input ids, loss mask: generated
rows 1, prompt rows 0; aux and final rows in the handshake's dtype), `store.put`, then POST
the record. On 429 (shed), any 4xx/5xx, a timeout or an unreachable intake, the capture is
dropped and its keys removed. Every outcome is counted (`sink.counts`). A driven request
(`wire.driven_rid`, a `sglang_server` producer's task) is the task's prefill: its rows are
checked against the task the intake names and get the task's loss mask (`driven.py`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from specbus.producers.live.driven import TASKS_PATH, driven_tensors
from specbus.producers.live.wire import (
    CONFIG_PATH,
    RECORDS_PATH,
    CaptureConfig,
    CaptureRecord,
    capture_decision,
    driven_of,
    sample_id_of,
)

log = logging.getLogger("specbus.sink")

# A driven capture that meets a full store waits this long for room (below the producers'
# default `target.capture_wait_s` of 30 s, so that its answer still reaches them).
DRIVEN_ROOM_WAIT_S = 10.0

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
           "float64": torch.float64, "int64": torch.int64, "int32": torch.int32,
           "uint8": torch.uint8, "bool": torch.bool}  # fmt: skip


@dataclass
class Capture:
    """One request's rows. `aux`: chunks of `[T, len(aux_layers) * H]` (layer outputs in
    handshake order), `final`: chunks of `[T, H]` (or empty when not needed), in feeding
    order; their rows add up to at least `len(prompt_ids) + len(output_ids) - 1`."""

    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    aux: list[torch.Tensor]
    final: list[torch.Tensor] = field(default_factory=list)
    sample_id: str = ""
    draft_version: int | None = None  # speculative serving: the draft that served it


class CaptureSink:
    """The capture sink of one serving server (module doc): `intake_url` and `token` (or
    callables asked again at every handshake attempt); `server_id` and `engine` go into every
    record; `queue_size` captures wait for the writer thread at most (full: dropped);
    the handshake is retried every `handshake_retry_s` and refreshed every `refresh_s`;
    `open_store_fn(uri)` replaces `open_store` (tests); `verify`: TLS verification of an https
    intake (an `ssl.SSLContext`, or True for the system's CAs). Nothing on the server's side raises
    or blocks; every outcome is counted in `counts`."""

    def __init__(
        self,
        intake_url: str | Callable[[], str | None],
        token: str | Callable[[], str | None],
        *,
        server_id: str,
        engine: str,
        queue_size: int = 32,
        handshake_retry_s: float = 1.0,
        refresh_s: float = 30.0,
        open_store_fn=None,
        verify: Any = True,
    ):
        # a callable is asked again at every handshake attempt (an intake started later,
        # on the same host, writes both into its run dir)
        self._url_of = intake_url if callable(intake_url) else (lambda: intake_url)
        self._token_of = token if callable(token) else (lambda: token)
        self.intake_url = ""
        self.token = ""
        self.server_id, self.engine = server_id, engine
        self.handshake_retry_s, self.refresh_s = handshake_retry_s, refresh_s
        self.counts: Counter = Counter()
        self.config: CaptureConfig | None = None
        self.enabled = True  # an operator switch (the benchmark measures capture on vs off)
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._store = None
        self._open_store_fn = open_store_fn
        self._stop = threading.Event()
        self._client = None
        self._verify = verify  # TLS verification of an https intake (httpx's `verify`)
        self._fetched_at = 0.0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="specbus-capture-sink", daemon=True)

    # -- the server's side (never raises, never blocks) --------------------------------
    def start(self) -> CaptureSink:
        """Start the writer thread (it does the handshake); returns self."""
        self._thread.start()
        return self

    def wants(self, request_id: str) -> str | None:
        """The sample id when the request is to be captured (capture on, a handshake, sampled
        by its id: `wire.capture_decision`), else None. Never raises."""
        if not self.enabled:
            return None
        cfg = self.config
        if cfg is None:
            self._count("no_handshake")
            return None
        if not capture_decision(request_id, cfg.sample_rate):
            self._count("not_sampled")
            return None
        return sample_id_of(request_id)

    def submit(self, capture: Capture) -> bool:
        """Queue a finished request's rows for the writer (non-blocking); False when it is
        not taken (no handshake, too few generated rows, queue full). Never raises."""
        try:
            cfg = self.config
            if cfg is None:
                self._count("no_handshake")
                return False
            prompt, output = len(capture.prompt_ids), len(capture.output_ids)
            if driven_of(capture.request_id) is not None:  # a task's prefill: all rows count
                pass
            elif min(prompt + output - 1, cfg.max_num_tokens) - prompt < cfg.min_num_tokens:
                self._count("too_short")
                return False
            capture.sample_id = capture.sample_id or sample_id_of(capture.request_id)
            self._queue.put_nowait(capture)
            self._count("queued")
            return True
        except queue.Full:
            self._count("queue_full")
            return False
        except Exception as e:  # noqa: BLE001 - a capture must never fail a request
            self._count("error")
            log.warning("capture of %s not queued: %s", getattr(capture, "request_id", "?"), e)
            return False

    def close(self, timeout_s: float = 10.0) -> None:
        """Finish what is queued (up to `timeout_s`), then stop the writer and let go."""
        deadline = time.monotonic() + timeout_s
        while self._thread.is_alive() and not self._queue.empty() and time.monotonic() < deadline:
            time.sleep(0.02)
        self._stop.set()
        if self._thread.ident is not None:  # started
            self._thread.join(max(0.0, deadline - time.monotonic()) + 1.0)
        while True:  # anything left was never put: nothing to remove
            try:
                self._queue.get_nowait()
                self._count("dropped_at_close")
            except queue.Empty:
                break
        if self._client is not None:
            self._client.close()
        if self._store is not None:
            self._store.close(timeout_s=0)

    def idle(self) -> bool:
        """Nothing queued or being written."""
        return self._queue.unfinished_tasks == 0

    def _count(self, what: str, n: int = 1) -> None:
        with self._lock:
            self.counts[what] += n

    # -- the writer thread -------------------------------------------------------------
    def _http(self):
        if self._client is None:
            import httpx

            self._client = httpx.Client(
                timeout=httpx.Timeout(5.0), limits=httpx.Limits(max_connections=2),
                verify=self._verify,  # an https intake: its CA file, or the system's
            )  # fmt: skip
        self._client.headers["Authorization"] = f"Bearer {self.token}"
        return self._client

    def handshake(self) -> bool:
        """Fetch the handshake now (the writer thread does it by itself); True on success."""
        return self._handshake()

    @property
    def store(self):
        """The store handle of the handshake's `store_uri` (None before the handshake)."""
        return self._store

    def _handshake(self) -> bool:
        try:
            url, token = self._url_of(), self._token_of()
            if not url or not token:
                raise RuntimeError("no intake URL and token yet (is `specbus intake` running?)")
            self.intake_url, self.token = url.rstrip("/"), token
            resp = self._http().get(self.intake_url + CONFIG_PATH, timeout=5.0)
            if resp.status_code != 200:
                raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:200]}")
            cfg = CaptureConfig.model_validate_json(resp.content)
        except Exception as e:  # noqa: BLE001 - the intake may come later
            if self.config is None and not self.counts.get("handshake_failures"):
                log.warning("capture handshake with %s failed (retrying; requests are served "
                            "without capture meanwhile): %s", self.intake_url, e)  # fmt: skip
            self._count("handshake_failures")
            return False
        if self.config is None:
            log.info("capture handshake with %s: run %s, %s, layers %s, rate %g, store %s",
                     self.intake_url, cfg.run_id, cfg.strategy, list(cfg.aux_layers),
                     cfg.sample_rate, cfg.store_uri)  # fmt: skip
        if self.config is None or cfg.store_uri != self.config.store_uri:
            self._open(cfg)
        self.config = cfg
        self._fetched_at = time.monotonic()
        return True

    def _open(self, cfg: CaptureConfig) -> None:
        if self._open_store_fn is not None:
            store = self._open_store_fn(cfg.store_uri)
        else:
            from specbus.core.store import open_store

            store = open_store(cfg.store_uri, budget_bytes=cfg.store_budget_bytes, pool_bytes=0)
        if self._store is not None:
            self._store.close(timeout_s=0)
        self._store = store

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.config is None:
                if not self._handshake():
                    self._stop.wait(self.handshake_retry_s)
                continue
            try:
                capture = self._queue.get(timeout=0.2)
            except queue.Empty:
                if time.monotonic() - self._fetched_at > self.refresh_s:
                    self._handshake()  # limits/rate may change with an intake restart
                continue
            try:
                self._write(capture)
            except Exception as e:  # noqa: BLE001 - the writer must survive anything
                self._count("error")
                log.warning("capture %s failed: %s", capture.request_id, e)
            finally:
                self._queue.task_done()

    def tensors(self, capture: Capture, cfg: CaptureConfig) -> dict[str, torch.Tensor] | None:
        """The features of one capture as the handshake declares them (None: too short).
        Raises ValueError when the server's rows do not fit the handshake."""
        prompt, output = list(capture.prompt_ids), list(capture.output_ids)
        rows = min(len(prompt) + len(output) - 1, cfg.max_num_tokens)
        if rows - len(prompt) < cfg.min_num_tokens:
            return None
        ids = torch.tensor((prompt + output)[:rows], dtype=torch.long)
        mask = torch.zeros(rows, dtype=torch.long)
        mask[len(prompt) :] = 1
        sources: dict[str, Any] = {"input_ids": ids, "loss_mask": mask}
        for name, chunks in (("aux", capture.aux), ("final", capture.final)):
            if chunks:
                sources[name] = torch.cat([c.reshape(-1, c.shape[-1]) for c in chunks])[:rows]
        return self.features(sources, rows, cfg)

    @staticmethod
    def features(sources: dict, rows: int, cfg: CaptureConfig) -> dict[str, torch.Tensor]:
        """The handshake's features from their sources (ValueError when they do not fit)."""
        out = {}
        for decl in cfg.features:
            t = sources.get(decl.source)
            if t is None:
                raise ValueError(f"the server captured no {decl.source!r} rows for {decl.name!r}")
            t = t.to(_DTYPES[decl.dtype]).contiguous()
            if tuple(t.shape) != decl.resolve(rows):
                raise ValueError(f"{decl.name}: rows {tuple(t.shape)} != {decl.resolve(rows)}")
            out[decl.name] = t
        return out

    def _write(self, capture: Capture) -> None:
        from specbus.core.errors import StoreFull

        cfg = self.config
        driven = driven_of(capture.request_id)
        gen = 0
        if driven is not None:  # a producer's task (`driven.py`): its tokens, loss mask, generation
            task = self._task(driven[0])
            tensors = driven_tensors(capture, cfg, task, self.features)
            gen = int(task.get("generation", 0))
        else:
            tensors = self.tensors(capture, cfg)
        if tensors is None:
            self._count("too_short")
            return
        try:
            specs = self._put(capture.sample_id, tensors, gen, driven=driven is not None)
        except StoreFull:
            self._count("store_full")
            return
        except Exception as e:  # noqa: BLE001
            self._count("store_error")
            log.warning("capture %s: store put failed: %s", capture.request_id, e)
            return
        record = CaptureRecord(
            run_id=cfg.run_id, request_id=capture.request_id, sample_id=capture.sample_id,
            store_uri=cfg.store_uri, features=specs, num_tokens=rows_of(tensors, cfg),
            num_prompt_tokens=0 if driven else len(capture.prompt_ids),
            target_fingerprint=cfg.target_fingerprint,
            tokenizer_fingerprint=cfg.tokenizer_fingerprint,
            server_id=self.server_id, engine=self.engine, draft_version=capture.draft_version,
        )  # fmt: skip
        # without a draft version the record is the one every intake knows
        outcome = self._post(record.model_dump_json(exclude_none=True).encode(),
                             cfg.record_timeout_s)  # fmt: skip
        self._count(outcome)
        if outcome not in ("accepted", "duplicate"):
            self._drop(specs)

    def _put(self, sample_id: str, tensors: dict, gen: int, *, driven: bool) -> dict:
        """`store.put`. A full store drops a live capture at once (sampled traffic), while a
        driven one (a producer's task, leased while the producer waits for the intake's
        answer) waits up to `DRIVEN_ROOM_WAIT_S` for room: its producer would otherwise
        wait `target.capture_wait_s` for an answer that never comes, then drive it again."""
        from specbus.core.errors import StoreFull

        deadline, delay = time.monotonic() + (DRIVEN_ROOM_WAIT_S if driven else 0.0), 0.05
        while True:
            try:
                return self._store.put(sample_id, tensors, gen)
            except StoreFull:
                if time.monotonic() + delay > deadline:
                    raise
                time.sleep(delay)
                delay = min(delay * 2, 0.5)

    def _task(self, seq: int) -> dict:
        resp = self._http().get(f"{self.intake_url}{TASKS_PATH}/{seq}", timeout=10.0)
        if resp.status_code != 200:
            raise RuntimeError(f"task seq {seq}: HTTP {resp.status_code} {resp.text[:200]}")
        return resp.json()

    def _post(self, body: bytes, timeout_s: float) -> str:
        try:
            resp = self._http().post(
                self.intake_url + RECORDS_PATH, content=body, timeout=timeout_s,
                headers={"Content-Type": "application/json"},
            )  # fmt: skip
        except Exception as e:  # noqa: BLE001 - timeout, refused, reset
            if not self.counts.get("unreachable"):
                log.warning("intake %s unreachable, dropping captures meanwhile: %s",
                            self.intake_url, e)  # fmt: skip
            return "unreachable"
        if resp.status_code == 200:
            try:
                return resp.json().get("status", "accepted")
            except Exception:  # noqa: BLE001
                return "accepted"
        if resp.status_code == 429:
            return "shed"
        try:
            reason = resp.json().get("reason", "")
        except Exception:  # noqa: BLE001
            reason = ""
        if resp.status_code >= 500:
            return "unavailable"
        log.info("capture rejected by the intake: %s %s", resp.status_code, resp.text[:300])
        return f"rejected:{reason or resp.status_code}"

    def _drop(self, specs) -> None:
        try:
            self._store.release(specs)
            self._count("keys_removed")
        except Exception as e:  # noqa: BLE001 - the run's end sweep or purge gets it
            self._count("remove_failed")
            log.warning("could not remove the keys of a dropped capture: %s", e)


def rows_of(tensors: dict[str, torch.Tensor], cfg: CaptureConfig) -> int:
    """The rows of a capture: the first dimension of its first row-shaped feature."""
    for decl in cfg.features:
        if decl.shape and decl.shape[0] == "L":
            return int(tensors[decl.name].shape[0])
    raise ValueError("the handshake declares no row-shaped feature")
