"""Embedded Mooncake: `mooncake_master` + a store node (+ an HTTP metadata server) on loopback.

`MooncakeServices(work_dir).start()` picks free loopback ports, starts the master (RPC and
admin/metrics bound to 127.0.0.1), optionally the standalone HTTP metadata server on
127.0.0.1 (the master's embedded one binds every interface, so it stays off; the default is
the P2P handshake, which needs no metadata server), then the store node process that owns
the segment memory. Readiness is read from the services (log line, admin /health, the
node's segment listed by the master), never a sleep. `stop()` ends them by PID.

Fault injection for tests: `kill_node()` (kill -9), `start_node()`, `kill_master()`,
`restart_master()` (same ports; waits until the node has re-mounted its segment).

Known limit (Mooncake 0.3.13): the transfer engine's own data/handshake listeners in the
node and in every client bind all interfaces whatever MC_TCP_BIND_ADDRESS says; we set it
anyway for versions that honour it. Firewall those ports on shared hosts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from specbus.core.config import MooncakeConfig, StoreConfig
from specbus.core.store import parse_uri
from specbus.core.store.mooncake import mooncake_uri
from specbus.core.store.mooncake_admin import segment_bytes_for
from specbus.ops.services.common import (
    LOOPBACK,
    ServiceError,
    dies_with_parent,
    find_binary,
    free_port,
    kill_pid,
    stop_pid,
    wait_for_log,
    wait_for_port,
)
from specbus.ops.services.mooncake_node import READY


class MooncakeServices:
    """mooncake_master (and, with metadata="http", a metadata server) plus one store node, by PID on
    loopback, for one run's `mooncake://` store."""

    def __init__(
        self,
        work_dir: str | Path,
        *,
        segment_bytes: int = 1 << 30,
        metadata: str = "P2P",  # "P2P" or "http" (standalone metadata server on loopback)
        host: str = LOOPBACK,
        lease_ttl_ms: int | None = None,  # master's read lease (Mooncake default 10 s)
        client_ttl_s: int | None = None,  # a dead node's segment is unmounted after this
        put_start_timeout_s: int
        | None = None,  # a writer killed mid-put frees its space after this
        master_port: int | None = None,  # None: free loopback ports
        admin_port: int | None = None,
        metadata_port: int | None = None,
        inherit_fds: tuple[int, ...] = (),  # e.g. the owner's DirLock: held while any child lives
    ):
        if metadata.upper() not in ("P2P", "HTTP"):
            raise ValueError(f"metadata {metadata!r} must be 'P2P' or 'http'")
        self.work_dir = Path(work_dir)
        self.segment_bytes = segment_bytes
        self.host = host
        self.http_metadata = metadata.upper() == "HTTP"
        self.lease_ttl_ms = lease_ttl_ms
        self.client_ttl_s = client_ttl_s
        self.put_start_timeout_s = put_start_timeout_s
        self.master_port = master_port or free_port(host)
        self.admin_port = admin_port or free_port(host)
        self.metadata_port = (metadata_port or free_port(host)) if self.http_metadata else None
        self.inherit_fds = tuple(inherit_fds)
        self.master: subprocess.Popen | None = None
        self.node: subprocess.Popen | None = None
        self.metadata_server: subprocess.Popen | None = None

    # ---- what a client needs -----------------------------------------------------------------

    @property
    def master_address(self) -> str:
        """host:port of the master's RPC."""
        return f"{self.host}:{self.master_port}"

    @property
    def admin_address(self) -> str:
        """host:port of the master's HTTP admin/metrics endpoint."""
        return f"{self.host}:{self.admin_port}"

    @property
    def metadata(self) -> str:
        """The metadata address clients use (P2P, or the metadata server's URL)."""
        return f"http://{self.host}:{self.metadata_port}/metadata" if self.http_metadata else "P2P"

    def config(self, **overrides) -> MooncakeConfig:
        """The `MooncakeConfig` that reaches these services (`overrides` replace fields)."""
        return MooncakeConfig(
            master=self.master_address,
            metadata=self.metadata,
            admin=self.admin_address,
            local_hostname=self.host,
            segment_bytes=self.segment_bytes,
            **overrides,
        )

    def uri(self, store_id: str) -> str:
        """The `mooncake://` URI of store `store_id` on these services."""
        return mooncake_uri(store_id, self.config())

    def store_config(self, store_id: str, **fields) -> StoreConfig:
        """A `StoreConfig` for store `store_id` on these services."""
        mc = fields.pop("mooncake", None) or self.config()
        return StoreConfig(uri=f"mooncake://{store_id}", mooncake=mc, **fields)

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self, timeout_s: float = 30.0) -> MooncakeServices:
        """Start the master (and metadata server), then the store node; wait until its segment is
        mounted."""
        self.work_dir.mkdir(parents=True, exist_ok=True)
        try:
            if self.http_metadata:
                self._start_metadata_server(timeout_s)
            self.start_master(timeout_s)
            self.start_node(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_metadata_server(self, timeout_s: float) -> None:
        args = [
            find_binary("mooncake_http_metadata_server"),
            "--host",
            self.host,
            "--port",
            str(self.metadata_port),
        ]
        self.metadata_server = self._spawn(args, "metadata.log")
        wait_for_port(self.host, self.metadata_port, self.metadata_server, timeout_s)

    def start_master(self, timeout_s: float = 30.0) -> None:
        """Start mooncake_master and wait for its ports."""
        args = [
            find_binary("mooncake_master"),
            f"--rpc_address={self.host}",
            f"--rpc_port={self.master_port}",
            f"--metrics_host={self.host}",
            f"--metrics_port={self.admin_port}",
            "--enable_http_metadata_server=false",
        ]
        if self.lease_ttl_ms is not None:
            args.append(f"--default_kv_lease_ttl={self.lease_ttl_ms}")
        if self.client_ttl_s is not None:
            args.append(f"--client_ttl={self.client_ttl_s}")
        if self.put_start_timeout_s is not None:
            args += [
                f"--put_start_discard_timeout_sec={self.put_start_timeout_s}",
                f"--put_start_release_timeout_sec={self.put_start_timeout_s + 1}",
            ]
        self.master = self._spawn(args, "master.log")
        wait_for_log(self.work_dir / "master.log", "Master service started", self.master, timeout_s)
        wait_for_port(self.host, self.master_port, self.master, timeout_s)
        self._wait(
            lambda: json.loads(self._admin("/health")).get("service_ready") is True,
            timeout_s,
            "master ready",
        )

    def start_node(self, timeout_s: float = 30.0) -> None:
        """Start the store node; wait for its ready line and for the master to mount its segment."""
        args = [
            sys.executable,
            "-m",
            "specbus.ops.services.mooncake_node",
            f"--master={self.master_address}",
            f"--metadata={self.metadata}",
            f"--segment-bytes={self.segment_bytes}",
            f"--hostname={self.host}",
        ]
        self.node = self._spawn(args, "node.log", env={"MC_TCP_BIND_ADDRESS": self.host})
        wait_for_log(self.work_dir / "node.log", READY, self.node, timeout_s)
        self._wait(self.segment_mounted, timeout_s, "store node segment mounted")

    def segment_mounted(self) -> bool:
        """True once the master counts the node's segment."""
        try:
            return bool(self._admin("/get_all_segments").strip())
        except OSError:
            return False

    def kill_node(self) -> None:
        """kill -9 the store node (fault injection)."""
        if self.node:
            kill_pid(self.node)

    def kill_master(self) -> None:
        """kill -9 the master (fault injection)."""
        if self.master:
            kill_pid(self.master)

    def restart_master(self, timeout_s: float = 30.0) -> None:
        """Stop the master and start it on the same ports; return once the node re-mounted."""
        if self.master:
            stop_pid(self.master)
        self.start_master(timeout_s)
        self._wait(self.segment_mounted, timeout_s, "store node segment re-mounted")

    def stop(self) -> None:
        """Tear everything down: the node is killed (unmounting from a master that is going
        away only costs a second), the others get SIGTERM; all are reaped."""
        if self.node:
            kill_pid(self.node)
        procs = [p for p in (self.master, self.metadata_server) if p and p.poll() is None]
        for proc in procs:
            proc.terminate()
        for proc in procs:
            stop_pid(proc)  # waits; SIGKILL if it lingers

    def __enter__(self) -> MooncakeServices:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- helpers -----------------------------------------------------------------------------

    def _spawn(
        self, args: list[str], log_name: str, env: dict[str, str] | None = None
    ) -> subprocess.Popen:
        log = open(self.work_dir / log_name, "w")  # noqa: SIM115 - handed to the child
        try:
            return subprocess.Popen(
                args,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                pass_fds=self.inherit_fds,
                env={**os.environ, **(env or {})},
                cwd=Path(__file__).resolve().parents[2],  # so `-m specbus.ops.services...` resolves
                # No orphan when the owner dies (kill -9 included); Ctrl-C reaches the owner
                # only, which stops them by PID.
                preexec_fn=dies_with_parent(),
                start_new_session=True,
            )
        finally:
            log.close()

    def _admin(self, path: str) -> str:
        with urllib.request.urlopen(f"http://{self.admin_address}{path}", timeout=2) as r:
            return r.read().decode()

    def _wait(self, check, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if check():
                    return
            except OSError:
                pass
            time.sleep(0.05)
        raise ServiceError(
            f"mooncake: {what} not reached after {timeout_s}s (logs in {self.work_dir})"
        )


def client_store_config(store: StoreConfig, services: MooncakeServices) -> StoreConfig:
    """The StoreConfig a client of `services` uses: `store` with the services' addresses in
    its `mooncake` section and URI (the URI alone then reaches the store)."""
    store_id = store.store_id or parse_uri(store.uri)[1] or "default"
    mc = services.config(
        **store.mooncake.model_dump(
            exclude={"master", "metadata", "admin", "local_hostname", "segment_bytes"}
        )
    )
    return store.model_copy(update={"uri": mooncake_uri(store_id, mc), "mooncake": mc})


def start_mooncake(
    store: StoreConfig, run_dir: str | Path, **kw
) -> tuple[MooncakeServices, StoreConfig]:
    """Start the services sized by the store config under `<run_dir>/mooncake` and return them
    with the StoreConfig a client uses (its URI carries the addresses). The node's segment is
    `store.mooncake.segment_bytes`, by default `store.budget_bytes`: the master's refusal is
    then the budget's exact check (`segment_bytes_for`). `specbus store` runs them as a
    service of its own (`ops/up.py`)."""
    segment = segment_bytes_for(store.budget_bytes, store.mooncake.segment_bytes)
    services = MooncakeServices(Path(run_dir) / "mooncake", segment_bytes=segment, **kw).start()
    return services, client_store_config(store, services)
