"""The connector's config: the store's config plus the connector's own keys.

`kv_connector_extra_config` carries exactly this model. `config_file` (YAML or JSON with the
same keys) is read first and the inline keys override it key by key, so a mounted file can
hold the pool's tiers while a pod tweaks one setting. Every error names the field
(`kv_connector_extra_config.tiers.0.size: ...`) and fails engine start.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, ValidationInfo, field_validator

from ..config import PositiveSize, StoreConfig, _Strict, parse_size, read_documents

EXTRA_CONFIG = "kv_connector_extra_config"
CONNECTOR_KEYS = ("chunk_tokens", "config_file", "layerwise", "sync_local_loads",
                  "save_decode_tokens", "tail_objects", "require_cache_salt", "staging_bytes",
                  "handover_wait_seconds", "handover_always", "handover_requests",
                  "handover_max_bytes", "handover_step_bytes", "lookup_wait_ms", "warm_start")


class ConnectorConfigError(ValueError):
    """Invalid connector config; the message names the offending field."""


class WarmStartConfig(_Strict):
    """Warm start (connector/warm.py): the pool's hot set in the shared tier, loaded into a
    starting engine's cpu tier before it serves."""

    enabled: bool = Field(False, description="count the chunks requests reuse, merge them into "
                          "the pool's hot set manifest in the shared tier, and at engine start "
                          "load the top of it into the cpu tier before the engine reports ready")
    refresh_seconds: float = Field(60.0, gt=0, le=86400, description="how often a running "
                                   "engine merges its hits into the manifest")
    top_k: int = Field(4096, ge=1, le=1 << 20, description="chunks the manifest keeps, most "
                       "hit first")
    max_bytes: PositiveSize = Field(parse_size("4Gi"), description="bytes a starting engine "
                                    "loads at most (also at most half of the cpu tier)")
    max_seconds: float = Field(30.0, ge=0, le=3600, description="how long engine start waits "
                               "for the pre-warm; the rest loads in the background after it")


