"""The Mooncake master's HTTP admin endpoint: the store's view, without read leases.

Allocated and total bytes of the cluster (budget checks, usage), the key listing (gc, sweep)
and object sizes (adopt, release accounting). None of these take a read lease, unlike the
client's existence probes. Every call raises `StoreUnavailable` when the endpoint does not
answer within `mooncake.http_timeout_s`.
"""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.parse
import urllib.request

from specbus.core.config import MooncakeConfig
from specbus.core.errors import StoreUnavailable

log = logging.getLogger("specbus.core.store.mooncake")
_warned: set[str] = set()  # clusters whose approximate budget this process named already

# Mooncake 0.3.13 mounts no segment smaller than this (the node's setup fails with -600).
MIN_SEGMENT_BYTES = 16 << 20


def segment_bytes_for(budget_bytes: int, segment_bytes: int | None) -> int:
    """The store node's segment for a store of `budget_bytes`: `segment_bytes` when given,
    else the budget itself (so that the master's refusal is the budget's exact check), at
    least Mooncake's smallest segment."""
    return segment_bytes if segment_bytes is not None else max(budget_bytes, MIN_SEGMENT_BYTES)


def admin_address(mc: MooncakeConfig) -> str:
    """`mooncake.admin`, else the master's host on port 9003 (Mooncake's default)."""
    return mc.admin or f"{mc.master.rsplit(':', 1)[0]}:9003"


class MooncakeAdmin:
    """HTTP client of the admin endpoint of the cluster `mc` names (`uri` for messages)."""

    def __init__(self, mc: MooncakeConfig, uri: str):
        self.url = f"http://{admin_address(mc)}"
        self.timeout_s = mc.http_timeout_s
        self.uri = uri

    def _get(self, path: str) -> str:
        try:
            with urllib.request.urlopen(self.url + path, timeout=self.timeout_s) as r:
                return r.read().decode()
        except (urllib.error.URLError, OSError) as e:
            raise StoreUnavailable(
                f"{self.uri}: Mooncake master admin {self.url} unreachable: {e}"
            ) from e

    def metrics(self) -> tuple[int, int]:
        """(allocated bytes, capacity bytes) of the Mooncake cluster, as the master sees it."""
        values = {}
        for line in self._get("/metrics").splitlines():
            name, _, value = line.partition(" ")
            if name in ("master_allocated_bytes", "master_total_capacity_bytes"):
                values[name] = int(float(value))
        return values.get("master_allocated_bytes", 0), values.get("master_total_capacity_bytes", 0)

    def check_budget(self, budget_bytes: int) -> None:
        """Say once per cluster and process when its capacity exceeds `budget_bytes`: puts
        are then bounded by a sampled count that concurrent writers can overshoot, not by
        the master's own refusal (a segment sized to the budget). Never raises."""
        try:
            capacity = self.metrics()[1]
        except StoreUnavailable:
            return
        if capacity > budget_bytes and self.url not in _warned:
            _warned.add(self.url)
            log.warning(
                "%s: the Mooncake cluster holds %d B, more than store.budget_bytes=%d: the "
                "budget is checked against the master's count sampled every "
                "mooncake.usage_refresh_s plus this process's puts, which several writers "
                "can overshoot (by what they put meanwhile; the segment still bounds memory). "
                "For an exact budget, size the store node's segment to it (`specbus store` "
                "does, from %d B up: Mooncake's smallest segment)",
                self.uri, capacity, budget_bytes, MIN_SEGMENT_BYTES,
            )  # fmt: skip

    def list_keys(self, store_id: str) -> list[str]:
        """Every key of the store `store_id` (keys are `{store_id}/...`)."""
        prefix = f"{store_id}/"
        return [k for k in self._get("/get_all_keys").splitlines() if k.startswith(prefix)]

    def object_sizes(self, keys: list[str]) -> dict[str, int]:
        """The stored size of each of `keys` that exists (absent keys are left out)."""
        sizes = {}
        for i in range(0, len(keys), 64):  # bounded URL length
            chunk = keys[i : i + 64]
            q = urllib.parse.quote(",".join(chunk), safe=",/")
            data = json.loads(self._get(f"/batch_query_keys?keys={q}")).get("data") or {}
            for key, entry in data.items():
                if entry.get("ok") and entry.get("values"):
                    sizes[key] = int(entry["values"][0]["size_"])
        return sizes
