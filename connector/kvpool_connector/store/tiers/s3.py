"""S3 tier (AWS S3, MinIO, any S3-compatible server) through boto3.

Objects live at <prefix>/<namespace>/<key hex>. Puts, gets and HEADs of a batch run
concurrently on a thread pool sized like the HTTP connection pool. boto3's retries and its
extra request checksums are off (the orchestrator retries with backoff; objects carry their
own checksum). `contains_many` remembers misses for negative_cache_seconds so that repeated
scheduler lookups of a cold prefix cost no requests. Credentials come from the named
environment variables, else boto3's default chain (instance roles, IRSA).
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import boto3
from botocore.config import Config
from botocore.exceptions import ClientError

from ..format import Record
from .base import Tier

_MISSING = {"404", "NoSuchKey", "NotFound"}
_NEG_CACHE_MAX = 65536


def _missing(e: ClientError) -> bool:
    return str(e.response.get("Error", {}).get("Code")) in _MISSING


class S3Tier(Tier):
    type = "s3"
    remote = True

    def __init__(self, cfg, namespace, stats, timeout: float = 0.5) -> None:
        super().__init__(cfg, namespace, stats)
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
        env = os.environ.get
        self.client = boto3.session.Session().client(
            "s3", endpoint_url=cfg.endpoint, region_name=cfg.region, config=conf,
            aws_access_key_id=env(cfg.access_key_env) if cfg.access_key_env else None,
            aws_secret_access_key=env(cfg.secret_key_env) if cfg.secret_key_env else None,
            verify=cfg.verify_tls,
        )
        self.bucket = cfg.bucket
        self.pool = ThreadPoolExecutor(cfg.max_connections, thread_name_prefix="kvpool-s3")
        self._bucket_ready = not cfg.create_bucket
        self._neg: dict[bytes, float] = {}
        self._neg_lock = threading.Lock()

    def name(self, key: bytes) -> str:
        return self.base + key.hex()

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
        self.client.put_object(Bucket=self.bucket, Key=self.name(rec.key), Body=rec.blob_bytes())

    def put_many(self, records: list[Record]) -> None:
        self._ensure_bucket()
        for rec in records:
            rec.freeze()
        list(self.pool.map(self._put, records))  # re-raises the first error
        with self._neg_lock:
            for rec in records:
                self._neg.pop(rec.key, None)
        self.stats.inc("bytes_in", sum(len(r.payload) for r in records))

    def _get(self, key: bytes) -> bytes | None:
        try:
            resp = self.client.get_object(Bucket=self.bucket, Key=self.name(key))
        except ClientError as e:
            if _missing(e):
                return None
            raise
        with resp["Body"] as body:
            return body.read()

    def get_many(self, keys: list[bytes], layout: bytes) -> list[Record | None]:
        return self.verify_all(keys, layout, list(self.pool.map(self._get, keys)))

    def _head(self, key: bytes) -> bool:
        try:
            self.client.head_object(Bucket=self.bucket, Key=self.name(key))
            return True
        except ClientError as e:
            if _missing(e):
                return False
            raise

    def contains_many(self, keys: list[bytes]) -> list[bool]:
        now = time.monotonic()
        with self._neg_lock:
            known_missing = {k for k in keys if self._neg.get(k, 0.0) > now}
        found: dict[bytes, bool] = {}
        wave = self.cfg.max_connections
        for i in range(0, len(keys), wave):  # stop after the wave holding the first miss
            ask = [k for k in keys[i:i + wave] if k not in known_missing]
            found.update(zip(ask, self.pool.map(self._head, ask)))
            if len(ask) < len(keys[i:i + wave]) or not all(found[k] for k in ask):
                break
        ttl = self.cfg.negative_cache_seconds
        if ttl > 0:
            with self._neg_lock:
                if len(self._neg) > _NEG_CACHE_MAX:
                    self._neg.clear()
                for k, ok in found.items():
                    if not ok:
                        self._neg[k] = now + ttl
        return [found.get(k, False) for k in keys]

    def delete_many(self, keys: list[bytes]) -> None:
        for i in range(0, len(keys), 1000):
            self.client.delete_objects(Bucket=self.bucket, Delete={
                "Objects": [{"Key": self.name(k)} for k in keys[i:i + 1000]], "Quiet": True})

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.client.close()
