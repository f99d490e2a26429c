"""The specbus capture layer for a stock SGLang server (docs/sglang.md).

Mechanism: an SGLang *general plugin* (the `sglang.srt.plugins` entry-point group SGLang
0.5.23 loads in every scheduler process) that hooks four methods through SGLang's own
`HookRegistry`; no SGLang file is changed. Upstream's capture-only aux mode
(`--enable-return-aux-hidden-states`) computes the rows; the hooks hand them to the
engine-agnostic `CaptureSink` instead of the JSON response.

- `rows.py`: per-request row bookkeeping (positions, gaps, prefix hits), no sglang import;
- `plugin.py`: the entry point, the hooks, the startup refusal, the sink of the server.

The pin, the hooked methods and the plugin's module path are in `producers/engines/pins.py`
(shared with the host side); `specbus sglang apply|check|revert`, which writes/removes the
entry point's tiny distribution next to the installed SGLang, is `ops/sglang_layer.py`.
Nothing in the library imports this package (tests/test_architecture.py): SGLang loads it.
"""
