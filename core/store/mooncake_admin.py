"""The Mooncake master's HTTP admin endpoint: the store's view, without read leases.

Allocated and total bytes of the cluster (budget checks, usage), the key listing (gc, sweep)
and object sizes (adopt, release accounting). None of these take a read lease, unlike the
client's existence probes. Every call raises `StoreUnavailable` when the endpoint does not
answer within `mooncake.http_timeout_s`.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request

from specbus.core.config import MooncakeConfig
from specbus.core.errors import StoreUnavailable


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
