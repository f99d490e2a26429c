"""The specbus capture layer for a stock SGLang server (docs/sglang.md).

Mechanism: an SGLang *general plugin* (the `sglang.srt.plugins` entry-point group SGLang
0.5.23 loads in every scheduler process) that hooks four methods through SGLang's own
`HookRegistry`; no SGLang file is changed. Upstream's capture-only aux mode
(`--enable-return-aux-hidden-states`) computes the rows; the hooks hand them to the
engine-agnostic `CaptureSink` instead of the JSON response.

- `rows.py`: per-request row bookkeeping (positions, gaps, prefix hits), no sglang import;
- `plugin.py`: the entry point, the hooks, the startup refusal, the sink of the server;
- `layer.py`: `specbus sglang apply|check|revert` (writes/removes the entry point's tiny
  distribution next to the installed SGLang; refuses another SGLang version by name).
"""

SGLANG_VERSION = "0.5.23"  # the one version the hooks were read against and tested on
# strategy -> SGLang's capture convention (`--speculative-algorithm` under aux capture; it
# picks the model's capture hook); the other strategies: DFLASH
CONVENTIONS = {"eagle3": "EAGLE3", "dspark": "DSPARK"}
