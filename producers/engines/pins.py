"""The serving engines' pins and names, shared by the code loaded inside an engine (`patches/`)
and the host side that starts, drives or checks one (`producers/engines/`, `ops/`).

It imports nothing and both sides import it: one value for each, and the host side needs
nothing from `patches/`, which no library module imports (tests/test_architecture.py).

- `SGLANG_VERSION`, `VLLM_VERSION`: the one version of each engine its capture layer was read
  against and tested on; every side refuses another by name (`specbus sglang check`,
  `specbus vllm check`, the plugin's and the connector's startup, the `sglang` engine);
- `CONVENTIONS`: specbus strategy -> SGLang's capture convention (`--speculative-algorithm`
  under aux capture, which picks the model's capture hook); any other strategy is `DFLASH`;
- `SGLANG_HOOKS`: the SGLang methods the plugin hooks (what `register` registers with
  SGLang's `HookRegistry`, what `specbus sglang apply` records);
- `PLUGIN_MODULE`, `CONNECTOR_MODULE`, `CONNECTOR`: what the engines load by name, the
  SGLang plugin (its `sglang.srt.plugins` entry point) and the vLLM KV connector (the
  server's `--kv-transfer-config`). Dotted-path strings, not imported modules: the engine
  imports them in its own process, and importing them here would import the engine (vLLM,
  SGLang) into every host that only writes a server command;
- `DRIVEN_PARAM`: the `kv_transfer_params` key under which a driving producer
  (`vllm_server.py`) sends its request id to the vLLM connector (`patches/vllm/capture.py`).
"""

SGLANG_VERSION = "0.5.23"
VLLM_VERSION = "0.33.0"

CONVENTIONS = {"eagle3": "EAGLE3", "dspark": "DSPARK"}

PLUGIN_MODULE = "specbus.patches.sglang.plugin"
CONNECTOR = "SpecbusCaptureConnector"
CONNECTOR_MODULE = "specbus.patches.vllm.connector"
DRIVEN_PARAM = "specbus_rid"

_RESULTS = "sglang.srt.managers.scheduler_components.batch_result_processor"
# (target, hook type, hook function of the plugin module)
SGLANG_HOOKS = (
    ("sglang.srt.managers.schedule_batch.Req.__init__", "AFTER", "on_request"),
    ("sglang.srt.managers.scheduler.Scheduler.__init__", "BEFORE", "before_scheduler"),
    ("sglang.srt.managers.scheduler.Scheduler.__init__", "AFTER", "after_scheduler"),
    (f"{_RESULTS}.SchedulerBatchResultProcessor.process_batch_result_prefill", "AROUND",
     "around_prefill"),
    (f"{_RESULTS}.SchedulerBatchResultProcessor.process_batch_result_decode", "AROUND",
     "around_decode"),
)  # fmt: skip
