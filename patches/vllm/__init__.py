"""The specbus capture layer for a stock vLLM server (docs/vllm.md).

Mechanism: vLLM's own hidden-state export. The `extract_hidden_states` speculative method
writes the hidden states of the layers named in its draft config into a cache-only KV-cache
layer (every token, prefill and decode alike); a KV-transfer *connector* loaded by module path
(`--kv-transfer-config '{"kv_connector": "SpecbusCaptureConnector",
"kv_connector_module_path": "specbus.patches.vllm.connector", ...}'`) reads them when a
request finishes. No vLLM file is changed and nothing is installed next to vLLM.

- `capture.py`: the layer's rules, no vllm import: the startup refusal, which requests are
  captured, the rows of a finished request out of the hidden-state cache, the capture handed
  to the engine-agnostic `CaptureSink`;
- `connector.py`: `SpecbusCaptureConnector`, the `KVConnectorBase_V1` subclass vLLM loads.

The pin, the connector's name and module path are in `producers/engines/pins.py` (shared with
the host side); `specbus vllm check` (the version and every vLLM name the connector uses, read
from the installed source; another vLLM version is refused by name) is `ops/vllm_layer.py`.
Nothing in the library imports this package (tests/test_architecture.py): vLLM loads it.
"""
