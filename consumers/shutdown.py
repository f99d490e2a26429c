"""Graceful stop on SIGINT/SIGTERM: finish the current step, save, give back, exit 0.

`stop_on_signals()` installs handlers (main thread only) that set an event on the first
SIGINT or SIGTERM; the loader turns it into a lockstep STOP, so every rank stops at the same
step boundary, gives back its leases and the trainer saves a checkpoint at the last optimizer
step. A second signal restores the default action and re-sends itself: the process ends now.
torchrun stops the surviving ranks with SIGTERM when one rank dies, and Ctrl-C reaches every
rank as SIGINT: both are this path. SIGHUP is the same stop but never escalates, however often
it comes: an elastic rank gets it when its torchrun agent dies (ops/elastic.py
`die_with_agent`), once per thread of the dead agent.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Iterator

log = logging.getLogger("specbus.train")

SIGNALS = (signal.SIGINT, signal.SIGTERM)
SOFT_SIGNALS = (signal.SIGHUP,)  # a stop that a repeat never turns into "exit now"


@contextlib.contextmanager
def stop_on_signals(stop: threading.Event | None = None) -> Iterator[threading.Event]:
    """Within the block, SIGINT/SIGTERM/SIGHUP set the returned event (a second SIGINT or
    SIGTERM ends the process at once). Outside the main thread nothing is installed (the event still works
    when set by hand). The previous handlers are restored on exit."""
    stop = stop if stop is not None else threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def handle(signum, frame) -> None:
        name = signal.Signals(signum).name
        if stop.is_set() and signum in SOFT_SIGNALS:
            return
        if stop.is_set():
            log.warning("%s again: exiting now", name)
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        stop.set()
        log.warning(
            "%s: stopping after the current step (checkpoint, leases given back); "
            "send it again to exit now", name
        )  # fmt: skip

    previous = {sig: signal.signal(sig, handle) for sig in (*SIGNALS, *SOFT_SIGNALS)}
    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
