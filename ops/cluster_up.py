"""`specbus up --cluster N` (and `--auth DIR`, `--tls DIR`): a JetStream cluster in the foreground.

`ClusterUp` has `Up`'s lifecycle (`ops/up.py`): it locks the store dir (`<run_dir>/nats` or
`--store-dir`; its `broker.lock` record carries every node's URL, so commands of the run find
the cluster without `--url`), starts `N` nodes (`ops/services/cluster.py`: `n1`..`nN` under
the store dir, ports pinned in `cluster.json`), declares the run as the admin user with
`bus.replicas` replicas (3 on a 3-node cluster when the config says 1: set `bus.replicas: 3`
in the run config so that every process declares the same), announces the URL list (for
the run it was started for only: never the machine's shared broker), and
restarts a node that dies on its ports and store dir (it rejoins and catches up); Ctrl-C or
SIGTERM stop every node by PID.

Ports as for one server (`Up._port`): `--port P` (node i listens on P + i - 1; 0: new free
ports), else `bus.url`'s when it lists one URL per node, else the ports pinned in the store
dir's `cluster.json` by an earlier start, else new free ones.

`--auth DIR` includes `DIR/auth.conf` (`specbus auth --out DIR`: one account per run) in every
node and declares as the run's admin, `DIR/<run>/admin.nk` (a run DIR has no users of is a
`ConfigError`); `--tls DIR` serves TLS with `DIR/ca.pem`, `DIR/server.pem`/`.key`, and
`--mtls` requires client certificates signed by that CA. Without `--cluster` these run one
node the same way.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time
import urllib.parse
from pathlib import Path

from specbus.core.config import RunConfig
from specbus.core.errors import ConfigError
from specbus.ops.discover import about_broker, broker_dir
from specbus.ops.services.common import DirInUse, DirLock, ServiceError

log = logging.getLogger("specbus")
MAX_FAILED_STARTS = 3


class ClusterUp:
    def __init__(self, args: argparse.Namespace, cfg: RunConfig):
        from specbus.ops.services.nats import LOCK_FILE

        self.args, self.cfg = args, cfg
        self.store_dir = Path(args.store_dir) if args.store_dir else broker_dir(cfg)
        self.lock = DirLock(self.store_dir / LOCK_FILE)
        self.cluster = None
        self.interrupted = False

    def _tls(self):
        from specbus.ops.services.cluster import TlsFiles

        if not self.args.tls:
            if self.args.mtls:
                raise ConfigError("--mtls needs --tls DIR (the CA and the server certificate)")
            return None
        d = Path(self.args.tls)
        files = TlsFiles(d / "ca.pem", d / "server.pem", d / "server.key", verify=self.args.mtls)
        missing = [str(p) for p in (files.ca, files.cert, files.key) if not p.exists()]
        if missing:
            raise ConfigError(f"--tls {d}: missing {', '.join(missing)} (`specbus auth --tls`)")
        return files

    def admin_bus(self):
        """The bus config `specbus up` declares with: the run's, as admin, with replicas."""
        from specbus.ops.auth import ADMIN, role_bus

        update = {}
        replicas = self.cfg.bus.replicas
        if self.args.cluster > 1 and replicas == 1:
            replicas = min(3, self.args.cluster)
            log.warning(
                "bus.replicas is 1: declaring with %d replicas; set bus.replicas=%d in the run "
                "config (a process declaring with 1 scales the streams down)", replicas, replicas,
            )  # fmt: skip
        update["replicas"] = replicas
        if self.args.auth:
            # the run's own admin: each run is an account of its own (ops/auth.py)
            auth = Path(self.args.auth)
            update.update(role_bus(auth, self.cfg.run, ADMIN, tls=bool(self.args.tls), make=False))
        elif self.args.tls:
            update["tls_ca"] = Path(self.args.tls) / "ca.pem"
        return type(self.cfg.bus).model_validate({**self.cfg.bus.model_dump(), **update})

    def run(self) -> int:
        from specbus.ops.services.cluster import NatsCluster
        from specbus.ops.services.nats import announce

        args = self.args
        auth = Path(args.auth) / "auth.conf" if args.auth else None
        if auth is not None and not auth.exists():
            raise ConfigError(f"--auth {args.auth}: no auth.conf (run `specbus auth --out {args.auth}`)")  # fmt: skip
        bus_cfg = self.admin_bus()  # before any node starts: a run without an admin is an error
        sync = None if args.sync == "default" else args.sync
        self.cluster = NatsCluster(self.store_dir, max(1, args.cluster), host=args.host,
                                   auth=auth, tls=self._tls(), sync=sync,
                                   client_ports=self._client_ports())  # fmt: skip
        try:
            self.lock.acquire(self._record(), what=f"the broker store dir {self.store_dir}")
        except DirInUse as e:
            print(f"specbus up: {e}; not starting a second broker on it", file=sys.stderr)
            return 1
        self.cluster.start()
        url = self.cluster.url
        self.lock.update(self._record())
        announce(url, self.store_dir, **about_broker(args, self.cfg, len(self.cluster.nodes)))
        if not args.no_declare:
            asyncio.run(_declare(bus_cfg, url, self.cfg.run))
        pids = ", ".join(f"{n.name} pid {n.pid}" for n in self.cluster.nodes)
        print(f"nats-server cluster ready at {url} ({pids}; store {self.store_dir})", flush=True)
        if not args.no_declare:
            print(f"run {self.cfg.run!r} declared with {bus_cfg.replicas} replicas", flush=True)
        if args.auth:
            print(f"auth: roles of {args.auth} (`specbus auth` printed their bus.* settings)", flush=True)  # fmt: skip
        print(f"commands of this run find it; elsewhere: --url {url}", flush=True)
        print("Ctrl-C to stop", flush=True)
        return self._supervise()

    def _client_ports(self) -> list[int] | None:
        """The nodes' client ports, as `Up._port` picks one: `--port P` (node i on P + i - 1;
        0: new free ones), else `bus.url`'s when it names one per node, else None (those
        pinned in the store dir's `cluster.json`, or new ones)."""
        n = max(1, self.args.cluster)
        if self.args.port is not None:
            return [self.args.port + i if self.args.port else 0 for i in range(n)]
        urls = [u for u in (self.cfg.bus.url or "").split(",") if u.strip()]
        ports = [urllib.parse.urlsplit(u.strip()).port for u in urls]
        if len(ports) == n and all(ports):
            return ports
        return None

    def _record(self) -> dict:
        record = {"pid": os.getpid(), "store_dir": str(self.store_dir.resolve())}
        if self.cluster is not None and all(n.pid for n in self.cluster.nodes):
            record.update(url=self.cluster.url, server_pids=[n.pid for n in self.cluster.nodes])
        return record

    def _supervise(self) -> int:
        """Restart a node that dies, on its ports and store dir (the caller stops them)."""
        failures = 0
        while True:
            time.sleep(0.2)  # several children to watch; a signal raises Interrupted here
            for node in self.cluster.nodes:
                rc = node.proc.poll()
                if rc is None:
                    continue
                print(f"{node.name} (pid {node.pid}) exited with {rc}; see {node.log_path}", file=sys.stderr, flush=True)  # fmt: skip
                if self.args.no_restart:
                    return 1
                try:
                    node.start()
                    failures = 0
                    self.lock.update(self._record())
                    print(f"{node.name} restarted at {node.url} (pid {node.pid})", flush=True)
                except ServiceError as e:
                    failures += 1
                    print(f"specbus up: restart of {node.name} failed: {e}", file=sys.stderr, flush=True)  # fmt: skip
                    if failures >= MAX_FAILED_STARTS:
                        return 1

    def close(self) -> None:
        from specbus.ops.services.nats import withdraw

        if self.cluster is not None:
            self.cluster.stop()
        if self.interrupted:
            withdraw(self.store_dir)
        self.lock.release()


async def _declare(bus_cfg, url: str, run: str) -> None:
    from specbus.bus.connection import connect
    from specbus.bus.run import declare

    bus = await connect(bus_cfg, url, name="specbus-up")
    try:
        await declare(bus, bus_cfg, run)
    finally:
        await bus.close()