class ConnectorConfig(StoreConfig):
    """Store config + connector keys (unknown keys are rejected, like the store's)."""

    chunk_tokens: int = Field(256, gt=0, le=1 << 20,
                              description="tokens per stored object; a multiple of vLLM's "
                                          "block size")
    config_file: str | None = Field(None, description="YAML/JSON file with the same keys; "
                                                      "inline keys override it")
    layerwise: bool = Field(False, description="load layer by layer during the forward pass "
                                               "(layer i+1 copies while layer i computes)")
    sync_local_loads: bool = Field(True, description="a hit held entirely in the engine's "
                                   "own memory (the cpu tier, first) is copied in before the "
                                   "step's forward and the request computes the rest of its "
                                   "prompt in that same step; off: it waits one step for the "
                                   "load, as vLLM's native offloading always does")
    save_decode_tokens: bool = Field(True, description="also store the KV of generated tokens "
                                     "(chunks as they complete, the rest in the tail object): "
                                     "a chat's next turn includes the answer; per request "
                                     "kv_transfer_params {\"kvpool\": {\"save_decode\": false}}")
    tail_objects: bool = Field(True, description="at prefill end and at request finish, store "
                               "the blocks past the last full chunk as one tail object, so the "
                               "next turn loads up to the last full vLLM block (tails.py)")
    require_cache_salt: bool = Field(False, description="requests without vLLM's cache_salt are "
                                     "neither looked up nor saved (tenant isolation)")
    staging_bytes: PositiveSize = Field(parse_size("1Gi"), description="host memory for chunks "
                                        "on their way between the paged KV cache and the store "
                                        "(pinned on CUDA), per worker; saves beyond it are "
                                        "dropped")

    handover_wait_seconds: float = Field(10.0, ge=0, le=600, description="prefill/decode "
                                         "through the pool: how long a decode request given "
                                         "a prefill's handover waits for its objects to be "
                                         "visible in the shared tiers before it recomputes "
                                         "the prompt (counted in kvpool_handover_timeouts)")

    handover_always: bool = Field(False, description="prefill/decode through the pool: every "
                                  "request is a handover prefill (its saves written through "
                                  "to the shared tiers before its response), for a prefill "
                                  "engine behind llm-d's shared-storage protocol, which sends "
                                  "no kv_transfer_params")

    handover_requests: bool = Field(False, description="prefill/decode through the pool: "
                                    "honour a request's kv_transfer_params asking for a "
                                    "handover (do_remote_decode, kvpool.handover). Set it on "
                                    "prefill engines only (the operator does, on spec.prefill's "
                                    "engines): a handover writes through inside the step and "
                                    "skips dedupe, so on any other engine a client could force "
                                    "that cost on everyone; there such a request runs as an "
                                    "ordinary one (kvpool_handover_refused)")

    handover_max_bytes: PositiveSize = Field(parse_size("16Gi"), description="prefill/decode "
                                             "through the pool: bytes of one request's chunks "
                                             "a handover writes through (per rank); past it "
                                             "the rest is saved behind and the handover ends "
                                             "there (kvpool_handover_capped)")
    handover_step_bytes: PositiveSize = Field(parse_size("2Gi"), description="prefill/decode "
                                              "through the pool: bytes of chunks all handovers "
                                              "of one engine step write through (per rank): the "
                                              "step waits for them; a handover that would pass "
                                              "it is capped as by handover_max_bytes")

    lookup_wait_ms: float = Field(5.0, ge=0, le=1000, description="how long the scheduler "
                                  "waits, inside its step, for a lookup that asks Redis or S3 "
                                  "(a handover's visibility check too) before it answers vLLM "
                                  "\"ask again next step\", which costs the request a step; "
                                  "one step waits twice this at most, and nobody waits while "
                                  "recent lookups took longer than this (a slow tier). Raise it "
                                  "to the shared tier's round trip when that is over 5 ms (Redis "
                                  "in another zone); 0: never wait. "
                                  "kvpool_lookups_deferred_total counts the lookups it missed")

    warm_start: WarmStartConfig = Field(default_factory=WarmStartConfig,
                                        description="pre-warm a starting engine's cpu tier "
                                        "from the pool's hot set (docs/scaling.md, Warm start)")

    @field_validator("warm_start")
    @classmethod
    def _warm_start_tiers(cls, warm: WarmStartConfig, info: ValidationInfo) -> WarmStartConfig:
        """A field validator, so the error names the field (the tiers come first)."""
        tiers = info.data.get("tiers")
        if warm.enabled and tiers:  # invalid tiers are reported by themselves
            # here, not at the top: the operator reads this module, and its image has
            # none of the store's dependencies (numpy) that the tier registry's package loads
            from ..store.tiers import tier_class

            types = [t.type for t in tiers]
            if (not tier_class(types[0]).process_memory
                    or not any(tier_class(t).shared for t in types[1:])):
                raise ValueError("enabled: warm start loads the pool's hot set from a shared "
                                 "tier (redis, s3 or disk) into a first tier in the engine's "
                                 f"own memory (cpu); the tiers are {types}")
        if warm.enabled and info.data.get("promote") is False:
            raise ValueError("enabled: warm start puts the hot set into the cpu tier by "
                             "promoting what the shared tier serves, and promote is false")
        return warm

    def as_store_config(self, drop_types: tuple[str, ...] = ()) -> StoreConfig | None:
        """The plain store config (connector keys removed), optionally without some tier types.

        None when no tier is left (a cpu-only pool seen from the scheduler process).
        """
        data = self.model_dump(exclude=set(CONNECTOR_KEYS))
        data["tiers"] = [t for t in data["tiers"] if t["type"] not in drop_types]
        if not data["tiers"]:
            return None
        return StoreConfig.model_validate(data)


