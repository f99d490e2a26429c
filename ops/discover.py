"""Which broker a command talks to, said in one line, and what it does when none answers.

`find_broker(args, cfg)` (no connection made) picks, in order:
1. `--url`, else `bus.url`: the broker named;
2. this run's broker: the `specbus up` holding the run's store dir (`<run_dir>/nats`) now,
   else one started with this very config file (and run) on another `--store-dir`; when none
   runs but one did (`<run_dir>/nats/url`), that one, known to be stopped;
3. only for a run that never had a broker of its own: the machine's shared broker, a plain
   `specbus up` (no config: the default run, one node, no auth) announced on this machine.
Any other broker running here (another run's `specbus up`, a cluster) is never used unless
named: it may be someone else's, and a run's streams belong on one broker. Those are listed
when a command finds no broker, with the `--url` that would use them.

`broker_url(args, cfg)` logs the pick and why (WARNING for the shared broker: the run's
streams go there), then makes sure it answers. When it does not (a broker known stopped, a
named URL nobody listens on) the command says so at once, naming what it tried and the
`specbus up` that starts it, and then either fails (`SpecbusError`, exit 2) or waits for it
with a line every `PROGRESS_S` until `bus.connect_give_up_s`. It waits when asked to
(`--wait`) or when the URL was named (a broker elsewhere that may be restarting: a process
started during an outage waits, as `bus.connection` does); a discovered broker that is not
running fails fast, since nothing says one is coming.

A run's own broker's store dir (`broker_dir`) and what a `specbus up` announces
(`about_broker`: its run and config, whether it is the shared broker) are defined here, where
they are read; ops/up.py and ops/cluster_up.py lock and announce with them.
"""

from __future__ import annotations

import argparse
import logging
import socket
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specbus.core.config import RunConfig
from specbus.core.errors import SpecbusError

log = logging.getLogger("specbus")

PROBE_TIMEOUT_S = 2.0  # a TCP connect to a named broker (loopback refusals answer at once)
POLL_S = 0.5
PROGRESS_S = 15.0


@dataclass
class Found:
    """The broker a command uses (`url` None: none found) and why (`source`, `why`);
    `running` True/False when known from its store dir's lock, None for a named URL (probed);
    `store_dir` for this run's own broker; `others`: brokers running here, not used."""

    url: str | None
    source: str  # "--url", "bus.url", "own", "shared", "none"
    why: str
    running: bool | None = None
    store_dir: Path | None = None
    others: list[dict[str, Any]] = field(default_factory=list)


def describe(record: dict[str, Any]) -> str:
    """An announced broker for people: its URL, what started it, for which run."""
    nodes = record.get("nodes", 1)
    how = "specbus up" + (f" --cluster {nodes}" if nodes > 1 else "")
    how += " --auth" if record.get("auth") else ""
    what = "the machine's shared broker" if record.get("shared") else f"run {record.get('run')!r}"
    return (
        f"{record['url']} (`{how}` of {what}, pid {record.get('pid')}, "
        f"store dir {record.get('store_dir')})"
    )


def broker_dir(cfg: RunConfig) -> Path:
    """The embedded broker's store dir of a run (`<run_dir>/nats`)."""
    return cfg.resolved_run_dir / "nats"


def about_broker(args: argparse.Namespace, cfg: RunConfig, nodes: int = 1) -> dict[str, Any]:
    """What a broker `specbus up` starts serves, for its announcement: the run and config it
    was started for; `shared` for a plain `specbus up` (no config, the default run, one node,
    no auth or TLS): the machine's broker that commands of a run with no broker of its own
    use (`find_broker`). Any other broker serves its own run only."""
    secured = bool(getattr(args, "auth", None) or getattr(args, "tls", None))
    return {
        "run": cfg.run,
        "config": str(Path(args.config).resolve()) if args.config else None,
        "nodes": nodes,
        "auth": bool(getattr(args, "auth", None)),
        "tls": bool(getattr(args, "tls", None)),
        "shared": args.config is None and cfg.run == "default" and nodes == 1 and not secured,
    }


def find_broker(args: argparse.Namespace, cfg: RunConfig) -> Found:
    """The broker this command uses (see the module doc); no connection is made."""
    from specbus.ops.services.nats import URL_FILE, announced, running_url

    if getattr(args, "url", None):
        return Found(args.url, "--url", "given with --url")
    if cfg.bus.url:
        return Found(cfg.bus.url, "bus.url", "the config's bus.url")
    own = broker_dir(cfg).resolve()
    others = [r for r in announced() if Path(r["store_dir"]) != own]
    if url := running_url(own):
        return Found(url, "own", f"this run's broker: `specbus up` on {own}", True, own, others)
    config = str(Path(args.config).resolve()) if getattr(args, "config", None) else None
    mine = [r for r in others if config and r.get("config") == config and r.get("run") == cfg.run]
    if mine:  # started with this very config file, on another store dir (`--store-dir`)
        pick = mine[-1]
        why = f"this run's broker: `specbus up --config {args.config}` on {pick['store_dir']}"
        rest = [r for r in others if r is not pick]
        return Found(pick["url"], "own", why, True, Path(pick["store_dir"]), rest)
    try:
        last = (own / URL_FILE).read_text().strip()
    except OSError:
        last = None
    if last:  # the run had a broker of its own: never another one in its place
        why = f"this run's broker (`specbus up` on {own}), which is not running"
        return Found(last, "own", why, False, own, others)
    shared = [r for r in others if r.get("shared")]
    if shared:
        pick = shared[-1]
        rest = [r for r in others if r is not pick]
        why = (
            f"the machine's shared broker, a plain `specbus up` (pid {pick.get('pid')}, store "
            f"dir {pick['store_dir']}): run {cfg.run!r} has no broker of its own, so its "
            "streams go there"
        )
        return Found(pick["url"], "shared", why, True, None, rest)
    return Found(None, "none", f"run {cfg.run!r} has no broker", None, own, others)


