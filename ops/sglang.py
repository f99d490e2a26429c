"""SGLang commands: `specbus sglang apply|check|revert` and `specbus serve --engine sglang`.

- `apply|check|revert [--site DIR]`: the capture layer of `ops/sglang_layer.py` on the
  SGLang installed in this interpreter (or in `--site`).
- `specbus serve --engine sglang -c run.yaml`: prints the exact command that starts a stock
  SGLang server capturing for the run (upstream aux-capture flags with the run's layer ids and
  convention, `--disable-radix-cache`, and the environment that points the plugin at the
  intake: its URL or `<run_dir>/live/intake.json`, the sample rate), then execs it; with
  `--dry-run` it only prints. Starting refuses when the layer is not applied. With
  `--speculative` the server also decodes speculatively with the run's exported draft
  (`--draft-dir`, default `<run_dir>/export`, written by `specbus export`): SGLang's own
  speculative flags for the strategy (`speculative_flags`; docs/sglang.md, "Serving the
  draft": how a new draft reaches a running server).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specbus.core.config import RunConfig
from specbus.core.errors import ConfigError
from specbus.ops.engine_launch import capture_environment, exec_server, print_command
from specbus.producers.engines.pins import CONVENTIONS


def draft_dir_of(cfg: RunConfig, draft_dir: str | Path | None = None) -> Path:
    """Where the run's exported draft is: `draft_dir`, else `<run_dir>/export`."""
    return Path(draft_dir) if draft_dir else cfg.resolved_run_dir / "export"


def speculative_flags(cfg: RunConfig, draft_dir: Path, num_draft_tokens: int = 3) -> list[str]:
    """SGLang 0.5.23's flags that decode with the exported draft in `draft_dir`: EAGLE3, a
    chain of `num_draft_tokens` (topk 1, so verification is a chain as in `specbus serve`);
    DFLASH (dflash, domino) with the strategy's block size; DSPARK (block size from the
    draft's config). The algorithm flag itself is in `server_command`."""
    flags = ["--speculative-draft-model-path", str(draft_dir)]
    if cfg.strategy.name == "eagle3":
        return flags + ["--speculative-num-steps", str(num_draft_tokens),
                        "--speculative-eagle-topk", "1",
                        "--speculative-num-draft-tokens", str(num_draft_tokens + 1)]  # fmt: skip
    if cfg.strategy.name in ("dflash", "domino"):
        return flags + ["--speculative-dflash-block-size", str(cfg.strategy.block_size)]
    return flags


def server_command(cfg: RunConfig, *, intake_url: str | None = None, host: str | None = None,
                   port: int | None = None, speculative: bool = False,
                   draft_dir: str | Path | None = None,
                   num_draft_tokens: int = 3) -> tuple[dict[str, str], list[str]]:  # fmt: skip
    """(environment, argv) of the SGLang server that captures for `cfg` (module doc); with
    `speculative`, decoding with the exported draft (`speculative_flags`)."""
    from specbus.core.models.target import load_target_info, resolve_target_dir

    model = resolve_target_dir(cfg.target.model)
    info = load_target_info(model, name=cfg.target.model)
    contract = cfg.strategy.build(info, aux_layers=cfg.target.aux_layers).feature_contract(info)
    argv = [
        sys.executable, "-m", "sglang.launch_server", "--model-path", str(model),
        "--host", host or cfg.live.serve_host, "--port", str(port or cfg.live.serve_port),
        "--tp-size", str(cfg.target.tp_size),
        "--enable-return-aux-hidden-states",
        "--speculative-algorithm", CONVENTIONS.get(contract.strategy, "DFLASH"),
        "--return-aux-hidden-state-layer-ids", *map(str, contract.aux_layers),
        "--disable-radix-cache",
    ]  # fmt: skip
    if cfg.target.dtype != "auto":
        argv += ["--dtype", cfg.target.dtype]
    if speculative:
        argv += speculative_flags(cfg, draft_dir_of(cfg, draft_dir), num_draft_tokens)
    env = capture_environment(cfg, sample_rate=cfg.live.sample_rate, intake_url=intake_url)
    return env, argv


def run_sglang_serve(cfg: RunConfig, *, intake_url: str | None, token: str | None,
                     host: str | None, port: int | None, dry_run: bool,
                     speculative: bool = False, draft_dir: str | None = None,
                     num_draft_tokens: int = 3) -> int:  # fmt: skip
    """`specbus serve --engine sglang` (module doc). Returns the exit code (or execs)."""
    from specbus.ops import sglang_layer as layer

    env, argv = server_command(cfg, intake_url=intake_url, host=host, port=port,
                               speculative=speculative, draft_dir=draft_dir,
                               num_draft_tokens=num_draft_tokens)  # fmt: skip
    print_command(cfg, env, argv, token)
    if dry_run:
        return 0
    if speculative and not (draft_dir_of(cfg, draft_dir) / "config.json").exists():
        raise ConfigError(f"no exported draft in {draft_dir_of(cfg, draft_dir)}: write one with "
                          f"`specbus export -c <run.yaml> --out DIR` (then --draft-dir DIR)")  # fmt: skip
    state = layer.check()
    if not state["ok"]:
        raise ConfigError("the SGLang capture layer is not ready: " + "; ".join(state["problems"]))
    exec_server(argv[0], argv, env, cfg, token)
    return 0  # pragma: no cover - execve does not return


def cmd_sglang(args: argparse.Namespace) -> int:
    """`specbus sglang apply|check|revert`."""
    from specbus.ops import sglang_layer as layer

    site = Path(args.site) if args.site else None
    if args.action == "apply":
        print(json.dumps(layer.apply(site), indent=1))
        return 0
    if args.action == "revert":
        removed = layer.revert(site)
        print(f"removed {len(removed)} files" + ("" if removed else " (the layer was not applied)"))
        return 0
    state = layer.check(site)
    print(json.dumps(state, indent=1))
    return 0 if state["ok"] else 1


def add_sglang_commands(sub: argparse._SubParsersAction) -> None:
    """Register `sglang` (a registrar of `ops/cli.py`); `serve --engine sglang` is in ops/live.py."""
    p = sub.add_parser("sglang", help="the SGLang capture layer: apply, check or revert it")
    p.add_argument("action", choices=["apply", "check", "revert"])
    p.add_argument("--site", default=None, help="site-packages holding SGLang (default: here)")
    p.set_defaults(func=cmd_sglang)
