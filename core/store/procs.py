"""Process identity that survives pid reuse: `<pid>-<start time>` tokens and a liveness check."""

from __future__ import annotations

import os

_SELF: str | None = None
_HAVE_PROC = os.path.exists("/proc/self/stat")


def _start_time(pid: int) -> str | None:
    """The kernel's start time of `pid` (clock ticks since boot), None if gone or a zombie."""
    if not _HAVE_PROC:
        return ""  # not Linux: unknown start time, `alive` falls back to signal 0
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError):
        return None
    rest = stat[stat.rfind(")") + 2 :].split()  # the command name may contain spaces
    if rest[0] in ("Z", "X"):
        return None
    return rest[19]


def token() -> str:
    """This process's identity, `<pid>-<start time>`."""
    global _SELF
    if _SELF is None or not _SELF.startswith(f"{os.getpid()}-"):  # forked children get their own
        _SELF = f"{os.getpid()}-{_start_time(os.getpid()) or 0}"
    return _SELF


def alive(tok: str) -> bool:
    """Whether the process named by a token still runs (a reused pid does not count)."""
    pid_text, _, start = tok.partition("-")
    try:
        pid = int(pid_text)
    except ValueError:
        return False
    current = _start_time(pid)
    if current is None:
        return False
    if current == "":  # no /proc: fall back to signal 0
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return current == start