def up_command(args: argparse.Namespace) -> str:
    """The `specbus up` that starts this command's run's broker."""
    words = ["specbus up"]
    if getattr(args, "config", None):
        words.append(f"--config {args.config}")
    words += [w for w in getattr(args, "overrides", []) if w.split("=", 1)[0] in ("run", "run_dir")]
    return " ".join(words)


def _not_used(found: Found) -> str:
    if not found.others:
        return ""
    listed = "; ".join(describe(r) for r in found.others)
    return f". Running on this machine but not this run's (pass --url to use one): {listed}"


def no_broker(found: Found, args: argparse.Namespace, cfg: RunConfig, error: str = "") -> str:
    """What was tried and how to get a broker, for the message a command fails or waits with."""
    if found.url is None:
        head = f"no broker for run {cfg.run!r}: start one with `{up_command(args)}` (it prints its URL), or pass --url"
    elif found.source == "own":
        head = (
            f"the broker of run {cfg.run!r} is not running (it listened at {found.url}; store "
            f"dir {found.store_dir}): start it again with `{up_command(args)}`"
        )
    else:
        head = (
            f"no broker answers at {found.url} ({found.why}{': ' + error if error else ''}): "
            f"start one there (`{up_command(args)}` on that host prints its URL) or fix the URL"
        )
    return head + _not_used(found)


def probe(url: str, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """None when one of `url`'s servers accepts a TCP connection, else the last refusal."""
    error = "no server in the URL"
    for server in (u.strip() for u in url.split(",")):
        if not server:
            continue
        parts = urllib.parse.urlsplit(server if "://" in server else f"nats://{server}")
        try:
            socket.create_connection((parts.hostname, parts.port or 4222), timeout_s).close()
            return None
        except OSError as e:
            error = f"{type(e).__name__}: {e}"
    return error


def _answers(found: Found) -> tuple[str | None, str | None]:
    """(the URL to use, the reason it cannot be used yet: None when it can)."""
    if found.running is None:  # named: is anything listening there?
        error = probe(found.url)
        return found.url, error
    if found.running:
        return found.url, None
    from specbus.ops.services.nats import running_url

    url = running_url(found.store_dir)  # this run's broker started again (maybe elsewhere)
    return (url, None) if url else (found.url, "not running")


def wants_wait(args: argparse.Namespace, cfg: RunConfig, found: Found) -> bool:
    """Whether a broker that does not answer is waited for (module doc). An explicit
    `bus.connect_give_up_s` is no sign: configs written by `dump_config` carry every field."""
    return bool(getattr(args, "wait", False)) or found.source in ("--url", "bus.url")


def broker_url(args: argparse.Namespace, cfg: RunConfig) -> str:
    """The URL of the broker this command uses, once it answers (module doc). Raises
    `SpecbusError` when there is none, or it does not answer and waiting was not asked for
    (or `bus.connect_give_up_s` passed)."""
    found = find_broker(args, cfg)
    if found.url is None:
        raise SpecbusError(no_broker(found, args, cfg))
    url, error = _answers(found)
    if error is None:
        level = logging.WARNING if found.source == "shared" else logging.INFO
        log.log(level, "run %s: broker %s: %s", cfg.run, url, found.why)
        return url
    message = no_broker(found, args, cfg, error)
    if not wants_wait(args, cfg, found):
        raise SpecbusError(f"{message} (or pass --wait to wait for it)")
    give_up_s = cfg.bus.connect_give_up_s
    started = time.monotonic()
    until = time.strftime("%H:%M:%S", time.localtime(time.time() + give_up_s))
    log.warning("%s; waiting for it until %s (bus.connect_give_up_s=%g; Ctrl-C to stop)",
                message, until, give_up_s)  # fmt: skip
    said = started
    while True:
        time.sleep(POLL_S)
        url, error = _answers(found)
        waited = time.monotonic() - started
        if error is None:
            log.warning("run %s: broker %s answers after %.0f s", cfg.run, url, waited)
            return url
        if waited >= give_up_s:
            raise SpecbusError(f"{message}; waited {waited:.0f} s (bus.connect_give_up_s)")
        if time.monotonic() - said >= PROGRESS_S:
            said = time.monotonic()
            log.warning("run %s: still no broker at %s after %.0f s (%s); waiting until %s",
                        cfg.run, found.url, waited, error, until)  # fmt: skip
