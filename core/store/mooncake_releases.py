"""Releases Mooncake refuses for now, retried until they go (`MooncakeStore.release`).

A remove right after a read fails with -706 while the reader's lease lives (10 s by
default), and fails outright while the master is away. `Releases.remove` tries once; what is
refused is pending: a background thread retries it on a schedule (`release_retry_s`,
doubling to 5 s) and forces it once it was first refused `force_release_after_s` ago (every
read lease has lapsed by then). A pending key reads as released (`in`), and a put of the
same key takes it back (`forget`). What is still pending when the process dies is re-derived
by the next sweep from the trainer's ledger (docs/store.md).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from specbus.core.config import MooncakeConfig
from specbus.core.store.mooncake_client import OBJECT_NOT_FOUND, OK, check_reachable

log = logging.getLogger("specbus.core.store.mooncake")


@dataclass
class Pending:
    """A refused remove: its bytes, when it was first refused, when it is due again."""

    nbytes: int
    first: float
    due: float
    attempts: int = 0


class Releases:
    """The pending removes of one store handle and the thread that retries them."""

    def __init__(self, client, mc: MooncakeConfig, uri: str):
        self.client, self.mc, self.uri = client, mc, uri
        self._pending: dict[str, Pending] = {}
        self.retried_bytes = 0  # bytes freed by retried removes, ever (sweep counts its share)
        self._cond = threading.Condition()  # over an RLock: re-entrant (close from a signal)
        self._closed = False  # the retrier stops
        self._retrier = threading.Thread(
            target=self._retry_loop, name="mooncake-release", daemon=True
        )
        self._retrier.start()

    def __contains__(self, key: object) -> bool:
        """A pending key: released or superseded here, though the store still holds it."""
        return key in self._pending

    def pending_bytes(self) -> int:
        """Bytes of the removes still pending."""
        with self._cond:
            return sum(p.nbytes for p in self._pending.values())

    def forget(self, keys: Iterable[str]) -> None:
        """These keys are being written again (or removed forced): no pending remove of them
        may delete the new value."""
        with self._cond:
            for key in keys:
                self._pending.pop(key, None)

    def clear(self) -> None:
        """Forget every pending remove (a purge removed them by pattern)."""
        with self._cond:
            self._pending.clear()

    def remove(self, keys: list[str], sizes: Mapping[str, int] | None = None) -> int:
        """Remove now; what the store refuses (read lease, master away) is retried later.
        Returns the bytes (as `sizes` says) of the keys removed now."""
        if not keys:
            return 0
        codes = self.client.batch_remove(keys, False)
        now = time.monotonic()
        freed = 0
        with self._cond:
            for key, code in zip(keys, codes, strict=True):
                if code == OK:
                    freed += (sizes or {}).get(key, 0)
                elif code != OBJECT_NOT_FOUND and key not in self._pending:
                    nbytes = (sizes or {}).get(key, 0)
                    self._pending[key] = Pending(nbytes, now, now + self.mc.release_retry_s)
            self._cond.notify()
        return freed

    def discard(self, keys: list[str], sizes: Mapping[str, int]) -> None:
        """Remove what a failed put wrote (no half-written or rejected sample stays behind),
        forced: nobody may hold a read lease on unpublished keys but this handle's own
        existence check. Keys the store will not remove now (master away) go to the retrier,
        due at once and forced, so their bytes still go."""
        try:
            codes = self.client.batch_remove(keys, True)
        except Exception:  # noqa: BLE001 - the put's own error is the one to raise; retried
            codes = [None] * len(keys)
        now = time.monotonic()
        with self._cond:
            for key, code in zip(keys, codes, strict=True):
                if code not in (OK, OBJECT_NOT_FOUND):
                    forced_from = now - self.mc.force_release_after_s
                    self._pending[key] = Pending(sizes.get(key, 0), forced_from, now)
            self._cond.notify()

    def _retry_loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not self._due():
                    wait = min(
                        (p.due for p in self._pending.values()), default=time.monotonic() + 3600
                    )
                    self._cond.wait(max(wait - time.monotonic(), 0.01))
                if self._closed:
                    return
            try:
                self.retry_due(time.monotonic())
            except Exception:  # noqa: BLE001 - a dead master must not kill the retrier; retried later
                time.sleep(self.mc.release_retry_s)

    def _due(self) -> bool:
        now = time.monotonic()
        return any(p.due <= now for p in self._pending.values())

    def retry_due(self, now: float, everything: bool = False) -> None:
        """Retry the removes that are due (all with `everything`): gently, forced for those
        first refused `force_release_after_s` ago (every read lease has lapsed by then)."""
        with self._cond:
            due = {k: p for k, p in self._pending.items() if everything or p.due <= now}
        if not due:
            return
        force = [k for k, p in due.items() if now - p.first >= self.mc.force_release_after_s]
        gentle = [k for k in due if k not in set(force)]
        results = {}
        for keys, forced in ((gentle, False), (force, True)):
            if keys:
                results.update(zip(keys, self.client.batch_remove(keys, forced), strict=True))
        with self._cond:
            for key, code in results.items():
                p = self._pending.get(key)
                if p is None:
                    continue
                if code in (OK, OBJECT_NOT_FOUND):
                    del self._pending[key]
                    if code == OK:
                        self.retried_bytes += p.nbytes
                else:
                    p.attempts += 1
                    p.due = now + min(self.mc.release_retry_s * 2**p.attempts, 5.0)

    def settle(self, deadline: float) -> int:
        """Retry every pending remove now, then every `release_retry_s / 2` (at most 0.25 s)
        until none is left or `deadline`. Gives up at once without a master (a TCP probe of
        at most 1 s): nothing can be freed there, and a restarted master holds none of these
        objects. Returns the bytes freed by retries meanwhile (the background retrier's too)."""
        with self._cond:
            before = self.retried_bytes
        while True:
            with self._cond:
                if not self._pending:
                    break
            try:
                check_reachable(self.mc.master, 1.0)
                self.retry_due(time.monotonic(), everything=True)
            except Exception as e:  # noqa: BLE001 - master gone: nothing more can be freed
                log.warning("%s: cannot retry pending removes: %s", self.uri, e)
                break
            left = deadline - time.monotonic()
            with self._cond:
                if not self._pending or left <= 0:
                    break
            time.sleep(min(self.mc.release_retry_s / 2, 0.25, left))
        with self._cond:
            return self.retried_bytes - before

    def close(self) -> None:
        """Stop the retrier. Removes still refused are named in a warning: the next
        sweep(done) re-derives them from the trainer's record."""
        with self._cond:
            left = list(self._pending.values())
            self._closed = True
            self._cond.notify_all()
        if left:
            log.warning(
                "%s: %d released object(s) (%d B) still refused at close (read lease or master "
                "away); the next sweep(done) of this store removes them",
                self.uri,
                len(left),
                sum(p.nbytes for p in left),
            )
        self._retrier.join(timeout=5)
