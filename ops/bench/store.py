"""Feature store throughput: specbus store vs raw Mooncake, shm vs memcpy, file:// vs raw
safetensors, http:// vs a raw HTTP GET.

    python -m specbus.ops.bench.store [--sizes-mb 4,64] [--total-mb 256] [--rounds 5]
        [--paths mooncake,shm,file,http] [--json out.json]

A writer process and a reader process (separate interpreters, torch single-threaded) take
commands from this coordinator. Per tensor size S, `total/S` bf16 tensors are moved by:
- raw Mooncake: `put_from` / `get_into` on one registered buffer (the best Mooncake can do);
- specbus mooncake://: `store.put` / `store.get` (default config: NaN screen on, CRC off),
  and `store.put` of a tensor from `store.alloc` (what a capture writing into store memory gets);
- specbus shm://: `store.put` / `store.get` (also put with the NaN screen off);
- memcpy: `dst.copy_(src)` of the same bytes into touched buffers, one per tensor, reused
  every round (as the store reuses its released files; see `Worker.touched`);
- specbus file:// (a directory under the bench's temporary directory, on disk, page cache
  warm): `store.put` vs `safetensors.torch.save_file` of the same tensor, and `store.get`
  (also with `crc: true`, what `specbus capture` records) vs `safetensors.torch.load_file` of
  the same file; both reads map the file, so each is followed by the same consumption, a copy
  of the tensor into a touched buffer (the collate's copy), timed with it;
- specbus http:// (a feature server with mem:// behind it in the writer process, the client
  in the reader): `store.get` vs a raw `GET` of the same URL with the same pooled aiohttp
  session (`await resp.read()`), and, for scale, vs the shm get of the same size.
The writer puts, then the reader gets. Each specbus operation runs right after the same
operation on its baseline (op by op, alternating), so both see the same machine load: on a
shared 2-core box that matters more than anything else. Every phase runs `rounds` times after
one unmeasured warm-up round; the table shows median GB/s and the median of per-round ratios
(goals: mooncake path >= 0.8x raw Mooncake, shm path >= 0.5x memcpy, file get >= 0.8x
safetensors load, http get >= 0.8x raw GET).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GB = 1e9


# ---- worker side -------------------------------------------------------------------------


class Worker:
    """Runs in the writer/reader processes: one JSON command per stdin line, one reply."""

    def __init__(self) -> None:
        import torch

        torch.set_num_threads(1)
        self.torch = torch
        self.stores: dict[str, object] = {}
        self.raw = None
        self.raw_bufs: dict[int, object] = {}
        self.dsts: dict[int, list] = {}

    def store(self, uri: str, **kw):
        key = uri + json.dumps(kw, sort_keys=True)
        if key not in self.stores:
            from specbus.core.store import open_store

            self.stores[key] = open_store(uri, **kw)
        return self.stores[key]

    def touched(self, size: int, n: int) -> list:
        """The memcpy baseline's destinations: one bf16 buffer per tensor, touched once and
        reused every round, as the store's released files are (recycled, already faulted).
        (Measured: the same speed as fresh buffers zeroed each round; this is for symmetry.)"""
        if size not in self.dsts:
            self.dsts[size] = [
                self.torch.zeros(size // 2, dtype=self.torch.bfloat16) for _ in range(n)
            ]
        return self.dsts[size]

    def raw_buf(self, master: str, size: int):
        if self.raw is None:
            from mooncake.store import MooncakeDistributedStore

            self.raw = MooncakeDistributedStore()
            rc = self.raw.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", master)
            assert rc == 0, f"raw mooncake setup failed: {rc}"
            from mooncake.store import ReplicateConfig

            self.pinned = ReplicateConfig()  # hard-pinned like the store's objects: never evicted
            self.pinned.with_hard_pin = True
        if size not in self.raw_bufs:
            buf = self.torch.randint(0, 255, (size,), dtype=self.torch.uint8)
            assert self.raw.register_buffer(buf.data_ptr(), size) == 0
            self.raw_bufs[size] = buf
        return self.raw_bufs[size]

    def run(self, cmd: dict) -> dict:
        torch = self.torch
        op, size, n, tag = cmd["op"], cmd.get("size", 0), cmd.get("n", 0), cmd.get("tag", "")
        clock: dict[str, float] = {}

        def timed(name, fn, *args):
            t0 = time.perf_counter()
            out = fn(*args)
            clock[name] = clock.get(name, 0.0) + time.perf_counter() - t0
            return out

        if op == "mooncake_put":
            buf = self.raw_buf(cmd["master"], size)
            store = self.store(cmd["uri"])
            unscreened = self.store(cmd["uri"], screen_nonfinite=False)
            t = torch.randn(size // 2).to(torch.bfloat16)
            pooled = store.alloc(tuple(t.shape), t.dtype).copy_(t)  # a capture into store memory
            specs = []
            for i in range(n):
                key = f"raw/{tag}/{i}"
                rc = timed("raw_put", self.raw.put_from, key, buf.data_ptr(), size, self.pinned)
                assert rc == 0, f"put_from: {rc}"
                specs.append(timed("mooncake_put", store.put, f"{tag}-{i}", {"hidden": t}))
                specs.append(
                    timed("mooncake_put_alloc", store.put, f"{tag}-a{i}", {"hidden": pooled})
                )
                specs.append(
                    timed("mooncake_put_noscreen", unscreened.put, f"{tag}-n{i}", {"hidden": t})
                )
            return {"clock": clock, "specs": [s["hidden"].model_dump_json() for s in specs]}
        if op == "mooncake_get":
            from specbus.core.contracts import FeatureSpec

            buf = self.raw_buf(cmd["master"], size)
            store = self.store(cmd["uri"])
            specs = [FeatureSpec.model_validate_json(s) for s in cmd["specs"]]
            keys = [f"raw/{tag}/{i}" for i in range(n)]
            for key, spec in zip(keys, specs[::3], strict=True):  # the plain puts' samples
                rc = timed("raw_get", self.raw.get_into, key, buf.data_ptr(), size)
                assert rc == size, f"get_into: {rc}"
                timed("mooncake_get", store.get, {"hidden": spec})  # dies at once: pool reuse
            self.raw.batch_remove(keys, True)  # untimed cleanup; forced (our own read leases)
            for spec in specs:
                store.release({"hidden": spec})
            return {"clock": clock}
        if op == "shm_put":
            store = self.store(cmd["uri"])
            unscreened = self.store(cmd["uri"], screen_nonfinite=False)
            t = torch.randn(size // 2).to(torch.bfloat16)
            dsts = self.touched(size, n)
            specs, unscreened_specs = [], []
            for i, dst in enumerate(dsts):
                timed("memcpy", dst.copy_, t)
                specs.append(timed("shm_put", store.put, f"{tag}-{i}", {"hidden": t})["hidden"])
                unscreened_specs.append(
                    timed("shm_put_noscreen", unscreened.put, f"{tag}-n{i}", {"hidden": t})[
                        "hidden"
                    ]
                )
            return {
                "clock": clock,
                "specs": [s.model_dump_json() for s in specs + unscreened_specs],
            }
        if op == "shm_get":
            from specbus.core.contracts import FeatureSpec

            store = self.store(cmd["uri"])
            specs = [FeatureSpec.model_validate_json(s) for s in cmd["specs"]]
            src = torch.randn(size // 2).to(torch.bfloat16)
            dsts = self.touched(size, n)
            for spec, dst in zip(specs, dsts, strict=False):
                timed("memcpy_read", dst.copy_, src)
                timed("shm_get", store.get, {"hidden": spec})
            for spec in specs:
                store.release({"hidden": spec})
            return {"clock": clock}
        if op == "file_put":
            from safetensors.torch import save_file

            store = self.store(cmd["uri"])
            crc = self.store(cmd["uri"], crc=True)
            t = torch.randn(size // 2).to(torch.bfloat16)
            raw_dir = Path(cmd["raw_dir"])
            raw_dir.mkdir(parents=True, exist_ok=True)
            specs, crc_specs, paths = [], [], []
            for i in range(n):
                path = raw_dir / f"{tag}-{i}.safetensors"
                timed("raw_st_save", save_file, {"hidden": t}, str(path))
                specs.append(timed("file_put", store.put, f"{tag}-{i}", {"hidden": t})["hidden"])
                crc_specs.append(crc.put(f"{tag}-c{i}", {"hidden": t})["hidden"])  # untimed
                paths.append(str(path))
            return {
                "clock": clock,
                "specs": [x.model_dump_json() for x in specs + crc_specs],
                "paths": paths,
            }
        if op == "file_get":
            from safetensors.torch import load_file
            from specbus.core.contracts import FeatureSpec

            store = self.store(cmd["uri"])
            specs = [FeatureSpec.model_validate_json(x) for x in cmd["specs"]]
            plain, checked = specs[:n], specs[n:]
            dsts = self.touched(size, n)

            def raw(path, dst):
                dst.copy_(load_file(path)["hidden"])

            def ours(spec, dst):
                dst.copy_(store.get({"hidden": spec})["hidden"])

            for path, spec, spec_crc, dst in zip(cmd["paths"], plain, checked, dsts, strict=True):
                timed("raw_st_load", raw, path, dst)
                timed("file_get", ours, spec, dst)
                timed("file_get_crc", ours, spec_crc, dst)
            for spec in specs:
                store.release({"hidden": spec})
            for path in cmd["paths"]:
                os.unlink(path)
            return {"clock": clock}
        if op == "http_put":
            if "served" not in self.stores:
                from specbus.core.config import StoreConfig
                from specbus.producers.feature_server import serve_store

                self.stores["served"] = serve_store(
                    StoreConfig(uri="http://127.0.0.1:0/bench", budget_bytes=8 << 30)
                )
            served = self.stores["served"]
            t = torch.randn(size // 2).to(torch.bfloat16)
            specs = [served.put(f"{tag}-{i}", {"hidden": t.clone()})["hidden"] for i in range(n)]
            return {"clock": {}, "specs": [x.model_dump_json() for x in specs], "uri": served.uri}
        if op == "http_get":
            import urllib.parse

            from specbus.core.contracts import FeatureSpec
            from specbus.core.store.http import client

            store = self.store(cmd["uri"])
            specs = [FeatureSpec.model_validate_json(x) for x in cmd["specs"]]
            http = client()

            async def raw_get(url: str) -> bytes:  # the session the store's gets use
                session = http.session(store.address, store.cfg.http.connections)
                async with session.get(url, params={"names": "hidden"}) as resp:
                    assert resp.status == 200, resp.status
                    return await resp.read()

            for spec in specs:
                sid = spec.key.split("/")[1]
                url = f"{store.base}/samples/{urllib.parse.quote(sid, safe='')}/g0"
                got = timed("raw_http_get", http.call, raw_get(url))
                assert len(got) == size
                del got
                timed("http_get", store.get, {"hidden": spec})  # dies at once: pool reuse
            for spec in specs:
                store.release({"hidden": spec})
            return {"clock": clock}
        if op == "close":
            for store in reversed(list(self.stores.values())):
                store.close()
            return {}
        raise ValueError(f"unknown op {op!r}")


def worker_main() -> None:
    worker = Worker()
    for line in sys.stdin:
        try:
            reply = worker.run(json.loads(line))
        except Exception as e:  # noqa: BLE001 - reported to the coordinator, which fails loudly
            reply = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(reply), flush=True)


# ---- coordinator side --------------------------------------------------------------------


class Proc:
    def __init__(self, name: str):
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "specbus.ops.bench.store", "--worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).resolve().parents[2],
        )

    def __call__(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name} worker died")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"{self.name}: {reply['error']}")
        return reply

    def close(self) -> None:
        self(op="close")
        self.proc.stdin.close()
        self.proc.wait(30)


PAIRS = {  # ratio name: (specbus GB/s key, baseline GB/s key)
    "mooncake_put_vs_raw": ("mooncake_put", "raw_put"),
    "mooncake_put_alloc_vs_raw": ("mooncake_put_alloc", "raw_put"),
    "mooncake_put_noscreen_vs_raw": ("mooncake_put_noscreen", "raw_put"),
    "mooncake_get_vs_raw": ("mooncake_get", "raw_get"),
    "shm_put_vs_memcpy": ("shm_put", "memcpy"),
    "shm_put_noscreen_vs_memcpy": ("shm_put_noscreen", "memcpy"),
    "shm_get_vs_memcpy": ("shm_get", "memcpy_read"),
    "file_put_vs_safetensors": ("file_put", "raw_st_save"),
    "file_get_vs_safetensors": ("file_get", "raw_st_load"),
    "file_get_crc_vs_safetensors": ("file_get_crc", "raw_st_load"),
    "http_get_vs_raw_http": ("http_get", "raw_http_get"),
}
SCALE = {  # ratios of medians measured in different phases (not op by op): for scale only
    "http_get_vs_shm_get": ("http_get", "shm_get"),
}
PATHS = ("mooncake", "shm", "file", "http")


def bench(sizes_mb: list[int], total_mb: int, rounds: int, paths=PATHS) -> dict:
    # The segment holds a phase's four sets (raw and three puts) plus removes that trail.
    segment = 5 * max(total_mb, 2 * max(sizes_mb)) << 20
    with tempfile.TemporaryDirectory(dir=os.environ.get("SPECBUS_BENCH_DIR")) as tmp:
        services = None
        writer, reader = Proc("writer"), Proc("reader")
        try:
            where: dict[str, dict] = {}
            if "mooncake" in paths:
                from specbus.ops.services.mooncake import MooncakeServices

                services = MooncakeServices(tmp, segment_bytes=segment, lease_ttl_ms=500).start()
                where["mooncake"] = {
                    "uri": services.uri("bench"),
                    "master": services.master_address,
                }
            if "shm" in paths:
                # the shm cache of released files holds a round's two sets (screened, unscreened)
                where["shm"] = {
                    "uri": f"shm://bench-{os.getpid()}?recycle_bytes={2 * total_mb << 20}"
                }
            if "file" in paths:
                where["file"] = {"uri": f"file://{tmp}/files", "raw_dir": f"{tmp}/raw"}
            if "http" in paths:
                where["http"] = {}
            results = {}
            for size_mb in sizes_mb:
                size, n = size_mb << 20, max(total_mb // size_mb, 2)
                gbps: dict[str, list[float]] = {}
                for r in range(rounds + 1):  # round 0 warms up (connections, pools, shm pages)
                    clock: dict[str, float] = {}
                    for path, args in where.items():
                        put = writer(op=f"{path}_put", size=size, n=n, tag=f"{size_mb}-{r}", **args)
                        clock |= put["clock"]
                        get_args = {**args, **({"uri": put["uri"]} if "uri" in put else {})}
                        extra = {"paths": put["paths"]} if "paths" in put else {}
                        clock |= reader(
                            op=f"{path}_get",
                            size=size,
                            n=n,
                            tag=f"{size_mb}-{r}",
                            specs=put["specs"],
                            **get_args,
                            **extra,
                        )["clock"]
                    if r:
                        for name, seconds in clock.items():
                            gbps.setdefault(name, []).append(n * size / seconds / GB)
                medians = {k: statistics.median(v) for k, v in gbps.items()}
                ratios = {
                    name: statistics.median(a / b for a, b in zip(gbps[x], gbps[y], strict=True))
                    for name, (x, y) in PAIRS.items()
                    if x in gbps and y in gbps
                }
                ratios |= {
                    name: medians[x] / medians[y]
                    for name, (x, y) in SCALE.items()
                    if x in medians and y in medians
                }
                results[f"{size_mb}MB"] = {"gbps": medians, "rounds": gbps, "ratios": ratios}
            return results
        finally:
            for p in (writer, reader):
                try:
                    p.close()
                except Exception:  # noqa: BLE001 - tear down what is left
                    p.proc.kill()
            if services is not None:
                services.stop()


def report(results: dict) -> str:
    rows = [
        ("raw Mooncake put_from", "raw_put", None),
        ("specbus mooncake put", "mooncake_put", "mooncake_put_vs_raw"),
        ("specbus mooncake put, alloc()'d", "mooncake_put_alloc", "mooncake_put_alloc_vs_raw"),
        (
            "specbus mooncake put, no NaN screen",
            "mooncake_put_noscreen",
            "mooncake_put_noscreen_vs_raw",
        ),
        ("raw Mooncake get_into", "raw_get", None),
        ("specbus mooncake get", "mooncake_get", "mooncake_get_vs_raw"),
        ("memcpy (writer side)", "memcpy", None),
        ("specbus shm put", "shm_put", "shm_put_vs_memcpy"),
        ("specbus shm put, no NaN screen", "shm_put_noscreen", "shm_put_noscreen_vs_memcpy"),
        ("memcpy (reader side)", "memcpy_read", None),
        ("specbus shm get", "shm_get", "shm_get_vs_memcpy"),
        ("safetensors save_file", "raw_st_save", None),
        ("specbus file put", "file_put", "file_put_vs_safetensors"),
        ("safetensors load_file + copy", "raw_st_load", None),
        ("specbus file get + copy", "file_get", "file_get_vs_safetensors"),
        ("specbus file get + copy, CRC", "file_get_crc", "file_get_crc_vs_safetensors"),
        ("raw HTTP GET (same aiohttp client)", "raw_http_get", None),
        ("specbus http get", "http_get", "http_get_vs_raw_http"),
        ("specbus http get / shm get (scale)", None, "http_get_vs_shm_get"),
    ]
    sizes = list(results)
    lines = [f"{'GB/s (median of rounds)':36}" + "".join(f"{s:>9} {'ratio':>6}" for s in sizes)]
    for label, key, ratio in rows:
        if not any(
            (key or ratio) in (results[s]["gbps"] if key else results[s]["ratios"]) for s in sizes
        ):
            continue
        cells = ""
        for size in sizes:
            r = results[size]
            q = f"{r['ratios'][ratio]:6.2f}" if ratio and ratio in r["ratios"] else f"{'':6}"
            g = f"{r['gbps'][key]:9.2f}" if key and key in r["gbps"] else f"{'':9}"
            cells += f"{g} {q}"
        lines.append(f"{label:36}{cells}")
    lines.append(
        "ratio = median over rounds of specbus / its baseline measured op by op alongside "
        "(mooncake: raw Mooncake; shm: memcpy of the same bytes in the same process; file: "
        "safetensors on the same bytes; http: a raw GET of the same bytes, same client; "
        "http/shm: ratio of the medians, for scale)"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--sizes-mb", default="4,64")
    ap.add_argument("--total-mb", type=int, default=256, help="bytes moved per phase and path")
    ap.add_argument("--rounds", type=int, default=5)  # a shared box: more rounds, steadier medians
    ap.add_argument("--paths", default=",".join(PATHS), help="mooncake,shm,file,http")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.worker:
        worker_main()
        return 0
    paths = tuple(p for p in args.paths.split(",") if p)
    unknown = set(paths) - set(PATHS)
    if unknown:
        ap.error(f"unknown paths {sorted(unknown)} (of {', '.join(PATHS)})")
    results = bench([int(s) for s in args.sizes_mb.split(",")], args.total_mb, args.rounds, paths)
    print(report(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
