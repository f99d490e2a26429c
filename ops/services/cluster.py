"""A JetStream cluster of embedded nats-servers on loopback (`specbus up --cluster 3`).

`NatsCluster(base_dir, size=3).start()` runs `size` nats-server processes, each with its own
`server_name` (`n1`, `n2`, ...), client port, cluster (route) port and store dir
(`<base_dir>/n<i>`, locked like a single server's), all in one cluster (`cluster.name`,
routes to every node), and returns once every node said "Server is ready" and the cluster
elected a JetStream meta leader (read from the nodes' logs: never a sleep). Streams declared
with `bus.replicas: 3` then survive the loss of any one node. `url` lists every node
(`nats://127.0.0.1:p1,nats://127.0.0.1:p2,...`): `bus.connect` fails over among them.

Ports are pinned in `<base_dir>/cluster.json` on the first start, so a restarted node (or
`specbus up --cluster 3` run again after a crash) comes back where its peers and clients
look for it. `kill(i)` is kill -9 of one node, `start_node(i)` restarts it on the same ports
and store dir: it rejoins and catches up with the streams' leaders by itself.

`size=1` is one standalone server (no cluster block) with the same options: the auth and
TLS include files below apply to either.

- `auth`: a file with the users (`specbus auth --out DIR` writes `DIR/auth.conf`: an
  `accounts { ... }` block, one account per run), included by every node;
- `tls`: a `TlsFiles` (CA, server cert and key); `verify=True` requires a client certificate
  signed by the CA (mutual TLS). The routes between the nodes stay plain TCP on loopback.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from specbus.ops.services.common import LOOPBACK, ServiceError, free_port, port_free, stop_pids
from specbus.ops.services.nats import NatsServer

CLUSTER_NAME = "specbus"
PORTS_FILE = "cluster.json"
META_LEADER = "JetStream cluster new metadata leader"


@dataclass(frozen=True)
class TlsFiles:
    """The server side of TLS: its CA (to verify client certificates), cert and key."""

    ca: Path
    cert: Path
    key: Path
    verify: bool = False  # mutual TLS: clients must present a certificate signed by `ca`


class ClusterNode(NatsServer):
    """One node: a `NatsServer` whose config file names the node, its routes, auth and TLS."""

    def __init__(self, store_dir: Path, *, name: str, port: int, cluster_port: int | None,
                 routes: list[str], auth: Path | None, tls: TlsFiles | None, sync: str | None,
                 host: str = LOOPBACK):  # fmt: skip
        super().__init__(store_dir, host=host, port=port, sync=sync)
        self.name = name
        self.cluster_port = cluster_port
        self.routes = routes
        self.auth = auth
        self.tls = tls

    def _write_config(self) -> Path:
        path = self.store_dir / "nats-server.conf"
        js = f'jetstream {{\n  store_dir: "{self.store_dir / "jetstream"}"'
        js += f"\n  sync_interval: {self.sync}\n}}\n" if self.sync else "\n}\n"
        lines = [f"server_name: {self.name}", f"max_payload: {self.max_payload}", js]
        if self.cluster_port is not None:
            routes = ", ".join(f'"{r}"' for r in self.routes)
            lines.append(
                f"cluster {{\n  name: {CLUSTER_NAME}\n  listen: {self.host}:{self.cluster_port}\n"
                f"  routes: [{routes}]\n}}\n"
            )
        if self.tls is not None:
            t = self.tls
            lines.append(
                f'tls {{\n  ca_file: "{t.ca}"\n  cert_file: "{t.cert}"\n  key_file: "{t.key}"\n'
                f"  verify: {'true' if t.verify else 'false'}\n  timeout: 5\n}}\n"
            )
        if self.auth is not None:  # nats-server resolves an include beside its config file
            (self.store_dir / "auth.conf").write_text(Path(self.auth).read_text())
            lines.append('include "auth.conf"\n')
        path.write_text("\n".join(lines))
        return path


class NatsCluster:
    """`size` nodes under `base_dir` (module doc). `client_ports`: the nodes' client ports
    (0: a new free one), instead of the ones pinned in `cluster.json` (`specbus up --port`);
    the route ports stay pinned."""

    def __init__(self, base_dir: str | Path, size: int = 3, *, host: str = LOOPBACK,
                 auth: str | Path | None = None, tls: TlsFiles | None = None,
                 sync: str | None = None, client_ports: list[int] | None = None):  # fmt: skip
        if size < 1:
            raise ServiceError(f"a cluster needs at least one node, not {size}")
        if client_ports is not None and len(client_ports) != size:
            raise ServiceError(f"{len(client_ports)} client ports for {size} nodes")
        self.base_dir = Path(base_dir)
        self.size = size
        self.host = host
        ports = self._ports(client_ports)
        clustered = size > 1
        routes = [f"nats-route://{host}:{p}" for p in ports["cluster"]] if clustered else []
        self.nodes = [
            ClusterNode(
                self.base_dir / f"n{i + 1}",
                name=f"n{i + 1}",
                port=ports["client"][i],
                cluster_port=ports["cluster"][i] if clustered else None,
                routes=[r for j, r in enumerate(routes) if j != i],
                auth=Path(auth) if auth else None,
                tls=tls,
                sync=sync,
                host=host,
            )
            for i in range(size)
        ]

    def _ports(self, client: list[int] | None) -> dict[str, list[int]]:
        """The pinned ports of this base dir, or new free ones (pinned by `start`); `client`
        replaces the client ports (0: a new one)."""
        path = self.base_dir / PORTS_FILE
        ports = None
        try:
            ports = json.loads(path.read_text())
            if len(ports["client"]) != self.size or len(ports["cluster"]) != self.size:
                ports = None
        except (OSError, ValueError, KeyError):
            ports = None
        given = [p for p in client or () if p]
        taken: set[int] = set(given)

        def new() -> int:
            port = free_port(self.host)
            while port in taken:
                port = free_port(self.host)
            taken.add(port)
            return port

        if ports is None or set(ports["cluster"]) & taken:
            ports = {"client": [new() for _ in range(self.size)],
                     "cluster": [new() for _ in range(self.size)]}  # fmt: skip
        if client is not None:
            taken.update(ports["cluster"])
            ports["client"] = [p or new() for p in client]
        return ports

    @property
    def url(self) -> str:
        """Every node's URL, comma-separated (what `bus.url` takes)."""
        return ",".join(n.url for n in self.nodes)

    @property
    def urls(self) -> list[str]:
        return [n.url for n in self.nodes]

    def start(self, timeout_s: float = 60.0) -> NatsCluster:
        """Start every node, wait for each to be ready and for a JetStream meta leader."""
        self.base_dir.mkdir(parents=True, exist_ok=True)
        busy = [n.port for n in self.nodes if not port_free(self.host, n.port)]
        if busy:
            raise ServiceError(f"ports {busy} (the client ports asked for, or pinned in "
                               f"{self.base_dir / PORTS_FILE}) are in use")  # fmt: skip
        (self.base_dir / PORTS_FILE).write_text(
            json.dumps({"client": [n.port for n in self.nodes],
                        "cluster": [n.cluster_port for n in self.nodes]})
        )  # fmt: skip
        try:
            for node in self.nodes:
                node.start(timeout_s)
            if self.size > 1:
                self.wait_meta_leader(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_meta_leader(self, timeout_s: float = 60.0) -> None:
        """Until a node running now logged a JetStream meta leader since its start."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for node in self.nodes:
                alive = node.proc is not None and node.proc.poll() is None
                if alive and META_LEADER in node.log_path.read_text(errors="replace"):
                    return
            time.sleep(0.02)
        raise ServiceError(f"the cluster in {self.base_dir} elected no JetStream leader in {timeout_s}s")  # fmt: skip

    def node(self, name_or_index: str | int) -> ClusterNode:
        if isinstance(name_or_index, int):
            return self.nodes[name_or_index]
        for node in self.nodes:
            if node.name == name_or_index:
                return node
        raise KeyError(name_or_index)

    def kill(self, which: str | int) -> ClusterNode:
        """kill -9 of one node (by index or server name)."""
        node = self.node(which)
        node.kill()
        return node

    def start_node(self, which: str | int, timeout_s: float = 60.0) -> ClusterNode:
        """(Re)start one node on its ports and store dir; it rejoins the cluster."""
        node = self.node(which)
        node.start(timeout_s)
        return node

    def stop(self) -> None:
        """Stop every node by PID, together (a cluster shutting down node by node would
        move every leader to the survivors first)."""
        stop_pids([n.proc for n in self.nodes if n.proc is not None])
        for node in self.nodes:
            node.stop()  # reaped already; releases its store dir lock

    def __enter__(self) -> NatsCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
