"""`kvpool bench store`: each tier of the store against the raw baseline for the same bytes,
with the cost of authenticating (MAC) and encrypting objects, side by side in one run.

For every tier it writes and reads N chunks (default 64 x 2 MiB: 256 tokens of an 8B-class
model's KV for one rank) through the store, and in the same run moves the same bytes the
plain way: memcpy into / out of a preallocated buffer (cpu), one file per chunk written and
read in the same directory (disk: from the page cache; disk-cold: reads from the device,
every file's cached pages dropped with POSIX_FADV_DONTNEED before each read batch of every
side, as for a disk tier larger than the host's memory), pipelined SET / GET with redis-py
(redis), put_object / get_object with boto3 at the same concurrency (s3). For the shared tiers three stores run
next to the baseline: `xxh3` (objects checksummed but not authenticated, what kvpool did
before keyed MACs; insecure, here only to price the MAC), `mac` (the default: GMAC, keyed
MAC) and `aes` (`security.encrypt`: AES-256-GCM). The sides alternate batch by batch (who
goes first rotates), each round writes new keys (as a serving engine does; the cpu tier
evicts from round 2 on) and reads them back; the 80th percentile of the batch rates of each
side is reported, which keeps the noise of a shared machine out of the ratios. It also times
`contains_prefix` on 128 keys and the disk tier's index rebuild at start.

Without --redis-url / --s3-endpoint it starts a private redis-server / moto S3 server
(kvpool_dev.testbed.servers). Goals: mac / raw >= 0.8 both ways; mac / xxh3 >= 0.9
(the MAC costs at most 10%), aes / xxh3 >= 0.75 (encryption at most 25%); contains_prefix
on 128 keys under 100 us for cpu and disk.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvpool_connector.config import parse_size
from kvpool_connector.store import open_store
from kvpool_connector.store.sealing import Keyring, PoolKey


class ChecksumOnlyKey(PoolKey):
    """An unkeyed xxh3 "tag": objects as kvpool checksummed them before keyed MACs. Anyone
    could forge these; the benchmark uses them only to price the real MAC."""

    class _Xxh3:
        def __init__(self, tag: bytes | None) -> None:
            import xxhash

            self._h, self._want, self.tag = xxhash.xxh3_128(), tag, None

        def authenticate_additional_data(self, data) -> None:
            self._h.update(data)

        def finalize(self) -> None:
            from cryptography.exceptions import InvalidTag

            self.tag = self._h.digest()
            if self._want is not None and self._want != self.tag:
                raise InvalidTag()

        def finalize_with_tag(self, tag: bytes) -> None:
            self._want = tag
            self.finalize()

    def authenticator(self, salt: bytes, tag: bytes | None = None):
        return self._Xxh3(tag)

    def checker(self, salt: bytes, header: bytes, encrypted: bool):
        check = self._Xxh3(None)
        check.authenticate_additional_data(header)
        return check


RATIO_GOAL = 0.8        # mac / raw
MAC_COST_GOAL = 0.9     # mac / xxh3
AES_COST_GOAL = 0.75    # aes / xxh3
CONTAINS_GOAL_US = 100.0
POOL_KEY_ENV = "KVPOOL_BENCH_POOL_KEY"
VARIANTS = {"xxh3": {"key_env": POOL_KEY_ENV}, "mac": {"key_env": POOL_KEY_ENV},
            "aes": {"key_env": POOL_KEY_ENV, "encrypt": True}}
TIERS = ("cpu", "disk", "disk-cold", "redis", "s3")


def evict_page_cache(root: str) -> None:
    """Drop the cached pages of every file under root (POSIX_FADV_DONTNEED, after a sync so
    none is dirty): the next read of them comes from the device, not from memory."""
    os.sync()
    for dirpath, _, files in os.walk(root):
        for f in files:
            try:
                fd = os.open(os.path.join(dirpath, f), os.O_RDONLY | os.O_NOFOLLOW)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def upper_rate(samples: list[float]) -> float:
    """The 80th percentile of batch rates: what a side reaches when the machine's other
    tenants leave it alone (applied to both sides alike; a median swings with their load)."""
    return statistics.quantiles(samples, n=5)[-1] if len(samples) > 1 else samples[0]


class Raw:
    """The baseline of a tier: write(batch) / read(batch) of the same bytes, new names per round."""

    def __init__(self, vals: list[memoryview]) -> None:
        self.vals = vals
        self.round = 0

    def new_round(self) -> None:
        self.round += 1

    def close(self) -> None:
        pass


class RawMemory(Raw):
    """memcpy into a preallocated buffer and out into preallocated buffers."""

    def __init__(self, vals, size):
        super().__init__(vals)
        self.size = size
        self.arena = memoryview(np.empty(len(vals) * size, dtype=np.uint8))
        self.outs = [memoryview(bytearray(size)) for _ in vals]

    def write(self, sp: range) -> None:
        for i in sp:
            self.arena[i * self.size:(i + 1) * self.size] = self.vals[i]

    def read(self, sp: range) -> None:
        for i in sp:
            self.outs[i][:] = self.arena[i * self.size:(i + 1) * self.size]


class RawFiles(Raw):
    """One file per chunk written and read with plain unbuffered file I/O."""

    def __init__(self, vals, size, path):
        super().__init__(vals)
        os.makedirs(path, exist_ok=True)
        self.path = path
        self.outs = [memoryview(bytearray(size)) for _ in vals]

    def _name(self, i: int) -> str:
        return os.path.join(self.path, f"{self.round}-{i}")

    def write(self, sp: range) -> None:
        for i in sp:
            with open(self._name(i), "wb", buffering=0) as f:
                f.write(self.vals[i])

    def read(self, sp: range) -> None:
        for i in sp:
            with open(self._name(i), "rb", buffering=0) as f:
                f.readinto(self.outs[i])


class RawRedis(Raw):
    """redis-py pipelined SET / GET of the bare payloads."""

    def __init__(self, vals, kw):
        import redis

        super().__init__(vals)
        self.client = redis.Redis.from_url(kw["url"], password=kw["password"])
        self.names: list[str] = []

    def _name(self, i: int) -> str:
        return f"bench-raw:{self.round}:{i}"

    def write(self, sp: range) -> None:
        pipe = self.client.pipeline(transaction=False)
        for i in sp:
            self.names.append(self._name(i))
            pipe.set(self._name(i), self.vals[i])
        pipe.execute()

    def read(self, sp: range) -> None:
        pipe = self.client.pipeline(transaction=False)
        for i in sp:
            pipe.get(self._name(i))
        pipe.execute()

    def close(self) -> None:
        if self.names:
            self.client.delete(*self.names)
        self.client.close()


class RawS3(Raw):
    """boto3 put_object / get_object, a batch at a time on 16 threads (as the tier does)."""

    def __init__(self, vals, tier):
        import boto3
        from botocore.config import Config

        super().__init__(vals)
        self.bucket = tier["bucket"]
        self.client = boto3.client(
            "s3", endpoint_url=tier["endpoint"], region_name=tier["region"],
            config=Config(max_pool_connections=16, s3={"addressing_style": "path"},
                          request_checksum_calculation="when_required",
                          response_checksum_validation="when_required"))
        self.pool = ThreadPoolExecutor(16)
        self.blobs = [bytes(v) for v in vals]

    def _name(self, i: int) -> str:
        return f"bench-raw/{self.round}-{i}"

    def write(self, sp: range) -> None:
        list(self.pool.map(lambda i: self.client.put_object(
            Bucket=self.bucket, Key=self._name(i), Body=self.blobs[i]), sp))

    def read(self, sp: range) -> None:
        list(self.pool.map(lambda i: self.client.get_object(
            Bucket=self.bucket, Key=self._name(i))["Body"].read(), sp))

    def close(self) -> None:
        self.pool.shutdown()


class Bench:
    def __init__(self, args, workdir: str) -> None:
        self.args = args
        self.workdir = workdir
        self.size = parse_size(args.chunk_size)
        self.stack = contextlib.ExitStack()
        self.rng = np.random.default_rng(0)

    # -- data -----------------------------------------------------------------------------
    def chunks(self, n: int) -> list[memoryview]:
        return [memoryview(self.rng.integers(0, 256, self.size, dtype=np.uint8)) for _ in range(n)]

    # -- servers --------------------------------------------------------------------------
    def redis_conf(self) -> tuple[dict, dict]:
        """(tier config, redis-py kwargs) for the given or a private server."""
        url, password = self.args.redis_url, os.environ.get(self.args.redis_password_env or "")
        if not url:
            from kvpool_dev.testbed.servers import RedisServer

            srv = self.stack.enter_context(RedisServer(maxmemory="4gb"))
            url, password = srv.url, srv.password
            os.environ["KVPOOL_BENCH_REDIS_PASSWORD"] = password
            self.args.redis_password_env = "KVPOOL_BENCH_REDIS_PASSWORD"
        tier = {"type": "redis", "url": url, "password_env": self.args.redis_password_env or None}
        return tier, {"url": url, "password": password}

    def s3_conf(self) -> dict:
        endpoint, bucket = self.args.s3_endpoint, self.args.s3_bucket
        if not endpoint:
            from kvpool_dev.testbed.servers import S3Server

            srv = self.stack.enter_context(S3Server(bucket=bucket))
            endpoint = srv.endpoint
            os.environ.update(srv.env())
        return {"type": "s3", "endpoint": endpoint, "bucket": bucket,
                "region": self.args.s3_region}

    # -- one tier -------------------------------------------------------------------------
    def open_variant(self, tier: dict, variant: str):
        store = open_store({"namespace": f"bench-{uuid.uuid4().hex[:8]}", "tiers": [tier],
                            # a long timeout: the benchmark measures throughput, not faults
                            "timeout_seconds": 30, "security": VARIANTS[variant]},
                           layout=b"bench")
        if variant == "xxh3":
            store.keyring = Keyring(ChecksumOnlyKey(os.urandom(32)))
        return store

    def run_tier(self, kind: str) -> tuple[list[dict], float | None]:
        n = self.args.s3_chunks if kind == "s3" else self.args.chunks
        vals = self.chunks(n)
        bsz = self.args.batch
        spans = [range(i, min(i + bsz, n)) for i in range(0, n, bsz)]
        raw, tier = self.baseline(kind, vals)
        # the cpu tier lives in-process and seals nothing: one store is all there is
        variants = ["mac"] if kind == "cpu" else list(VARIANTS)
        stores = {v: self.open_variant(tier, v) for v in variants}
        outs = [memoryview(bytearray(self.size)) for _ in range(n)]
        keys: dict[str, list[bytes]] = {v: [] for v in variants}
        written: dict[str, list[bytes]] = {v: [] for v in variants}

        def writer(v):
            def write(sp: range) -> None:
                stores[v].put_many(keys[v][sp.start:sp.stop], vals[sp.start:sp.stop])
            return write

        def reader(v):
            def read(sp: range) -> None:
                ks = keys[v][sp.start:sp.stop]
                got = stores[v].get_many_into(ks, outs[sp.start:sp.stop])  # as the connector
                if any(g is None for g in got):
                    raise RuntimeError(f"{kind}/{v}: store missed objects it just wrote")
            return read

        sides = ["raw"] + variants
        fns = {"write": {"raw": raw.write, **{v: writer(v) for v in variants}},
               "read": {"raw": raw.read, **{v: reader(v) for v in variants}}}
        samples = {(who, op): [] for who in sides for op in ("write", "read")}
        disk = kind.startswith("disk")
        settle = os.sync if disk else (lambda: None)  # no dirty pages carried over
        # disk-cold: every read batch of every side comes from the device (a disk tier larger
        # than the host's page cache), the page cache emptied before it, outside the timing
        before_read = ((lambda: evict_page_cache(os.path.join(self.workdir, kind)))
                       if kind == "disk-cold" else (lambda: None))
        for rnd in range(self.args.rounds):
            for v in variants:
                keys[v] = [os.urandom(32) for _ in range(n)]
                written[v].extend(keys[v])
            raw.new_round()
            for op in ("write", "read"):
                settle()
                for b, sp in enumerate(spans):  # interleaved batches, rotating who is first
                    k = (b + rnd) % len(sides)
                    for who in sides[k:] + sides[:k]:
                        if op == "read":
                            before_read()
                        t0 = time.perf_counter()
                        fns[op][who](sp)
                        samples[(who, op)].append(len(sp) * self.size /
                                                  (time.perf_counter() - t0))
        assert all(o == v for o, v in zip(outs, vals, strict=True)), "read back wrong bytes"
        for v, store in stores.items():
            tier_stats = store.stats()["tiers"][tier["type"]]
            if any(tier_stats[k] for k in ("errors", "drops", "timeouts", "corrupt")):
                raise RuntimeError(f"{kind}/{v}: store reported errors during the benchmark: "
                                   f"{tier_stats}")
        contains_us = self.time_contains(stores["mac"], keys["mac"])
        for v, store in stores.items():
            store.delete_many(written[v])
            store.close()
        raw.close()
        rows = []
        # disk-cold's writes are disk's (the page cache is emptied only before reads)
        for op in ("read",) if kind == "disk-cold" else ("write", "read"):
            rate = {who: upper_rate(samples[(who, op)]) for who in sides}
            row = {"tier": kind, "op": op, "chunks": n, "chunk_bytes": self.size,
                   "samples": len(samples[("mac", op)]),
                   "raw_gbps": rate["raw"] / 1e9,
                   **{f"{v}_gbps": rate[v] / 1e9 for v in variants},
                   "ratio": rate["mac"] / rate["raw"],
                   "api": "put_many" if op == "write" else "get_many_into"}
            row["meets_goal"] = row["ratio"] >= RATIO_GOAL
            if kind != "cpu":
                row["aes_ratio"] = rate["aes"] / rate["raw"]
                row["mac_vs_xxh3"] = rate["mac"] / rate["xxh3"]
                row["aes_vs_xxh3"] = rate["aes"] / rate["xxh3"]
                row["meets_goal"] = (row["meets_goal"] and row["mac_vs_xxh3"] >= MAC_COST_GOAL
                                     and row["aes_vs_xxh3"] >= AES_COST_GOAL)
            rows.append(row)
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
    def baseline(self, kind: str, vals: list[memoryview]) -> tuple[Raw, dict]:
        n, size = len(vals), self.size
        if kind == "cpu":
            return RawMemory(vals, size), {"type": "cpu", "size": n * size, "slot_size": size}
        if kind in ("disk", "disk-cold"):
            root = os.path.join(self.workdir, kind)
            return RawFiles(vals, size, os.path.join(root, "raw")), {
                "type": "disk", "path": root, "size": 3 * n * size, "rescan_seconds": 0}
        if kind == "redis":
            tier, kw = self.redis_conf()
            return RawRedis(vals, kw), tier
        if kind == "s3":
            tier = self.s3_conf()
            return RawS3(vals, tier), tier
        raise ValueError(f"unknown tier {kind!r}")

    # -- disk index rebuild ---------------------------------------------------------------
    def rebuild(self, count: int) -> dict:
        path = os.path.join(self.workdir, "rebuild")
        tier = {"type": "disk", "path": path, "size": "10Gi", "rescan_seconds": 0}
        sec = VARIANTS["mac"]
        s = open_store({"namespace": "rebuild", "tiers": [tier], "metrics": False,
                        "security": sec})
        payload = b"x" * 256
        keys = [os.urandom(32) for _ in range(count)]
        for i in range(0, count, 1000):
            s.put_many(keys[i:i + 1000], [payload] * len(keys[i:i + 1000]))
        s.close()
        t0 = time.perf_counter()
        s2 = open_store({"namespace": "rebuild", "tiers": [tier], "metrics": False,
                         "security": sec})
        seconds = time.perf_counter() - t0
        found = s2.stats()["tiers"]["disk"]["objects"]
        s2.close()
        shutil.rmtree(path, ignore_errors=True)
        return {"objects": count, "found": found, "seconds": seconds}


def format_table(result: dict) -> str:
    lines = [f"kvpool bench store: {result['chunk_bytes'] / 2**20:g} MiB chunks, batch "
             f"{result['batch']}, {result['rounds']} rounds, p80 of batch rates; goals: "
             f"mac/raw >= {RATIO_GOAL}, mac/xxh3 >= {MAC_COST_GOAL}, aes/xxh3 >= {AES_COST_GOAL}",
             "", f"{'tier':<6} {'op':<6} {'raw':>7} {'xxh3':>7} {'mac':>7} {'aes':>7}  "
             f"{'mac/raw':>7} {'aes/raw':>7} {'mac/xxh3':>8} {'aes/xxh3':>8}  goal   (GB/s)",
             "-" * 92]

    def cell(r, key, fmt):
        return format(r[key], fmt) if key in r else "-"

    for r in result["results"]:
        lines.append(
            f"{r['tier']:<6} {r['op']:<6} {r['raw_gbps']:>7.3f} {cell(r, 'xxh3_gbps', '>7.3f'):>7} "
            f"{r['mac_gbps']:>7.3f} {cell(r, 'aes_gbps', '>7.3f'):>7}  {r['ratio']:>7.2f} "
            f"{cell(r, 'aes_ratio', '>7.2f'):>7} {cell(r, 'mac_vs_xxh3', '>8.2f'):>8} "
            f"{cell(r, 'aes_vs_xxh3', '>8.2f'):>8}  {'ok' if r['meets_goal'] else 'BELOW'}")
    lines.append("")
    for tier, us in result["contains_prefix_us"].items():
        goal = ""
        if tier in ("cpu", "disk", "disk-cold"):
            goal = "  ok" if us < CONTAINS_GOAL_US else "  BELOW GOAL"
        lines.append(f"contains_prefix(128 keys) {tier:<6} {us:10.1f} us{goal}")
    rb = result.get("disk_rebuild")
    if rb:
        lines.append(f"disk index rebuild at start: {rb['found']}/{rb['objects']} objects in "
                     f"{rb['seconds']:.2f} s")
    return "\n".join(lines)


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="kvpool bench store", description=__doc__.split("\n")[0])
    ap.add_argument("--tiers", default=",".join(TIERS),
                    help="comma list of cpu,disk,disk-cold,redis,s3 (disk-cold: reads from the "
                    "device, the page cache emptied before each batch)")
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
    os.environ.setdefault(POOL_KEY_ENV, secrets.token_urlsafe(32))
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
