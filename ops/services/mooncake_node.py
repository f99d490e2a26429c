"""The Mooncake store node: a process that owns the segment memory feature tensors live in.

Producers and trainers contribute no segment (their objects would die with them); this
process mounts one segment of `--segment-bytes` with the master and then only waits. Mooncake
re-mounts it by itself when the master restarts. SIGTERM unmounts and exits; kill -9 loses the
segment (clients then see FeatureMissing, the tasks get recaptured).

    python -m specbus.ops.services.mooncake_node --master 127.0.0.1:50051 --segment-bytes 1073741824
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

READY = "specbus mooncake node ready"


def main(argv: list[str] | None = None) -> int:
    """Run a store node contributing its segment until SIGTERM (the services start it)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--master", required=True, help="mooncake_master RPC address host:port")
    ap.add_argument(
        "--metadata", default="P2P", help='"P2P" handshake or http://host:port/metadata'
    )
    ap.add_argument("--segment-bytes", type=int, required=True)
    ap.add_argument("--buffer-bytes", type=int, default=16 << 20)
    ap.add_argument("--hostname", default="127.0.0.1")
    ap.add_argument("--protocol", default="tcp", choices=["tcp", "rdma"])
    ap.add_argument("--device", default="")
    args = ap.parse_args(argv)

    os.environ.setdefault("MC_TCP_BIND_ADDRESS", args.hostname)
    from mooncake.store import MooncakeDistributedStore  # not torch, not core.store: starts fast

    store = MooncakeDistributedStore()
    rc = store.setup(
        args.hostname,
        "P2PHANDSHAKE" if args.metadata.upper() in ("P2P", "P2PHANDSHAKE") else args.metadata,
        args.segment_bytes,
        args.buffer_bytes,
        args.protocol,
        args.device,
        args.master,
    )
    if rc != 0:
        print(f"mooncake node setup failed with code {rc}", file=sys.stderr, flush=True)
        return 1
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(f"{READY} {store.get_hostname()} segment={args.segment_bytes}", flush=True)
    while not stop.wait(3600):
        pass
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
