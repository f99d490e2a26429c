"""The `vllm_server` target engine: driven capture through a running vLLM server with the
specbus capture connector (docs/vllm.md, "Driven capture").

As `sglang_server` (the same producer loop, `producers/driven.py`; the same intake outcome
protocol; the same errors), but the prefill is vLLM's OpenAI `POST /v1/completions` with the
task's exact token ids as the prompt, one greedy token, and the driven request id in
`kv_transfer_params` (`{"specbus_rid": "specbus-task:<seq>:<sample id>"}`): vLLM gives each
request an id of its own (a random suffix), so the connector names the capture by this
parameter (`pins.DRIVEN_PARAM`, read by `patches/vllm/capture.py`). `prompt + output[:-1]` is
then exactly the task's rows.
"""

from __future__ import annotations

import time

from specbus.core.errors import CaptureError
from specbus.producers.engines.pins import DRIVEN_PARAM
from specbus.producers.engines.sglang_server import ServerUnreachable, SGLangServerEngine

LAUNCH = ("start the server with the command `specbus serve --engine vllm --dry-run -c run.yaml` "
          "prints (the connector and extract_hidden_states settings, SPECBUS_CAPTURE_ENDPOINT or "
          "SPECBUS_CAPTURE_INTAKE_URL + SPECBUS_INTAKE_TOKEN)")  # fmt: skip


class VLLMServerEngine(SGLangServerEngine):
    """A running vLLM server as the target (module doc)."""

    name = "vllm_server"
    server = "vLLM"
    launch = LAUNCH

    def generate(self, rid: str, input_ids: list[int]) -> dict:
        """POST one prefill to `/v1/completions`; unreachable: retried with backoff, then
        `ServerUnreachable`. A 4xx answer is a `CaptureError` with the server's words."""
        import httpx

        body = {"prompt": list(input_ids), "max_tokens": 1, "temperature": 0,
                "kv_transfer_params": {DRIVEN_PARAM: rid}}  # fmt: skip
        deadline, delay, last = time.monotonic() + self.cfg.server_give_up_s, 0.2, None
        while True:
            try:
                resp = self._http.post(self.url + "/v1/completions", json=body)
            except httpx.TransportError as e:  # refused, reset, killed mid-request
                last = e
                self.retries += 1
            else:
                if resp.status_code == 200:
                    return resp.json()
                if resp.status_code < 500:
                    raise CaptureError(f"vLLM server {self.url} refused {rid}: HTTP "
                                       f"{resp.status_code} {resp.text[:300]}")  # fmt: skip
                last = RuntimeError(f"HTTP {resp.status_code} {resp.text[:200]}")
            if time.monotonic() + delay > deadline:
                raise ServerUnreachable(f"vLLM server {self.url} unreachable for "
                                        f"{self.cfg.server_give_up_s:g}s: {last!r}")  # fmt: skip
            time.sleep(delay)
            delay = min(delay * 2, 5.0)
