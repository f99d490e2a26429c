"""The `sglang_server` target engine: driven capture through a running, layer-applied SGLang server.

No forward runs here and SGLang need not be installed on the producer's host. For each task
(`drive`), the engine POSTs the task's exact token ids to the server's native `/generate`
(`{"input_ids", "rid": wire.driven_rid(TASKS seq, sample id), "sampling_params":
{"max_new_tokens": 1, "temperature": 0}}`: a prefill and one sampled token, no decode step).
The capture layer in the server always captures a driven rid; its sink stores the rows and
tells the intake, which publishes the SampleRef under the task's sample id
(`producers/live/driven.py`). The engine then asks the intake for its answer, and the task is
acked (`producers/driven.py`) only when that is `accepted` or `duplicate`.

Errors: an unreachable server is retried with backoff for `target.server_give_up_s`, then
`ServerUnreachable` names the URL; a server that answered but whose capture the intake never
heard of within `target.capture_wait_s` raises `LayerNotApplied` (names `specbus sglang apply`
and the launch variables); a server started with the radix cache on does not start at all
(the layer refuses it). `capture()` (the in-process protocol) refuses: there are no tensors here.
"""

from __future__ import annotations

import time

from specbus.core.config import TargetConfig
from specbus.core.errors import CaptureError, ConfigError
from specbus.producers.live.driven import OUTCOMES_PATH, task_sample_id
from specbus.producers.live.wire import CONFIG_PATH, driven_rid

LAUNCH = ("`specbus sglang apply` in the server's environment, then start it with "
          "SPECBUS_CAPTURE_ENDPOINT (or SPECBUS_CAPTURE_INTAKE_URL + SPECBUS_INTAKE_TOKEN) as "
          "`specbus serve --engine sglang --dry-run -c run.yaml` prints")  # fmt: skip


class ServerUnreachable(CaptureError):
    """The SGLang server did not answer within `target.server_give_up_s` (names the URL)."""


class LayerNotApplied(CaptureError):
    """The server answered but its capture never reached the intake (names the command)."""


class Shed(CaptureError):
    """The intake shed or could not publish the capture (retry later)."""


class Unheard(CaptureError):
    """The server answered, but the intake never heard of this capture within
    `target.capture_wait_s` though it heard of earlier ones: the server's sink dropped it
    (its queue full, the store full, or the capture failed there)."""


