"""An asyncio event loop on a daemon thread, so synchronous training code can use the async bus.

The training loop stays plain PyTorch; bus work (fetches, heartbeats, acks) runs on this loop.
`call(coro)` blocks for the result and re-raises its exception; `submit(coro)` returns a future.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class LoopThread:
    """An asyncio loop on a daemon thread (see the module doc)."""

    def __init__(self, name: str = "specbus-bus"):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule `coro` on the loop; its future."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run `coro` on the loop and wait for its result (its exception re-raised); `timeout` in
        seconds."""
        return self.submit(coro).result(timeout)

    def close(self) -> None:
        """Cancel what still runs on the loop (bounded to 10 s), stop it and join the thread."""
        if not self.loop.is_running():
            return

        async def _cancel_rest() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            self.call(_cancel_rest(), timeout=10)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
