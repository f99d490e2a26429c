"""`specbus up` and `specbus store`: the embedded broker and the Mooncake store as services.

`specbus up` (foreground) owns one nats-server on one store dir (`<run_dir>/nats` or
`--store-dir`):
- it locks the store dir (`broker.lock`, flock; the record names the pids and the URL): a
  second `specbus up` on it is refused with that record, a killed one's lock goes with it;
- it serves on a stable port: `--port`, else the port of `bus.url`, else the port pinned in
  `<store_dir>/url` by an earlier start, else 4222 (a free port when 4222 is taken), which is
  then pinned. The probe binds like nats-server does (SO_REUSEADDR), so a restart right after
  a kill -9 comes back on the same port at once;
- nats-server is its direct child with a parent-death signal: kill -9 of `specbus up` takes
  the server down with it, never an orphan. A server that dies on its own is restarted on the
  same port and store dir (`--no-restart`: exit 1 instead); three failed starts in a row end
  `specbus up` with exit 1;
- it announces itself on this machine (`ops.services.nats.announce`: its URL, the run and
  config it serves): commands of that run find it without `--url`, and a plain `specbus up`
  (no config) is the machine's shared broker (ops/discover.py);
- SIGINT/SIGTERM stop what it runs, by PID, and exit 0.

`specbus store` (foreground) owns mooncake_master + a store node on `<run_dir>/mooncake`: the
same lock (`store.lock`, its record carries the `store.uri` clients use), ports pinned in
`ports.json`, children with a parent-death signal, a dead node or master restarted. It runs
independently of the broker: `specbus up --store mooncake` starts it as a detached process
(or adopts the one already running for the run dir), a dying nats-server or a killed
`specbus up` leave it and its objects alone, and the next `specbus up --store mooncake`
adopts it. Only a deliberate stop of `specbus up` (SIGINT/SIGTERM) stops it too;
`specbus store --stop` stops it alone.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from specbus.core.config import RunConfig
from specbus.core.errors import ConfigError, SpecbusError
from specbus.ops.discover import about_broker, broker_dir
from specbus.ops.services.common import (
    LOOPBACK,
    DirInUse,
    DirLock,
    Interrupted,
    ServiceError,
    free_port,
    interruptible,
    lock_holder,
    pid_alive,
    port_free,
    shielded,
    stop_pid,
)

log = logging.getLogger("specbus")

DEFAULT_PORT = 4222
STORE_LOCK = "store.lock"
STORE_PORTS = "ports.json"
STORE_READY = "mooncake store ready"
MAX_FAILED_STARTS = 3


def mooncake_dir(cfg: RunConfig) -> Path:
    """The Mooncake services' work dir of a run (`<run_dir>/mooncake`)."""
    return cfg.resolved_run_dir / "mooncake"


def config_argv(args: argparse.Namespace) -> list[str]:
    """The run-config arguments of this command, for a child `specbus` command."""
    return (["--config", str(args.config)] if args.config else []) + list(args.overrides)


