"""vLLM commands: `specbus vllm check` and `specbus serve --engine vllm`.

- `check [--site DIR]`: the installed vLLM against the connector's pin and every vLLM name it
  uses (`ops/vllm_layer.py`); exit 1 with the problems named.
- `specbus serve --engine vllm -c run.yaml`: prints the stock `vllm serve` command that
  captures for the run, then execs it (`--dry-run`: only prints). The command: the run's
  target, `--speculative-config` with the `extract_hidden_states` method and the run's layers
  in vLLM's ids (specbus's aux layer `a` is vLLM's `a + 1`; a final feature adds the last
  layer, `num_layers`), `--kv-transfer-config` naming the specbus connector by module path,
  `--no-enable-prefix-caching`, `--no-enable-chunked-prefill` with `--max-num-batched-tokens`
  at the context length, and the environment pointing the connector at the intake (its URL or
  `<run_dir>/live/intake.json`) with the sample rate: the run's `live.sample_rate`, or 0 for a
  driven run (`target.engine: vllm_server`: only the producer's requests are captured).
  Starting refuses when `specbus vllm check` does not pass.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from specbus.core.config import RunConfig
from specbus.core.errors import ConfigError
from specbus.ops.engine_launch import capture_environment, exec_server, print_command
from specbus.producers.engines.pins import CONNECTOR, CONNECTOR_MODULE, VLLM_VERSION


def server_command(cfg: RunConfig, *, intake_url: str | None = None, host: str | None = None,
                   port: int | None = None) -> tuple[dict[str, str], list[str]]:  # fmt: skip
    """(environment, argv) of the vLLM server that captures for `cfg` (module doc)."""
    from specbus.core.export.speculators import vllm_layer_ids
    from specbus.core.models.target import load_target_info, resolve_target_dir
    from specbus.ops.intake_endpoint import is_driven

    model = resolve_target_dir(cfg.target.model)
    info = load_target_info(model, name=cfg.target.model)
    contract = cfg.strategy.build(info, aux_layers=cfg.target.aux_layers).feature_contract(info)
    layer_ids = vllm_layer_ids(contract.aux_layers)
    if contract.final_feature is not None:
        layer_ids.append(info.num_layers)  # the last layer's output, normed by the connector
    # vLLM captures each layer once, in ascending order (it sorts the set), and sizes the cache
    # by the list: the list must be that set
    layer_ids = sorted(set(layer_ids))
    spec = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layer_ids}},
    }
    kv = {"kv_connector": CONNECTOR, "kv_connector_module_path": CONNECTOR_MODULE,
          "kv_role": "kv_producer"}  # fmt: skip
    context = cfg.target.context_length or info.max_position_embeddings
    argv = [
        "vllm", "serve", str(model),
        "--host", host or cfg.live.serve_host, "--port", str(port or cfg.live.serve_port),
        "--tensor-parallel-size", str(cfg.target.tp_size),
        "--max-model-len", str(context), "--max-num-batched-tokens", str(context),
        "--no-enable-prefix-caching", "--no-enable-chunked-prefill",
        "--speculative-config", json.dumps(spec, separators=(",", ":")),
        "--kv-transfer-config", json.dumps(kv, separators=(",", ":")),
    ]  # fmt: skip
    if cfg.target.dtype != "auto":
        argv += ["--dtype", cfg.target.dtype]
    rate = 0.0 if is_driven(cfg) else cfg.live.sample_rate
    env = capture_environment(cfg, sample_rate=rate, intake_url=intake_url)
    return env, argv


def run_vllm_serve(cfg: RunConfig, *, intake_url: str | None, token: str | None,
                   host: str | None, port: int | None, dry_run: bool) -> int:  # fmt: skip
    """`specbus serve --engine vllm` (module doc). Returns the exit code (or execs)."""
    from specbus.ops import vllm_layer as layer

    env, argv = server_command(cfg, intake_url=intake_url, host=host, port=port)
    print_command(cfg, env, argv, token)
    if dry_run:
        return 0
    state = layer.check()
    if not state["ok"]:
        raise ConfigError(
            "the vLLM capture connector cannot run here: " + "; ".join(state["problems"])
        )
    exe = shutil.which("vllm")
    if exe is None:
        raise ConfigError(f"no `vllm` command on PATH (pip install vllm=={VLLM_VERSION})")
    exec_server(exe, argv, env, cfg, token)
    return 0  # pragma: no cover - execve does not return


def cmd_vllm(args: argparse.Namespace) -> int:
    """`specbus vllm check`."""
    from specbus.ops import vllm_layer as layer

    state = layer.check(Path(args.site) if args.site else None)
    print(json.dumps(state, indent=1))
    return 0 if state["ok"] else 1


def add_vllm_commands(sub: argparse._SubParsersAction) -> None:
    """Register `vllm` (a registrar of `ops/cli.py`); `serve --engine vllm` is in ops/live.py."""
    p = sub.add_parser("vllm", help="the vLLM capture connector: check the installed vLLM")
    p.add_argument("action", choices=["check"])
    p.add_argument("--site", default=None, help="site-packages holding vLLM (default: here)")
    p.set_defaults(func=cmd_vllm)
