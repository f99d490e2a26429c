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

from specbus.producers.engines.pins import DRIVEN_PARAM
from specbus.producers.engines.sglang_server import SGLangServerEngine

LAUNCH = ("start the server with the command `specbus serve --engine vllm --dry-run -c run.yaml` "
          "prints (the connector and extract_hidden_states settings, SPECBUS_CAPTURE_ENDPOINT or "
          "SPECBUS_CAPTURE_INTAKE_URL + SPECBUS_INTAKE_TOKEN)")  # fmt: skip


class VLLMServerEngine(SGLangServerEngine):
    """A running vLLM server as the target (module doc)."""

    name = "vllm_server"
    server = "vLLM"
    launch = LAUNCH

    def prefill_request(self, rid: str, input_ids: list[int]) -> tuple[str, dict]:
        """vLLM's OpenAI `/v1/completions` with the task's token ids as the prompt and the
        driven request id in `kv_transfer_params` (module doc)."""
        return "/v1/completions", {"prompt": list(input_ids), "max_tokens": 1, "temperature": 0,
                                   "kv_transfer_params": {DRIVEN_PARAM: rid}}  # fmt: skip
