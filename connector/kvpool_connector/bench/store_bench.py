"""`kvpool bench store`: each tier of the store against the raw baseline for the same bytes.

For every tier it writes and reads N chunks (default 64 x 2 MiB: 256 tokens of an 8B-class
model's KV for one rank) through the store, and in the same run moves the same bytes the
plain way: memcpy into / out of a preallocated buffer (cpu), one file per chunk written and
read in the same directory (disk), pipelined SET / GET with redis-py (redis), put_object /
get_object with boto3 at the same concurrency (s3). Rounds alternate baseline and store;
each round writes new keys (as a serving engine does; the cpu tier evicts from round 2 on)
and reads them back; the best round of each counts. It also times `contains_prefix` on 128 keys and the disk
tier's index rebuild at start.

Without --redis-url / --s3-endpoint it starts a private redis-server / moto S3 server
(kvpool_connector.testbed.servers). Goal: ratio >= 0.8 both ways, contains_prefix on 128
keys under 100 us for cpu and disk.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np

from ..config import parse_size
from ..store import open_store

RATIO_GOAL = 0.8
CONTAINS_GOAL_US = 100.0
TIERS = ("cpu", "disk", "redis", "s3")


def best_rate(fn: Callable[[], None], nbytes: int) -> float:
    """Bytes/s of one timed call."""
    t0 = time.perf_counter()
    fn()
    return nbytes / (time.perf_counter() - t0)


class Bench:
    def __init__(self, args, workdir: str) -> None:
        self.args = args
        self.workdir = workdir
        self.size = parse_size(args.chunk_size)
        self.stack = contextlib.ExitStack()
        self.rng = np.random.default_rng(0)

    # -- data -----------------------------------------------------------------------------
    def chunks(self, n: int) -> tuple[list[bytes], list[memoryview]]:
        keys = [os.urandom(32) for _ in range(n)]
        vals = [memoryview(self.rng.integers(0, 256, self.size, dtype=np.uint8)) for _ in range(n)]
        return keys, vals

    def batches(self, keys, vals):
        b = self.args.batch
        for i in range(0, len(keys), b):
            yield keys[i:i + b], vals[i:i + b]

    # -- servers --------------------------------------------------------------------------
    def redis_conf(self) -> tuple[dict, dict]:
        """(tier config, redis-py kwargs) for the given or a private server."""
        url, password = self.args.redis_url, os.environ.get(self.args.redis_password_env or "")
        if not url:
            from ..testbed.servers import RedisServer

            srv = self.stack.enter_context(RedisServer(maxmemory="4gb"))
            url, password = srv.url, srv.password
            os.environ["KVPOOL_BENCH_REDIS_PASSWORD"] = password
            self.args.redis_password_env = "KVPOOL_BENCH_REDIS_PASSWORD"
        tier = {"type": "redis", "url": url, "password_env": self.args.redis_password_env or None}
        return tier, {"url": url, "password": password}

    def s3_conf(self) -> dict:
        endpoint, bucket = self.args.s3_endpoint, self.args.s3_bucket
        if not endpoint:
            from ..testbed.servers import S3Server

            srv = self.stack.enter_context(S3Server(bucket=bucket))
            endpoint = srv.endpoint
            os.environ.update(srv.env())
        return {"type": "s3", "endpoint": endpoint, "bucket": bucket,
                "region": self.args.s3_region}

    # -- one tier -------------------------------------------------------------------------
    def run_tier(self, kind: str) -> tuple[list[dict], float | None]:
        n = self.args.s3_chunks if kind == "s3" else self.args.chunks
        _, vals = self.chunks(n)
        total = n * self.size
        ns = f"bench-{uuid.uuid4().hex[:8]}"
        raw_w, raw_r, tier = self.baseline(kind, n, vals)
        # a long timeout: the benchmark measures throughput, not the fault path
        store = open_store({"namespace": ns, "tiers": [tier], "timeout_seconds": 30},
                           layout=b"bench")
        outs = [bytearray(self.size) for _ in range(n)]
        out_views = [memoryview(o) for o in outs]
        native = kind in ("cpu", "disk")
        keys: list[bytes] = []
        written: list[bytes] = []

        def s_write():
            for k, v in self.batches(keys, vals):
                store.put_many(k, v)
            store.flush()

        def s_read():
            for i in range(0, n, self.args.batch):
                if native:
                    got = store.get_many_into(keys[i:i + self.args.batch],
                                              out_views[i:i + self.args.batch])
                else:
                    got = store.get_many(keys[i:i + self.args.batch])
                if any(g is None for g in got):
                    raise RuntimeError(f"{kind}: store missed objects it just wrote")

        rates = {"raw_write": 0.0, "raw_read": 0.0, "store_write": 0.0, "store_read": 0.0}
        settle = os.sync if kind == "disk" else (lambda: None)  # no dirty pages carried over
        for rnd in range(self.args.rounds):
            keys[:] = [os.urandom(32) for _ in range(n)]
            written.extend(keys)
            pairs = [("raw", raw_w, raw_r), ("store", s_write, s_read)]
            for who, w, r in (pairs if rnd % 2 == 0 else pairs[::-1]):  # alternate who goes first
                settle()
                rates[f"{who}_write"] = max(rates[f"{who}_write"], best_rate(w, total))
                settle()
                rates[f"{who}_read"] = max(rates[f"{who}_read"], best_rate(r, total))
        if native:
            assert all(o == v for o, v in zip(outs[:4], vals[:4])), "read back wrong bytes"
        st = store.stats()["tiers"][kind]
        if st["errors"] or st["drops"] or st["timeouts"]:
            raise RuntimeError(f"{kind}: store reported errors during the benchmark: {st}")
        contains_us = self.time_contains(store, keys)
        store.delete_many(written)
        store.close()
        rows = []
        for op in ("write", "read"):
            s, r = rates[f"store_{op}"], rates[f"raw_{op}"]
            rows.append({"tier": kind, "op": op, "chunks": n, "chunk_bytes": self.size,
                         "store_gbps": s / 1e9, "raw_gbps": r / 1e9, "ratio": s / r,
                         "meets_goal": s / r >= RATIO_GOAL,
                         "api": ("put_many" if op == "write" else
                                 "get_many_into" if native else "get_many")})
        return rows, contains_us

    def time_contains(self, store, keys) -> float | None:
        probe = (keys * (-(-128 // len(keys))))[:128]
        if store.contains_prefix(probe) != 128:
            raise RuntimeError("contains_prefix missed stored keys")
        reps = 2000 if store.runners[0].tier.type in ("cpu", "disk") else 20
        t0 = time.perf_counter()
        for _ in range(reps):
            store.contains_prefix(probe)
        return (time.perf_counter() - t0) / reps * 1e6

    # -- baselines (same bytes, the plain way) --------------------------------------------
    def baseline(self, kind: str, n: int, vals):
        """(write, read, tier config): each call of write uses new names, read reads them."""
        size = self.size
        rnd = [0]

        def names(fmt: str) -> list:
            rnd[0] += 1
            return [fmt.format(r=rnd[0], i=i) for i in range(n)]
        if kind == "cpu":
            arena = memoryview(np.empty(n * size, dtype=np.uint8))
            outs = [memoryview(bytearray(size)) for _ in range(n)]

            def w():
                for i, v in enumerate(vals):
                    arena[i * size:(i + 1) * size] = v

            def r():
                for i, o in enumerate(outs):
                    o[:] = arena[i * size:(i + 1) * size]
            return w, r, {"type": "cpu", "size": int(n * size * 1.05) + size, "slot_size": size}
        if kind == "disk":
            root = os.path.join(self.workdir, "disk")
            raw = os.path.join(root, "raw")
            os.makedirs(raw, exist_ok=True)
            paths: list[str] = []
            outs = [memoryview(bytearray(size)) for _ in range(n)]

            def w():
                paths[:] = names(os.path.join(raw, "{r}-{i}"))
                for p, v in zip(paths, vals):
                    with open(p, "wb", buffering=0) as f:
                        f.write(v)

            def r():
                for p, o in zip(paths, outs):
                    with open(p, "rb", buffering=0) as f:
                        f.readinto(o)
            return w, r, {"type": "disk", "path": root, "size": 3 * n * size,
                          "rescan_seconds": 0}
        if kind == "redis":
            import redis

            tier, kw = self.redis_conf()
            client = redis.Redis.from_url(kw["url"], password=kw["password"])
            self.stack.callback(client.close)
            keys: list[str] = []
            everything: list[str] = []

            def w():
                keys[:] = names("bench-raw:{r}:{i}")
                everything.extend(keys)
                for i in range(0, n, self.args.batch):
                    pipe = client.pipeline(transaction=False)
                    for name, v in zip(keys[i:i + self.args.batch], vals[i:i + self.args.batch]):
                        pipe.set(name, v)
                    pipe.execute()

            def r():
                for i in range(0, n, self.args.batch):
                    pipe = client.pipeline(transaction=False)
                    for name in keys[i:i + self.args.batch]:
                        pipe.get(name)
                    pipe.execute()
            self.stack.callback(lambda: everything and client.delete(*everything))
            return w, r, tier
        if kind == "s3":
            tier = self.s3_conf()
            client = _s3_client(tier)
            pool = self.stack.enter_context(ThreadPoolExecutor(16))
            keys = []
            blobs = [bytes(v) for v in vals]

            def w():
                keys[:] = names("bench-raw/{r}-{i}")
                list(pool.map(lambda nb: client.put_object(Bucket=tier["bucket"], Key=nb[0],
                                                           Body=nb[1]), zip(keys, blobs)))

            def r():
                list(pool.map(lambda name: client.get_object(Bucket=tier["bucket"],
                                                             Key=name)["Body"].read(), keys))
            return w, r, tier
        raise ValueError(f"unknown tier {kind!r}")

    # -- disk index rebuild ---------------------------------------------------------------
    def rebuild(self, count: int) -> dict:
        path = os.path.join(self.workdir, "rebuild")
        tier = {"type": "disk", "path": path, "size": "10Gi", "rescan_seconds": 0}
        s = open_store({"namespace": "rebuild", "tiers": [tier], "metrics": False})
        payload = b"x" * 256
        keys = [os.urandom(32) for _ in range(count)]
        for i in range(0, count, 1000):
            s.put_many(keys[i:i + 1000], [payload] * len(keys[i:i + 1000]))
        s.close()
        t0 = time.perf_counter()
        s2 = open_store({"namespace": "rebuild", "tiers": [tier], "metrics": False})
        seconds = time.perf_counter() - t0
        found = s2.stats()["tiers"]["disk"]["objects"]
        s2.close()
        shutil.rmtree(path, ignore_errors=True)
        return {"objects": count, "found": found, "seconds": seconds}


def _s3_client(tier: dict):
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3", endpoint_url=tier["endpoint"], region_name=tier["region"],
        config=Config(max_pool_connections=16, s3={"addressing_style": "path"},
                      request_checksum_calculation="when_required",
                      response_checksum_validation="when_required"))


def format_table(result: dict) -> str:
    lines = [f"kvpool bench store: {result['chunk_bytes'] / 2**20:g} MiB chunks, batch "
             f"{result['batch']}, best of {result['rounds']} rounds (goal: ratio >= {RATIO_GOAL})",
             "", f"{'tier':<6} {'op':<6} {'chunks':>6} {'store GB/s':>10} {'raw GB/s':>9} "
             f"{'ratio':>6}  {'goal':<5} api", "-" * 66]
    for r in result["results"]:
        lines.append(f"{r['tier']:<6} {r['op']:<6} {r['chunks']:>6} {r['store_gbps']:>10.3f} "
                     f"{r['raw_gbps']:>9.3f} {r['ratio']:>6.2f}  "
                     f"{'ok' if r['meets_goal'] else 'BELOW':<5} {r['api']}")
    lines.append("")
    for tier, us in result["contains_prefix_us"].items():
        goal = ""
        if tier in ("cpu", "disk"):
            goal = "  ok" if us < CONTAINS_GOAL_US else "  BELOW GOAL"
        lines.append(f"contains_prefix(128 keys) {tier:<6} {us:10.1f} us{goal}")
    rb = result.get("disk_rebuild")
    if rb:
        lines.append(f"disk index rebuild at start: {rb['found']}/{rb['objects']} objects in "
                     f"{rb['seconds']:.2f} s")
    return "\n".join(lines)


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="kvpool bench store", description=__doc__.split("\n")[0])
    ap.add_argument("--tiers", default=",".join(TIERS), help="comma list of cpu,disk,redis,s3")
    ap.add_argument("--chunks", type=int, default=64, help="chunks per tier (default 64)")
    ap.add_argument("--s3-chunks", type=int, default=32, help="chunks for s3 (default 32)")
    ap.add_argument("--chunk-size", default="2Mi")
    ap.add_argument("--batch", type=int, default=8, help="keys per put_many/get_many call")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--disk-path", help="directory for the disk tier (default: a temp dir)")
    ap.add_argument("--redis-url", help="default: start a private redis-server")
    ap.add_argument("--redis-password-env", help="environment variable with the password")
    ap.add_argument("--s3-endpoint", help="default: start a private moto S3 server")
    ap.add_argument("--s3-bucket", default="kvpool-bench")
    ap.add_argument("--s3-region", default="us-east-1")
    ap.add_argument("--rebuild-objects", type=int, default=100_000,
                    help="objects for the disk index rebuild timing (0 = skip)")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    kinds = [t.strip() for t in args.tiers.split(",") if t.strip()]
    bad = [t for t in kinds if t not in TIERS]
    if bad:
        print(f"--tiers: unknown tier(s) {bad}; choose from {list(TIERS)}", file=sys.stderr)
        return 2
    workdir = tempfile.mkdtemp(prefix="kvpool-bench-", dir=args.disk_path)
    bench = Bench(args, workdir)
    result = {"chunk_bytes": bench.size, "batch": args.batch, "rounds": args.rounds,
              "results": [], "contains_prefix_us": {}}
    try:
        with bench.stack:
            for kind in kinds:
                rows, us = bench.run_tier(kind)
                result["results"].extend(rows)
                result["contains_prefix_us"][kind] = us
            if "disk" in kinds and args.rebuild_objects:
                result["disk_rebuild"] = bench.rebuild(args.rebuild_objects)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(json.dumps(result, indent=2) if args.json else format_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