class SGLangServerEngine:
    """A running SGLang server as the target (module doc). `intake_url` / `token`: the run's
    intake (its outcomes); the fingerprints come from the intake's handshake."""

    name = "sglang_server"
    server = "SGLang"  # in messages
    launch = LAUNCH  # how to start the server with capture on (named by `LayerNotApplied`)

    def __init__(self, cfg: TargetConfig, *, intake_url: str | None = None,
                 token: str | None = None, **_):  # fmt: skip
        if not cfg.server_url:
            raise ConfigError(f"target.engine={self.name} needs target.server_url (the running "
                              f"{self.server} server, e.g. http://127.0.0.1:30000)")  # fmt: skip
        if not intake_url or not token:
            raise ConfigError(f"target.engine={self.name} needs the run's intake (live.url and "
                              "its token, or `specbus intake` running on this run dir)")  # fmt: skip
        import httpx

        self.cfg, self.url = cfg, cfg.server_url.rstrip("/")
        self.intake_url, self.token = intake_url.rstrip("/"), token
        self._http = httpx.Client(timeout=httpx.Timeout(10.0, read=600.0))
        self._heard = False  # the intake has answered one of our captures
        self.retries = 0  # prefills that found the server unreachable and were sent again
        self.info, self.tokenizer = None, None
        self.target_fingerprint = self.tokenizer_fingerprint = ""
        hand = self._intake("GET", CONFIG_PATH).json()
        self.target_fingerprint = hand["target_fingerprint"]
        self.tokenizer_fingerprint = hand["tokenizer_fingerprint"]

    def _intake(self, method: str, path: str, **kw):
        resp = self._http.request(method, self.intake_url + path,
                                  headers={"Authorization": f"Bearer {self.token}"}, **kw)  # fmt: skip
        if resp.status_code not in (200, 404):
            raise CaptureError(f"intake {self.intake_url}{path}: HTTP {resp.status_code} "
                               f"{resp.text[:200]}")  # fmt: skip
        return resp

    def prefill_request(self, rid: str, input_ids: list[int]) -> tuple[str, dict]:
        """(path, JSON body) of the one-token greedy prefill of `input_ids` named `rid`:
        SGLang's native `/generate` with the rid as the request id."""
        return "/generate", {"input_ids": list(input_ids), "rid": rid,
                             "sampling_params": {"max_new_tokens": 1, "temperature": 0}}  # fmt: skip

    def generate(self, rid: str, input_ids: list[int]) -> dict:
        """POST one prefill (`prefill_request`); unreachable: retried with backoff, then
        `ServerUnreachable`. A 4xx answer is a `CaptureError` with the server's words."""
        import httpx

        path, body = self.prefill_request(rid, input_ids)
        deadline, delay, last = time.monotonic() + self.cfg.server_give_up_s, 0.2, None
        while True:
            try:
                resp = self._http.post(self.url + path, json=body)
            except httpx.TransportError as e:  # refused, reset, killed mid-request
                last = e
                self.retries += 1
            else:
                if resp.status_code == 200:
                    return resp.json()
                if resp.status_code < 500:
                    raise CaptureError(f"{self.server} server {self.url} refused {rid}: HTTP "
                                       f"{resp.status_code} {resp.text[:300]}")  # fmt: skip
                last = RuntimeError(f"HTTP {resp.status_code} {resp.text[:200]}")
            if time.monotonic() + delay > deadline:
                raise ServerUnreachable(f"{self.server} server {self.url} unreachable for "
                                        f"{self.cfg.server_give_up_s:g}s: {last!r}")  # fmt: skip
            time.sleep(delay)
            delay = min(delay * 2, 5.0)

    def drive(self, task_seq: int, task) -> dict:
        """Capture one task through the server; returns the intake's answer (accepted or
        duplicate). Raises `ServerUnreachable`, `LayerNotApplied`, `Shed` or `CaptureError`."""
        if task.input_ids is None:
            raise CaptureError(f"task {task.task_id} has no input_ids (the feeder tokenises)")
        rid = driven_rid(task_seq, task_sample_id(task))
        before = self._intake("GET", f"{OUTCOMES_PATH}/{rid}").json()
        if before.get("status") in ("accepted", "duplicate"):  # an earlier attempt's ref is out
            return before
        after = before.get("n", before.get("latest", 0))  # only an answer to this attempt counts
        self.generate(rid, list(task.input_ids))
        deadline = time.monotonic() + self.cfg.capture_wait_s
        while True:  # the sink writes after the response: wait for the intake's answer
            left = deadline - time.monotonic()
            resp = self._intake("GET", f"{OUTCOMES_PATH}/{rid}", params={"wait_s": max(0, min(left, 10)), "after": after},
                                timeout=min(left, 10) + 10)  # fmt: skip
            if resp.status_code == 200:
                break
            if time.monotonic() >= deadline:
                raise self._unheard(rid)
        answer = resp.json()
        self._heard = True
        if answer["status"] in ("accepted", "duplicate"):
            return answer
        if answer["code"] in (429, 503):
            raise Shed(f"intake {answer['status']} {rid}: {answer['reason']} {answer['detail']}")
        raise CaptureError(f"intake rejected {rid}: {answer['reason']}: {answer['detail']}")

    def _unheard(self, rid: str) -> CaptureError:
        where = f"{self.server} server {self.url} answered {rid}, but the intake {self.intake_url}"
        if self._heard:
            return Unheard(f"{where} did not hear of its capture within "
                           f"{self.cfg.capture_wait_s:g}s (sink queue full or store full?)")  # fmt: skip
        return LayerNotApplied(f"{where} never heard of its capture within "
                               f"{self.cfg.capture_wait_s:g}s: is the capture layer applied and "
                               f"on? {self.launch}")  # fmt: skip

    def capture(self, input_ids, loss_masks, contract, *, device=None):
        """Refused: a server's features go through its capture layer (`drive`)."""
        raise CaptureError(f"target.engine={self.name} captures through the server's layer: "
                           "run it with `specbus produce` (producers/driven.py), not capture()")  # fmt: skip

    def close(self) -> None:
        """Let the HTTP client go; idempotent."""
        self._http.close()
