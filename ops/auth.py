"""Roles as NATS users, one NATS account per run: `specbus auth --out DIR`.

Every process of a run connects as one role, an NKey user (public-key auth: the server's
config holds only public keys, each process signs the server's nonce with its seed file):

| role | may |
|---|---|
| feeder | publish TASKS, write the run KV's manifest and feed-complete keys, read TASKS back |
| producer | consume TASKS (group "producers": pull, ack), publish SAMPLES and TASKS dead letters |
| trainer | consume SAMPLES (group "trainers": pull, ack, reset to a sequence), read SAMPLES back (direct get), dead-letter SAMPLES, republish a task for a recapture, write the checkpoint pointer, train-complete, progress and world keys |
| colocated | a trainer that captures its own tasks: the trainer's rights plus consuming TASKS (and resetting "producers": its resume) |
| intake | publish SAMPLES, write the run KV's manifest (live mode: the intake writes it, there is no feeder), read TASKS (a driven run's tasks) |
| observer | read-only: stream/consumer info, single messages and batches (direct get) of TASKS, SAMPLES and DEAD, the KV (`specbus status`, `specbus dead`) |
| admin | everything within its run (`specbus up` declares the run's streams, consumers and KV with it) |

Isolation is the server's (docs/cluster.md, "Isolation model"):
- between runs, by accounts: each run is a NATS account of its own (`SPECBUS_<run>`, JetStream
  enabled, no exports or imports), holding every user of the run, its admin included. A
  subject means nothing across accounts: whatever a role of one run publishes, or has the
  server deliver (a push consumer's deliver subject included), stays in that run's account.
- within a run, by subject permissions (allow lists; all else is refused): no role but the
  admin may create, update or delete a consumer (so none can pick a deliver subject): replays
  read by direct get, the trainers' reposition resets the durable "trainers" in place
  (`$JS.API.CONSUMER.RESET`, nats-server >= 2.14); a role subscribes to its own reply inbox
  only (`_INBOX.<run>.<role>.>`, set as `bus.inbox_prefix`), so it cannot read another
  role's replies. Anything refused is reported as `PermissionDenied` (`bus/denied.py`).

`specbus auth --out DIR` (run from the run config; `--run` adds more runs) writes:
- `DIR/auth.conf`: the server's `accounts { ... }` block, one account per run in DIR
  (re-running it for another run keeps the keys of the runs already there);
- `DIR/<run>/<role>.nk`: the role's NKey seed (0600), `DIR/<run>/<role>.yaml`: its `bus:`
  settings (`nkey_file`, `inbox_prefix`, and the TLS files with `--tls`); the run's admin is
  `DIR/<run>/admin.nk` (a `DIR/admin.nk` of an earlier version is not used any more);
- with `--tls`: `DIR/tls/` with a CA, a server certificate for `--host` names (default
  127.0.0.1, localhost) and a client certificate per role (mutual TLS).

The server includes it with `specbus up --auth DIR` (and `--tls DIR/tls`, `--mtls`).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import yaml
from specbus.bus.subjects import PRODUCERS, TRAINERS, Names
from specbus.core.errors import ConfigError
from specbus.ops.args import add_common, config_of

ROLES = ("feeder", "producer", "trainer", "colocated", "intake", "observer")
ADMIN = "admin"
USERS = (*ROLES, ADMIN)  # the users of one run's account
API = "$JS.API"
KV_KEYS_FEEDER = ("manifest", "feed_complete")
KV_KEYS_TRAINER = ("checkpoint", "train_complete", "recording", "progress", "world")


def inbox_prefix(run: str, role: str) -> str:
    return f"_INBOX.{run}.{role}"


def _info(n: Names) -> list[str]:
    kv_stream = f"KV_{n.kv_bucket}"
    streams = (n.tasks_stream, n.samples_stream, n.dead_stream, kv_stream)
    return [
        f"{API}.INFO",
        f"{API}.STREAM.NAMES",
        *(f"{API}.STREAM.INFO.{s}" for s in streams),
        *(f"{API}.CONSUMER.INFO.{s}.*" for s in (n.tasks_stream, n.samples_stream)),
        *_get(kv_stream),
    ]


def account(run: str) -> str:
    """The NATS account of `run`: every user of the run, and nothing else, is in it."""
    return f"SPECBUS_{run}"


def _get(stream: str) -> list[str]:
    """Messages of `stream` by sequence (one, or a batch: bus.replay), last by subject:
    direct or API get. Nothing of it creates a consumer."""
    return [f"{API}.DIRECT.GET.{stream}", f"{API}.DIRECT.GET.{stream}.>", f"{API}.STREAM.MSG.GET.{stream}"]  # fmt: skip


def _consume(stream: str, group: str) -> list[str]:
    """Lease from the durable `group` on `stream`: pull, ack/nak/term/in-progress."""
    return [f"{API}.CONSUMER.MSG.NEXT.{stream}.{group}", f"$JS.ACK.{stream}.{group}.>"]


def _reset(stream: str, group: str) -> str:
    """Reposition the durable `group` in place (bus.replay.reposition): a reset moves its
    start sequence, it cannot create a consumer or change where one delivers."""
    return f"{API}.CONSUMER.RESET.{stream}.{group}"


def _kv_write(n: Names, keys: tuple[str, ...]) -> list[str]:
    return [f"$KV.{n.kv_bucket}.{k}" for k in keys]


def permissions(run: str, role: str) -> dict:
    """The NATS `permissions` block of `role` in `run`'s account (allow lists; all else is
    refused). No role but the admin may create, update or delete a consumer."""
    if role == ADMIN:
        return {"publish": {"allow": [">"]}, "subscribe": {"allow": [">"]}}
    n = Names(run)
    pub = _info(n)
    if role == "feeder":
        pub += [n.tasks, *_get(n.tasks_stream), *_kv_write(n, KV_KEYS_FEEDER)]
    elif role in ("producer", "colocated"):
        pub += [*_consume(n.tasks_stream, PRODUCERS), n.samples, n.dead("tasks")]
        pub += _get(n.samples_stream)  # the trainers' lag in bytes (sampled refs)
    if role == "colocated":  # its resume repositions "producers" (ops/modes.py)
        pub += [_reset(n.tasks_stream, PRODUCERS)]
    if role in ("trainer", "colocated"):
        s = n.samples_stream
        pub += [*_consume(s, TRAINERS), n.dead("samples"), n.tasks, *_get(n.tasks_stream)]
        pub += [*_get(s), *_kv_write(n, KV_KEYS_TRAINER)]
        pub += [_reset(s, TRAINERS)]
    elif role == "intake":
        pub += [n.samples, *_kv_write(n, ("manifest",))]  # a live run's manifest
        pub += _get(n.tasks_stream)  # a driven run's tasks (producers/live/driven.py)
    elif role == "observer":
        pub += [*_get(n.tasks_stream), *_get(n.samples_stream), *_get(n.dead_stream)]
    elif role not in ("feeder", "producer"):
        raise ValueError(f"unknown role {role!r}: one of {', '.join(USERS)}")
    return {
        "publish": {"allow": sorted(set(pub))},
        "subscribe": {"allow": [f"{inbox_prefix(run, role)}.>"]},
    }


# ---------------------------------------------------------------- keys and files
def _seed(path: Path) -> tuple[str, str]:
    """(seed, public key) of the NKey user in `path`, made (0600) if missing."""
    import nkeys

    if path.exists():
        seed = path.read_bytes().strip()
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(seed + b"\n")
    return seed.decode(), nkeys.from_seed(seed).public_key.decode()


def _tls_files(out: Path, role: str, hosts: tuple[str, ...]) -> dict[str, str]:
    from specbus.ops.tls import CertFiles, issue, make_ca

    tls = out / "tls"
    ca = CertFiles(tls / "ca.pem", tls / "ca.key")
    if not ca.cert.exists():
        ca = make_ca(tls)
        issue(ca, tls, "server", hosts=hosts)
    client = CertFiles(tls / f"{role}.pem", tls / f"{role}.key")
    if not client.cert.exists():
        client = issue(ca, tls, role, client=True)
    return {"tls_ca": str(ca.cert), "tls_cert": str(client.cert), "tls_key": str(client.key)}


def role_bus(out: Path, run: str, role: str, *, tls: bool = False,
             hosts: tuple[str, ...] = ("127.0.0.1", "localhost"), make: bool = True) -> dict:  # fmt: skip
    """The `bus:` settings a process of `role` in `run` connects with (the admin included:
    one per run). Its seed is made if missing, unless `make` is False: then a run `out`
    holds no users of is a `ConfigError` (`specbus auth --run` adds it)."""
    if not run:
        raise ConfigError(f"the {role} of which run? every user, the admin too, is one run's")
    path = out / run / f"{role}.nk"
    if not make and not path.exists():
        raise ConfigError(f"{out} holds no {role} of run {run!r} (no {path}): "
                          f"`specbus auth --out {out} --run {run}` adds it")  # fmt: skip
    _seed(path)
    bus = {"nkey_file": str(path.resolve())}
    if role != ADMIN:
        bus["inbox_prefix"] = inbox_prefix(run, role)
    if tls:
        bus.update(_tls_files(out.resolve(), role, hosts))
    return bus


def write_auth(out: str | Path, runs: list[str], *, tls: bool = False,
               hosts: tuple[str, ...] = ("127.0.0.1", "localhost")) -> Path:  # fmt: skip
    """Seeds, per-role settings and `auth.conf` (one account per run) for `runs` plus every
    run already in `out` (their seeds kept)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    known = sorted({*runs, *(p.parent.name for p in out.glob("*/observer.nk"))})
    accounts = {}
    for run in known:
        users = []
        for role in USERS:
            bus = role_bus(out, run, role, tls=tls, hosts=hosts)
            (out / run / f"{role}.yaml").write_text(yaml.safe_dump({"bus": bus}))
            _, public = _seed(Path(bus["nkey_file"]))
            users.append({"nkey": public, "permissions": permissions(run, role)})
        # JetStream enabled without limits; no exports or imports: nothing crosses runs.
        accounts[account(run)] = {"jetstream": "enabled", "users": users}
    conf = out / "auth.conf"
    conf.write_text(
        "# written by `specbus auth`: one NATS account per run, one NKey user per role\n"
        '# (see ops/auth.py and docs/cluster.md, "Isolation model")\n'
        f"accounts {json.dumps(accounts, indent=2)}\n"
    )
    return conf