# ---------------------------------------------------------------- specbus up
class Up:
    """One `specbus up`: `run()` serves until nats-server cannot be kept up (exit code), a
    signal raises `Interrupted` out of it; `close()` then stops what it runs (see the module
    docstring for what a deliberate stop and a failure each leave behind)."""

    def __init__(self, args: argparse.Namespace, cfg: RunConfig):
        from specbus.ops.services.nats import LOCK_FILE

        self.args, self.cfg = args, cfg
        self.store_dir = Path(args.store_dir) if args.store_dir else broker_dir(cfg)
        self.lock = DirLock(self.store_dir / LOCK_FILE)
        self.server = None
        self.store: dict[str, Any] | None = None  # the Mooncake store's lock record
        self.store_proc: subprocess.Popen | None = None
        self.interrupted = False

    def run(self) -> int:
        """Serve until interrupted (see `Up`); the exit code."""
        from specbus.ops.services.nats import NatsServerConfig, announce

        args = self.args
        if args.host != LOOPBACK:
            log.warning(
                "binding the broker to %s: anyone who can reach it can use it (configure auth, see ops/)",
                args.host,
            )
        try:
            self.lock.acquire(
                {"pid": os.getpid(), "store_dir": str(self.store_dir.resolve())},
                what=f"the broker store dir {self.store_dir}",
            )
        except DirInUse as e:
            print(f"specbus up: {e}; not starting a second nats-server on it", file=sys.stderr)
            return 1
        try:
            server_cfg = NatsServerConfig(store_dir=self.store_dir, host=args.host, sync=args.sync)
        except ValidationError as e:
            raise ConfigError(
                f"--sync {args.sync!r}: 'default', 'always' or an interval like '10s'"
            ) from e
        self.server = server_cfg.model_copy(update={"port": self._port()}).build(lock=self.lock)
        self.server.start()
        announce(self.server.url, self.store_dir, **about_broker(args, self.cfg))
        if args.store == "mooncake":
            self._start_store()
        if not args.no_declare:
            asyncio.run(_declare(self.cfg, self.server.url))
        url = self.server.url
        sync = "" if args.sync == "default" else f", sync_interval {args.sync}"
        print(f"nats-server ready at {url} (pid {self.server.pid}, store {self.store_dir}{sync})", flush=True)  # fmt: skip
        if not args.no_declare:
            print(f"run {self.cfg.run!r} declared: streams, consumers, KV bucket", flush=True)
        if about_broker(args, self.cfg)["shared"]:
            found = "commands of any run with no broker of its own on this machine find it"
        else:
            found = f"commands of run {self.cfg.run!r} on this machine find it"
        print(f"{found}; other runs and hosts: --url {url} (bus.url={url})", flush=True)
        print("Ctrl-C to stop", flush=True)
        return self._supervise()

    def _port(self) -> int:
        """The port to serve on (see the module docstring); a taken pinned port is an error,
        not a silent move: running processes would retry the old URL forever."""
        from specbus.ops.services.nats import URL_FILE, pinned_port

        args, host = self.args, self.args.host
        if args.port == 0:
            return free_port(host)
        if args.port is not None:
            port, source = args.port, f"--port {args.port}"
        elif self.cfg.bus.url:
            port = urllib.parse.urlsplit(self.cfg.bus.url).port or DEFAULT_PORT
            source = f"bus.url {self.cfg.bus.url}"
        elif (pinned := pinned_port(self.store_dir)) is not None:
            port, source = pinned, f"pinned in {self.store_dir / URL_FILE}"
        else:
            if port_free(host, DEFAULT_PORT):
                return DEFAULT_PORT
            port = free_port(host)
            log.warning("port %d is in use on %s; using %d", DEFAULT_PORT, host, port)
            return port
        if not port_free(host, port):
            raise SpecbusError(
                f"port {port} ({source}) is in use on {host} by another process; "
                "stop it, or pass --port 0 for a new port (clients must then be given its URL)"
            )
        return port

    def _supervise(self) -> int:
        """Wait on nats-server; restart it where it was when it dies (the caller stops it)."""
        failures = 0
        while True:
            proc = self.server.proc
            rc = proc.wait()  # a signal raises Interrupted out of here
            print(
                f"nats-server (pid {proc.pid}) exited with {rc}; see {self.server.log_path}",
                file=sys.stderr,
                flush=True,
            )
            if self.args.no_restart:
                return 1
            while True:
                with contextlib.suppress(OSError):
                    os.replace(self.server.log_path, f"{self.server.log_path}.1")
                try:
                    self.server.start()
                    break
                except ServiceError as e:
                    failures += 1
                    print(f"specbus up: restart failed: {e}", file=sys.stderr, flush=True)
                    if failures >= MAX_FAILED_STARTS:
                        return 1
                    time.sleep(failures)
            failures = 0
            print(
                f"nats-server restarted at {self.server.url} (pid {self.server.pid}, same store dir)",
                flush=True,
            )

    def _start_store(self) -> None:
        work = mooncake_dir(self.cfg)
        holder = lock_holder(work / STORE_LOCK)
        if holder is None:
            work.mkdir(parents=True, exist_ok=True)
            out = open(work / "store.out", "w")  # noqa: SIM115 - handed to the child
            try:
                # Detached and without a death signal: the store outlives this broker.
                self.store_proc = subprocess.Popen(
                    [sys.executable, "-m", "specbus.ops.cli", "store", *config_argv(self.args)],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            finally:
                out.close()
        self.store = wait_store_ready(work, self.store_proc)
        how = "started" if self.store_proc else "already running, adopted"
        print(
            f"{STORE_READY}: store.uri={self.store['uri']} (specbus store pid {self.store['pid']}, {how}; it outlives the broker)",
            flush=True,
        )

    def close(self) -> None:
        """Stop nats-server; on a deliberate stop also the Mooncake store; free the lock."""
        from specbus.ops.services.nats import withdraw

        if self.server is not None:
            self.server.stop()  # by PID: SIGTERM, then SIGKILL if it lingers
        if self.store is None and self.store_proc is not None:
            stop_pid(self.store_proc)  # it never became ready: not a store to keep
        elif self.store is not None:
            if self.interrupted:
                stop_store(mooncake_dir(self.cfg), self.store_proc)
            else:
                print(
                    f"the Mooncake store keeps running (specbus store pid {self.store['pid']}): "
                    "`specbus up --store mooncake` adopts it, `specbus store --stop` stops it",
                    file=sys.stderr,
                )
        if self.interrupted:
            withdraw(self.store_dir)
        self.lock.release()


def run_up(args: argparse.Namespace, cfg: RunConfig) -> int:
    """`specbus up` (see `Up`, or `ClusterUp` for a cluster, auth or TLS); its exit code."""
    if args.cluster > 1 or args.auth or args.tls:  # ops/cluster_up.py
        from specbus.ops.cluster_up import ClusterUp

        up = ClusterUp(args, cfg)
    else:
        up = Up(args, cfg)
    with interruptible():
        try:
            return up.run()
        except Interrupted:
            up.interrupted = True
            return 0
        except ServiceError as e:
            print(f"specbus up: {e}", file=sys.stderr)
            return 1
        finally:
            with shielded():
                up.close()


async def _declare(cfg: RunConfig, url: str) -> None:
    from specbus.bus.connection import connect
    from specbus.bus.run import declare

    bus = await connect(cfg.bus, url, name="specbus-up")
    try:
        await declare(bus, cfg.bus, cfg.run)
    finally:
        await bus.close()


# ---------------------------------------------------------------- specbus store
def wait_store_ready(
    work: Path, proc: subprocess.Popen | None, timeout_s: float = 120.0
) -> dict[str, Any]:
    """The lock record of the store serving `work` once it is ready (carries its `uri`)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        holder = lock_holder(work / STORE_LOCK)
        if holder and holder.get("uri"):
            return holder
        if proc is not None and proc.poll() is not None:
            tail = _tail(work / "store.out")
            raise ServiceError(f"specbus store exited with {proc.returncode} before ready:\n{tail}")
        if proc is None and holder is None:
            raise ServiceError(f"the Mooncake store of {work} stopped while starting")
        time.sleep(0.05)
    raise ServiceError(f"the Mooncake store of {work} not ready after {timeout_s}s")


def stop_store(work: Path, proc: subprocess.Popen | None = None, timeout_s: float = 20.0) -> bool:
    """SIGTERM the `specbus store` holding `work` (by the pid in its lock record, while the
    lock is held: that pid is the holder), wait until its lock is free, SIGKILL it if it
    lingers (its children follow on their death signal). False when none was running."""
    holder = lock_holder(work / STORE_LOCK)
    pid = holder.get("pid") if holder else None
    if pid:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while lock_holder(work / STORE_LOCK) is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        if pid_alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    if proc is not None:
        proc.wait()
    return pid is not None


def run_store(args: argparse.Namespace, cfg: RunConfig) -> int:
    """`specbus store` (or `--stop`): the Mooncake store of the run, in the foreground; its exit code."""
    work = mooncake_dir(cfg)
    if args.stop:
        if stop_store(work):
            print(f"the Mooncake store of {work} is stopped")
            return 0
        print(f"no Mooncake store runs for {work}")
        return 1
    lock = DirLock(work / STORE_LOCK)
    services = []  # filled once started, so the cleanup stops what a signal interrupted
    with interruptible():
        try:
            lock.acquire({"pid": os.getpid()}, what=f"the Mooncake store dir {work}")
            return _supervise_store(_start_services(cfg, work, lock, services))
        except Interrupted:
            return 0
        except ServiceError as e:  # DirInUse included
            print(f"specbus store: {e}", file=sys.stderr)
            return 1
        finally:
            with shielded():
                for s in services:
                    s.stop()
                lock.release()


def _start_services(cfg: RunConfig, work: Path, lock: DirLock, started: list):
    from specbus.core.store.mooncake_admin import segment_bytes_for
    from specbus.ops.services.mooncake import MooncakeServices, client_store_config

    ports = {}
    with contextlib.suppress(OSError, ValueError):
        ports = json.loads((work / STORE_PORTS).read_text())
    if not all(port_free(LOOPBACK, p) for p in ports.values()):
        log.warning("the pinned Mooncake ports %s are taken; using new ones", ports)
        ports = {}
    services = MooncakeServices(
        work,
        segment_bytes=segment_bytes_for(cfg.store.budget_bytes, cfg.store.mooncake.segment_bytes),
        inherit_fds=(lock.fd,),  # the store dir stays locked while any part of the store lives
        **ports,
    )
    started.append(services)
    services.start()
    (work / STORE_PORTS).write_text(
        json.dumps({"master_port": services.master_port, "admin_port": services.admin_port})
    )
    uri = client_store_config(cfg.store, services).uri
    lock.update(
        {"pid": os.getpid(), "master_pid": services.master.pid, "node_pid": services.node.pid,
         "uri": uri, "store_dir": str(work.resolve())}
    )  # fmt: skip
    print(
        f"{STORE_READY}: store.uri={uri} (pid {os.getpid()}, master pid {services.master.pid}, node pid {services.node.pid})",
        flush=True,
    )
    return services


def _supervise_store(services) -> int:
    """Restart a dead store node or master (a dead node's objects are gone: trainers
    recapture them); three failed starts in a row end the store with exit 1."""
    failures = 0
    while True:
        time.sleep(0.5)  # two children to watch; a signal raises Interrupted out of here
        try:
            if services.master.poll() is not None:
                print(f"mooncake_master exited with {services.master.returncode}; restarting", flush=True)  # fmt: skip
                services.restart_master()
            elif services.node.poll() is not None:
                print(f"the store node exited with {services.node.returncode}; restarting (its objects are lost)", flush=True)  # fmt: skip
                services.start_node()
            else:
                failures = 0
        except ServiceError as e:
            failures += 1
            print(f"specbus store: restart failed: {e}", file=sys.stderr, flush=True)
            if failures >= MAX_FAILED_STARTS:
                return 1


def _tail(path: Path, n: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""
