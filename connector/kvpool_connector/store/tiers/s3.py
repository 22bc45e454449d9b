"""S3 tier (AWS S3, MinIO, any S3-compatible server) through boto3.

Objects live at <prefix>/<namespace>/<object name hex>. Puts, gets and HEADs of a batch run
concurrently on a thread pool sized like the HTTP connection pool. boto3's retries and its
extra request checksums are off (the orchestrator retries with backoff; objects carry their
own MAC). Gets are ranged to one byte past the largest object the reader accepts, so an
oversized object is refused without being read whole. Presence learnt from puts, gets and HEADs is remembered for
presence_cache_seconds (misses for negative_cache_seconds), so repeated scheduler lookups of
the same prefix cost no requests; a stale "present" only costs a miss at read time.
Credentials come from the named environment variables (a named but unset one is an error),
else boto3's default chain (AWS_* variables, instance roles, IRSA).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import boto3
from botocore.config import Config
from botocore.exceptions import ClientError

from ..credentials import secret
from ..format import Record
from ..sealing import PoolKey
from .base import Tier

_MISSING = {"404", "NoSuchKey", "NotFound"}


def _missing(e: ClientError) -> bool:
    return str(e.response.get("Error", {}).get("Code")) in _MISSING


class PresenceCache:
    """key -> (present, expiry): what recent requests told us, so repeated scheduler lookups
    of the same prefix cost no requests. Bounded: cleared when it grows past its limit."""

    def __init__(self, limit: int = 65536) -> None:
        self._d: dict[bytes, tuple[bool, float]] = {}
        self._lock = threading.Lock()
        self.limit = limit

    def known(self, keys: list[bytes]) -> dict[bytes, bool]:
        now = time.monotonic()
        with self._lock:
            got = {k: self._d.get(k) for k in keys}
        return {k: v[0] for k, v in got.items() if v is not None and v[1] > now}

    def forget_missing(self, keys: list[bytes]) -> None:
        with self._lock:
            for k in keys:
                v = self._d.get(k)
                if v is not None and not v[0]:
                    del self._d[k]

    def remember(self, items: dict[bytes, bool], ttl_present: float, ttl_missing: float) -> None:
        now = time.monotonic()
        with self._lock:
            if len(self._d) > self.limit:
                self._d.clear()
            for k, present in items.items():
                ttl = ttl_present if present else ttl_missing
                if ttl > 0:
                    self._d[k] = (present, now + ttl)
                else:
                    self._d.pop(k, None)


class S3Tier(Tier):
    type = "s3"
    remote = True
    blocking = True

    def __init__(self, cfg, namespace, stats, **kw) -> None:
        super().__init__(cfg, namespace, stats, **kw)
        timeout = self.timeout
        prefix = cfg.prefix.strip("/")
        self.base = f"{prefix}/{namespace}/" if prefix else f"{namespace}/"
        path_style = cfg.path_style if cfg.path_style is not None else cfg.endpoint is not None
        conf = Config(
            max_pool_connections=cfg.max_connections,
            connect_timeout=timeout,
            read_timeout=max(1.0, 4 * timeout),
            retries={"max_attempts": 1, "mode": "standard"},
            s3={"addressing_style": "path" if path_style else "auto"},
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        self.client = boto3.session.Session().client(
            "s3", endpoint_url=cfg.endpoint, region_name=cfg.region, config=conf,
            aws_access_key_id=secret(cfg.access_key_env, None, "access_key"),
            aws_secret_access_key=secret(cfg.secret_key_env, None, "secret_key"),
            verify=(cfg.tls_ca_file or True) if cfg.verify_tls else False,
        )
        self.bucket = cfg.bucket
        self.pool = ThreadPoolExecutor(cfg.max_connections, thread_name_prefix="kvpool-s3")
        self._bucket_ready = not cfg.create_bucket
        self.presence = PresenceCache()

    def object_key(self, name: bytes) -> str:
        """The S3 key of an object."""
        return self.base + name.hex()

    def _ensure_bucket(self) -> None:
        if self._bucket_ready:
            return
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except ClientError as e:
            if not _missing(e):
                raise
            kw = {}
            if self.cfg.region != "us-east-1":
                kw["CreateBucketConfiguration"] = {"LocationConstraint": self.cfg.region}
            try:
                self.client.create_bucket(Bucket=self.bucket, **kw)
            except ClientError as e2:
                if e2.response.get("Error", {}).get("Code") not in (
                        "BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                    raise
        self._bucket_ready = True

    def _put(self, rec: Record) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self.object_key(rec.name),
                               Body=rec.blob_bytes())

    def put_many(self, records: list[Record]) -> None:
        self._ensure_bucket()
        for rec in records:
            rec.freeze()
        list(self.pool.map(self._put, records))  # re-raises the first error
        self._remember({rec.name: True for rec in records})
        self.stats.inc("bytes_in", sum(len(r.payload) for r in records))

    def _get(self, name: bytes, limit: int) -> bytes | None:
        try:
            resp = self.client.get_object(Bucket=self.bucket, Key=self.object_key(name),
                                          Range=f"bytes=0-{limit}")
        except ClientError as e:
            if _missing(e) or str(e.response.get("Error", {}).get("Code")) == "InvalidRange":
                return None  # InvalidRange: an empty object
            raise
        with resp["Body"] as body:
            data = body.read(limit + 1)
        if len(data) > limit:
            self.stats.inc("rejected")
            return None
        return data

    def forget_absent(self, names: list[bytes]) -> None:
        self.presence.forget_missing(names)

    def _remember(self, items: dict[bytes, bool]) -> None:
        self.presence.remember(items, self.cfg.presence_cache_seconds,
                               self.cfg.negative_cache_seconds)

    def _get_all(self, names: list[bytes], layout: bytes, key: PoolKey,
                 outs: list[memoryview] | None) -> list[Record | None]:
        limits = [self.read_limit(n, o) for n, o in
                  zip(names, outs if outs is not None else [None] * len(names), strict=True)]
        blobs = list(self.pool.map(self._get, names, limits))
        # deletes forget
        self._remember({k: b is not None for k, b in zip(names, blobs, strict=True)})
        return self.verify_all(names, layout, key, blobs, outs)

    def get_many(self, names: list[bytes], layout: bytes, key: PoolKey) -> list[Record | None]:
        return self._get_all(names, layout, key, None)

    def get_many_into(self, names: list[bytes], layout: bytes, key: PoolKey,
                      outs: list[memoryview]) -> list[Record | None]:
        return self._get_all(names, layout, key, outs)

    def _head(self, key: bytes) -> bool:
        try:
            self.client.head_object(Bucket=self.bucket, Key=self.object_key(key))
            return True
        except ClientError as e:
            if _missing(e):
                return False
            raise

    def contains_many(self, keys: list[bytes]) -> list[bool]:
        found = self.presence.known(keys)
        wave = self.cfg.max_connections
        for i in range(0, len(keys), wave):  # stop after the wave holding the first miss
            ask = [k for k in keys[i:i + wave] if k not in found]
            answers = dict(zip(ask, self.pool.map(self._head, ask), strict=True))
            self._remember(answers)
            found.update(answers)
            if not all(found[k] for k in keys[i:i + wave]):
                break
        return [found.get(k, False) for k in keys]

    def delete_many(self, keys: list[bytes]) -> None:
        self._remember({k: False for k in keys})
        for i in range(0, len(keys), 1000):
            self.client.delete_objects(Bucket=self.bucket, Delete={
                "Objects": [{"Key": self.object_key(k)} for k in keys[i:i + 1000]], "Quiet": True})

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.client.close()
