"""What every `specbus` subcommand shares: its run-config arguments and the broker it talks to.

A registrar (ops/cli.py `REGISTRARS`) adds `add_common`'s arguments to each subcommand that
takes the run config; its `func` reads them back with `config_of` (the run config plus the
dotted overrides `ops/cli.py`'s `main` merged) and `resolve_url` (the broker, ops/discover.py).
"""

from __future__ import annotations

import argparse

from specbus.core.config import RunConfig, load_config


def add_common(p: argparse.ArgumentParser) -> None:
    """--config, --url, -o and positional key=value overrides (merged by ops/cli.py `main`)."""
    p.add_argument("--config", "-c", default=None, help="run config YAML")
    p.add_argument(
        "--url",
        default=None,
        help="broker URL (default: bus.url, else this run's `specbus up`, else the machine's "
        "shared one: a plain `specbus up`; never another run's)",
    )
    p.add_argument(
        "--wait",
        action="store_true",
        help="when no broker answers, wait for one (up to bus.connect_give_up_s, 120 s) "
        "instead of failing at once (a named --url / bus.url is always waited for)",
    )
    p.add_argument(
        "-o",
        "--set",
        dest="set_overrides",
        action="append",
        default=[],
        metavar="key=value",
        help="dotted config override (repeatable)",
    )
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")


def config_of(args: argparse.Namespace) -> RunConfig:
    """The run config of a subcommand: `--config` plus its dotted overrides (`ConfigError` names a bad
    key)."""
    return load_config(args.config, args.overrides)


def resolve_url(args: argparse.Namespace, cfg: RunConfig) -> str:
    """The broker of this command, once it answers: `--url`, else `bus.url`, else this run's
    broker (the `specbus up` on its run dir), else the machine's shared broker (a plain
    `specbus up`), never another run's; one line says which and why. With none, or one that
    does not answer, it says so at once and fails (`SpecbusError`) or, when asked to
    (`--wait`, a named URL), waits for it. See `ops/discover.py`."""
    from specbus.ops.discover import broker_url

    return broker_url(args, cfg)