def _read_file(path: str) -> dict[str, Any]:
    try:
        docs = read_documents(path)
    except OSError as exc:
        raise ConnectorConfigError(f"{EXTRA_CONFIG}.config_file: cannot read {path}: {exc}") from exc
    except (ValueError, yaml.YAMLError) as exc:
        kind = "JSON" if Path(path).suffix == ".json" else "YAML"
        raise ConnectorConfigError(f"{EXTRA_CONFIG}.config_file: {path} is not valid "
                                   f"{kind}: {exc}") from exc
    if len(docs) > 1:
        raise ConnectorConfigError(f"{EXTRA_CONFIG}.config_file: {path} must hold one "
                                   f"document, not {len(docs)}")
    data = docs[0] if docs else {}
    if data is None:  # JSON null
        data = {}
    if not isinstance(data, dict):
        raise ConnectorConfigError(f"{EXTRA_CONFIG}.config_file: {path} must hold a mapping")
    if "config_file" in data:
        raise ConnectorConfigError(f"{EXTRA_CONFIG}.config_file: {path} must not name "
                                   "another config_file")
    return data


def _format(exc: ValidationError, source: str) -> str:
    lines = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err["loc"] if not str(x).startswith(("function-", "tagged-")))
        field = f"{EXTRA_CONFIG}.{loc}" if loc else EXTRA_CONFIG
        lines.append(f"{field}: {err['msg']}")
    return f"invalid KVPoolConnector config ({source}): " + "; ".join(lines)


def load_connector_config(extra: dict[str, Any] | None) -> ConnectorConfig:
    """Merge `config_file` (if any) with the inline keys and validate."""
    inline = dict(extra or {})
    merged: dict[str, Any] = {}
    source = "inline"
    if inline.get("config_file"):
        merged.update(_read_file(str(inline["config_file"])))
        source = f"{inline['config_file']} + inline"
    merged.update(inline)
    try:
        return ConnectorConfig.model_validate(merged)
    except ValidationError as exc:
        raise ConnectorConfigError(_format(exc, source)) from None


def check_block_size(cfg: ConnectorConfig, block_size: int) -> int:
    """Blocks per chunk; chunk_tokens must be a whole number of vLLM blocks."""
    if cfg.chunk_tokens % block_size:
        raise ConnectorConfigError(
            f"{EXTRA_CONFIG}.chunk_tokens: {cfg.chunk_tokens} is not a multiple of vLLM's "
            f"block size {block_size} (use e.g. {max(block_size, cfg.chunk_tokens // block_size * block_size)})")
    blocks = cfg.chunk_tokens // block_size
    if cfg.tail_objects and blocks > MAX_TAIL_CHUNK_BLOCKS:
        raise ConnectorConfigError(
            f"{EXTRA_CONFIG}.chunk_tokens: {cfg.chunk_tokens} is {blocks} blocks of "
            f"{block_size} tokens; with tail_objects a chunk holds at most "
            f"{MAX_TAIL_CHUNK_BLOCKS} blocks (use at most "
            f"{MAX_TAIL_CHUNK_BLOCKS * block_size}, or tail_objects: false)")
    return blocks


# a tail object's key holds its block count in one byte (tails.py), and a tail is shorter
# than a chunk
MAX_TAIL_CHUNK_BLOCKS = 256


def check_hash_algo(algo: str, shared_tiers: list[str]) -> None:
    """Refuse a non-cryptographic prefix hash in a pool with a shared tier.

    Chunk keys come from vLLM's block hashes. vLLM's xxhash variants are seeded from
    PYTHONHASHSEED, a 32-bit value that is no secret (guessable, and every engine of the
    pool must hold it): whoever knows it can craft a prompt whose blocks collide with
    another user's, and so read or poison that user's chunks in a tier other engines share.
    sha256 (vLLM's default) has no such attack. A pool whose tiers all live in the engine's
    own memory (cpu) shares nothing and may use xxhash."""
    if algo.startswith("xxhash") and shared_tiers:
        raise ConnectorConfigError(
            f"prefix_caching_hash_algo (--prefix-caching-hash-algo) {algo!r} is not collision "
            f"resistant and this pool has shared tiers ({', '.join(shared_tiers)}): use "
            "sha256 (vLLM's default) or sha256_cbor")