# ---------------------------------------------------------------- CLI
def cmd_auth(args: argparse.Namespace) -> int:
    cfg = config_of(args)
    runs = [cfg.run, *args.run]
    hosts = tuple(args.host) or ("127.0.0.1", "localhost")
    conf = write_auth(args.out, runs, tls=args.tls, hosts=hosts)
    out = Path(args.out)
    print(f"wrote {conf} (include it with `specbus up --auth {out}`)")
    for run in runs:
        for role in USERS:
            words = " ".join(f"bus.{k}={v}" for k, v in role_bus(out, run, role, tls=args.tls, hosts=hosts).items())  # fmt: skip
            print(f"  {run} {role:<9} {words}")
    if (out / f"{ADMIN}.nk").exists():
        print(f"{out / (ADMIN + '.nk')} (the shared admin of an earlier specbus) is not used: "
              "each run has its own admin, in the run's account")  # fmt: skip
    if args.tls:
        print(f"TLS: CA, server and client certificates in {out / 'tls'} (`specbus up --tls {out / 'tls'}`, add --mtls for client certificates)")  # fmt: skip
    return 0


def add_auth_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "auth", help="per-role NATS users with subject permissions (and TLS certificates)"
    )
    add_common(p)
    p.add_argument("--out", required=True, help="directory for auth.conf, seeds and settings")
    p.add_argument("--run", action="append", default=[], help="another run to add (repeatable)")
    p.add_argument("--tls", action="store_true", help="also a CA, server and client certificates")
    p.add_argument("--host", action="append", default=[], help="a name of the server certificate (repeatable)")  # fmt: skip
    p.set_defaults(func=cmd_auth)
