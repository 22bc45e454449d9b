"""Configuration models of the tiered KV store: the single source of truth for its config.

Imports only pydantic and pyyaml, so the operator (no torch, no redis, no boto3 in its
image) can validate the config it renders. The vLLM connector extends `StoreConfig` with
its own keys by subclassing it (every model forbids unknown keys, so a typo fails with a
message naming the field instead of silently doing nothing).

Sizes accept integers (bytes) or strings with binary ("4Gi", "500Mi", "64Ki") or decimal
("4G", "500M", "64k") suffixes. Secrets are never part of the config: tiers name the
environment variables (or files) that hold them.

Tier configs are open: `StoreConfig.tiers` accepts every registered tier type, dispatching
on `type` through a registry (`register_tier_config`; a store's `register_tier` fills it),
so a tier defined outside this package is one module and one registration. The built-in
tiers' models are registered here, so the operator validates what it renders without the
store. Packages make their tiers known to every process that reads configs (engines,
`kvpool validate`) through the `kvpool_connector.tiers` entry point group, loaded when a
config names a type not registered yet.
"""

from __future__ import annotations

import json
import re
from fractions import Fraction
from importlib.metadata import entry_points
from pathlib import Path
from typing import Annotated, Any, Literal, Self, TypeVar, Union, get_args
from urllib.parse import parse_qsl, urlsplit

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, TypeAdapter, model_validator
from pydantic_core import core_schema

_UNITS = {  # Kubernetes quantity suffixes (the operator's CRD grammar), plus "b"
    "": 1, "b": 1,
    "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "p": 10**15, "e": 10**18,
    "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40, "pi": 2**50, "ei": 2**60,
}
SIZE_MAX_CHARS = 32  # the KVCachePool CRD's bound on a size string; one grammar for both
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | float | str) -> int:
    """'4Gi' -> 4294967296, '500M' -> 500000000, 1024 -> 1024. Raises ValueError on junk."""
    if isinstance(value, bool):
        raise ValueError(f"size must be an integer or a string like '4Gi', not {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size must not be negative: {value}")
        return value
    if isinstance(value, float):
        if value < 0 or value != int(value):
            raise ValueError(f"size must be a whole, non-negative number of bytes: {value}")
        return int(value)
    if not isinstance(value, str):
        raise ValueError(f"size must be an integer or a string like '4Gi', "
                         f"not {type(value).__name__}")
    if len(value) > SIZE_MAX_CHARS:
        raise ValueError(f"invalid size {value[:SIZE_MAX_CHARS]!r}...: at most {SIZE_MAX_CHARS} "
                         "characters")
    m = _SIZE_RE.match(value)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(f"invalid size {value!r}: use bytes or a suffix Ki, Mi, Gi, Ti, Pi, "
                         f"Ei (or k, M, G, T, P, E)")
    n = Fraction(m.group(1)) * _UNITS[unit]  # exact: 10000000000000001 stays odd
    if n.denominator != 1:
        raise ValueError(f"size {value!r} is not a whole number of bytes")
    return int(n)


def format_size(nbytes: int) -> str:
    """A byte count as a quantity in the largest binary unit that divides it (79456894976 ->
    74Gi): parse_size's inverse, never rounded."""
    for suffix, unit in (("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10)):
        if nbytes and nbytes % unit == 0:
            return f"{nbytes // unit}{suffix}"
    return str(nbytes)


Size = Annotated[int, BeforeValidator(parse_size), Field(ge=0)]
PositiveSize = Annotated[int, BeforeValidator(parse_size), Field(gt=0)]


# Query keys a backend URL may carry. redis-py percent-decodes every query key and passes it
# to the connection as an argument that wins over the tier's own (`%70assword=` is the
# password, `ssl_cert_reqs=none` turns TLS verification off), so keys are decoded the way it
# decodes them and only these pass; an S3 endpoint has no use for a query at all.
REDIS_QUERY_KEYS = frozenset({"db"})
CREDENTIALS_IN_URL = "must not contain credentials (user:password@ or user@)"


def url_problem(url: str, query_keys: frozenset[str] = frozenset()) -> str | None:
    """Why a backend URL must not be used, or None: userinfo, a fragment, or a query key (after
    percent-decoding, as redis-py reads it) outside `query_keys`. One parser for the connector's
    config and the operator's CRD models (whose CEL rule mirrors it with a stricter grammar)."""
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        return f"is not a valid URL ({exc})"
    if "@" in parts.netloc:
        return CREDENTIALS_IN_URL
    if "#" in url:
        return "must not carry a fragment (#...)"
    for key, value in parse_qsl(parts.query, keep_blank_values=True):
        if key not in query_keys:
            allowed = ", ".join(sorted(query_keys)) or "none"
            return f"must not carry the query key {key!r} (allowed: {allowed})"
        if not value.isascii() or not value.isdigit():  # the only allowed key is Redis' db
            return f"query key {key!r} must be a whole number, not {value!r}"
    return None


def no_credentials(url: str, field: str, query_keys: frozenset[str] = frozenset()) -> None:
    """Secrets never travel in a URL (configs land in ConfigMaps, logs and status)."""
    problem = url_problem(url, query_keys)
    if problem is not None:
        raise ValueError(f"{field}: {problem}; credentials come from username and "
                         "password_env/password_file (or the S3 key variables), TLS from the "
                         "tier's tls_* keys")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


_UNVERIFIED_TLS = ("TLS certificate verification is off ({field}): anyone on the network path "
                   "can pose as the server, read what is stored (unless security.encrypt) and "
                   "drop or withhold objects; objects stay authenticated by the pool key")


class TierConfigBase(_Strict):
    """What every tier's config has. A tier's model subclasses it with
    `type: Literal["<type>"] = "<type>"` and its own keys, and is registered with its tier
    (`kvpool_connector.store.tiers.register_tier`)."""

    type: str
    name: str | None = Field(None, description="tier label in stats/metrics; defaults to the type "
                                               "(with a suffix when a type repeats)")
    queue_size: int | None = Field(None, ge=1, description="bounded write queue of a lower tier; "
                                                           "defaults to the store's queue_size")
    queue_bytes: PositiveSize | None = Field(None, description="bytes that queue may hold; "
                                             "defaults to the store's queue_bytes")
    workers: int = Field(2, ge=1, le=64, description="writer threads serving the queue")
    timeout_seconds: float | None = Field(None, gt=0, le=60,
                                          description="per-call bound; defaults to the store's")

    def transport_warnings(self) -> list[str]:
        """What this tier's transport settings expose (logged when a store opens it): the
        objects stay authenticated, but an unverified peer sees and drops what passes."""
        return []


class CpuTierConfig(TierConfigBase):
    """Preallocated host-memory arena of fixed-size slots."""

    type: Literal["cpu"] = "cpu"
    size: PositiveSize = Field(parse_size("4Gi"), description="arena bytes (hard bound)")
    eviction: Literal["lru", "arc"] = "lru"
    slot_size: PositiveSize | None = Field(None, description="bytes per slot; default: one "
                                           "chunk in the KV connector (a chunk is then one "
                                           "contiguous slot, read in place), else the size of "
                                           "the first stored object rounded up to 4 KiB")
    pin_memory: bool | None = Field(None, description="pinned (page-locked) arena; default: "
                                                      "when CUDA is available")


class DiskTierConfig(TierConfigBase):
    """A directory on a local filesystem (node NVMe), capped and evicting."""

    type: Literal["disk"] = "disk"
    path: str = Field(min_length=1)
    size: PositiveSize = Field(description="bytes on disk (hard bound, shared by processes that "
                                           "use the same path and namespace)")
    fsync: Literal["never", "file", "always"] = Field(
        "never", description="never: rely on the page cache; file: fsync each object before "
                             "rename; always: also fsync the directory after rename")
    direct_io: bool = Field(False, description="write with O_DIRECT through a page-aligned "
                            "copy, keeping rarely read data out of the page cache (falls back "
                            "to buffered writes where the filesystem refuses it)")
    rescan_seconds: float = Field(10.0, ge=0, description="how often the index is refreshed "
                                  "from disk (objects of other processes, capacity); 0 = never")


class RedisTierConfig(TierConfigBase):
    type: Literal["redis"] = "redis"
    url: str = Field(pattern=r"^(redis|rediss|unix)://", description="redis://, rediss:// (TLS) "
                                                                    "or unix:// URL, no password")
    password_env: str | None = Field(None, description="environment variable with the password")
    password_file: str | None = Field(None, description="file with the password (mounted secret)")
    username: str | None = None
    ttl_seconds: int | None = Field(None, gt=0)
    key_prefix: str = Field("kvpool:", max_length=64)
    max_connections: int = Field(16, ge=1, le=1024)
    batch_bytes: PositiveSize = Field(parse_size("32Mi"), description="bytes per pipeline, so one "
                                      "batch never occupies the server for long")
    tls_ca_file: str | None = None
    tls_insecure: bool = False
    cluster: bool = Field(False, description="a Redis Cluster: url names one node (a seed; the "
                          "client discovers the others), keys spread over the slot owners")

    def transport_warnings(self) -> list[str]:
        if self.url.startswith("rediss://") and self.tls_insecure:
            return [_UNVERIFIED_TLS.format(field="tls_insecure: true")]
        return []

    @model_validator(mode="after")
    def _checked_url(self) -> Self:
        no_credentials(self.url, "url", REDIS_QUERY_KEYS)
        if self.cluster and not re.fullmatch(r"^rediss?://[^/?#]+(/0?)?$", self.url):
            raise ValueError("url: a cluster is reached over redis:// or rediss:// host:port, "
                             "database 0 (Redis Cluster has no other)")
        return self


class S3TierConfig(TierConfigBase):
    type: Literal["s3"] = "s3"
    endpoint: str | None = Field(None, pattern=r"^https?://", description="None = AWS")
    bucket: str = Field(min_length=3, max_length=63)
    prefix: str = ""
    region: str = "us-east-1"
    access_key_env: str | None = Field(None, description="environment variable with the access "
                                       "key id; none: boto3's default chain (AWS_* variables, "
                                       "instance roles, IRSA)")
    secret_key_env: str | None = Field(None, description="environment variable with the secret "
                                       "access key")
    path_style: bool | None = Field(None, description="path-style addressing (MinIO); default: "
                                                      "on when an endpoint is set")
    create_bucket: bool = False
    max_connections: int = Field(16, ge=1, le=512)
    negative_cache_seconds: float = Field(2.0, ge=0, description="how long a missing object is "
                                          "remembered by contains_prefix")
    presence_cache_seconds: float = Field(10.0, ge=0, description="how long an object known to "
                                          "exist is remembered by contains_prefix")
    verify_tls: bool = True
    tls_ca_file: str | None = Field(None, description="CA bundle that signs the endpoint's "
                                    "certificate (https://), e.g. a mounted Secret's ca.crt")


    def transport_warnings(self) -> list[str]:
        if not self.verify_tls and (self.endpoint is None or self.endpoint.startswith("https:")):
            return [_UNVERIFIED_TLS.format(field="verify_tls: false")]
        return []

    @model_validator(mode="after")
    def _no_endpoint_credentials(self) -> Self:
        if self.endpoint:
            no_credentials(self.endpoint, "endpoint")
        return self


class SecurityConfig(_Strict):
    """Keys that authenticate (and optionally encrypt) every object in a shared tier.

    The pool key comes from an environment variable or a mounted file, never from the config
    itself; it must hold at least 32 characters (the operator generates 43). The previous key
    is optional: during a routine rotation objects written under it stay readable (served,
    never sealed again under the current key into a shared tier); an unset variable or a
    missing file means none. After a leak, rotate without it (docs/connector.md).
    """

    key_env: str | None = Field(None, min_length=1, description="environment variable with the "
                                "pool key (>= 32 characters)")
    key_file: str | None = Field(None, min_length=1, description="file with the pool key "
                                 "(a mounted Secret)")
    previous_key_env: str | None = Field(None, min_length=1, description="environment variable "
                                         "with the previous pool key, accepted for reads")
    previous_key_file: str | None = Field(None, min_length=1, description="file with the "
                                          "previous pool key, accepted for reads")
    encrypt: bool = Field(False, description="encrypt objects in the disk, redis and s3 tiers "
                          "with AES-256-GCM (authenticated: a bad tag is a miss)")
    refuse_plaintext: bool = Field(False, description="with encrypt: objects that are only "
                                   "MAC'd (written before encryption was turned on) are misses "
                                   "instead of being served; turn on once every engine "
                                   "encrypts")

    @model_validator(mode="after")
    def _one_source(self) -> Self:
        if self.key_env and self.key_file:
            raise ValueError("key_env, key_file: set one of them, not both")
        if self.previous_key_env and self.previous_key_file:
            raise ValueError("previous_key_env, previous_key_file: set one of them, not both")
        if self.refuse_plaintext and not self.encrypt:
            raise ValueError("refuse_plaintext: needs encrypt: true (the store would refuse "
                             "every object it writes)")
        return self

    @property
    def has_key(self) -> bool:
        return bool(self.key_env or self.key_file)


TIER_PLUGINS = "kvpool_connector.tiers"  # entry point group: modules that register tiers
_TIER_CONFIGS: dict[str, type[TierConfigBase]] = {}
# the union of the registered models, built on use
_tier_union: TypeAdapter[TierConfigBase] | None = None
_plugins_loaded = False


def register_tier_config(type_name: str, model: type[TierConfigBase]) -> None:
    """Let configs name tier type `type_name`, validated as `model` (a TierConfigBase whose
    `type` is `Literal[type_name]`). Registering the same model again is a no-op."""
    if not (isinstance(model, type) and issubclass(model, TierConfigBase)):
        raise TypeError(f"tier type {type_name!r}: the config model must subclass "
                        f"TierConfigBase, not {model!r}")
    field = model.model_fields.get("type")
    if field is None or get_args(field.annotation) != (type_name,) or field.default != type_name:
        raise ValueError(f"tier type {type_name!r}: {model.__name__}.type must be "
                         f'`Literal["{type_name}"] = "{type_name}"`')
    known = _TIER_CONFIGS.get(type_name)
    if known is model:
        return
    if known is not None:
        raise ValueError(f"tier type {type_name!r} is already registered ({known.__name__})")
    global _tier_union
    _TIER_CONFIGS[type_name] = model
    _tier_union = None


def tier_config_models() -> dict[str, type[TierConfigBase]]:
    """type -> config model of every registered tier type."""
    return dict(_TIER_CONFIGS)


def load_tier_plugins() -> None:
    """Import the modules of the `kvpool_connector.tiers` entry points (each registers its
    tiers on import), once per process."""
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    for entry in entry_points(group=TIER_PLUGINS):
        try:
            entry.load()
        except Exception as exc:  # a config error naming the tier, not a traceback
            raise ValueError(f"tier plugin {entry.name!r} ({entry.value}) cannot be loaded: "
                             f"{type(exc).__name__}: {exc}") from exc


def _tier_adapter() -> TypeAdapter[TierConfigBase]:
    global _tier_union
    if _tier_union is None:
        models = tuple(_TIER_CONFIGS.values())
        # Union[] over a runtime tuple (`A | B` needs the members written out), which is no
        # static type: Any to mypy
        union: Any = Annotated[Union[models], Field(discriminator="type")]  # noqa: UP007
        _tier_union = TypeAdapter(union)
    return _tier_union


def _validate_tier(value: Any) -> TierConfigBase:
    """A tier config as the model its `type` names (errors located under that type, as a
    discriminated union locates them: `tiers.0.cpu.size`)."""
    type_name = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    if isinstance(type_name, str) and type_name not in _TIER_CONFIGS:
        load_tier_plugins()
    return _tier_adapter().validate_python(value)


class _RegisteredTierConfig:
    """Pydantic hooks of `TierConfig`: validation and JSON schema from the registry as it
    is when they run (a discriminated union is fixed when its model class is defined),
    serialization as the concrete model."""

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> core_schema.CoreSchema:
        return core_schema.no_info_plain_validator_function(
            _validate_tier, serialization=core_schema.simple_ser_schema("any"))

    @classmethod
    def __get_pydantic_json_schema__(cls, schema: Any, handler: Any) -> Any:
        load_tier_plugins()
        return handler(_tier_adapter().core_schema)


# Any registered tier's config; `StoreConfig.tiers` holds these.
TierConfig = Annotated[TierConfigBase, _RegisteredTierConfig]

for _model in (CpuTierConfig, DiskTierConfig, RedisTierConfig, S3TierConfig):
    register_tier_config(_model.model_fields["type"].default, _model)

_NAMESPACE_RE = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"


class StoreConfig(_Strict):
    """The tiered store. Subclass it to add keys (the vLLM connector does)."""

    namespace: str = Field("default", pattern=_NAMESPACE_RE,
                           description="isolates pools sharing a directory, Redis or bucket")
    tiers: list[TierConfig] = Field(min_length=1, description="ordered, fastest first")
    timeout_seconds: float = Field(0.5, gt=0, le=60, description="bound of every store call")
    queue_size: int = Field(256, ge=1, description="default write-queue length of lower tiers")
    batch_max: int = Field(32, ge=1, description="objects a writer takes from its queue at once")
    backoff_initial_seconds: float = Field(0.25, gt=0, description="a tripped tier's first "
                                           "backoff, doubled per failed probe")
    backoff_max_seconds: float = Field(10.0, gt=0, description="the longest backoff")
    write_failures_to_trip: int = Field(3, ge=1, description="consecutive failed writes (errors, "
                                        "timeouts) that make a tier back off its writes; one "
                                        "failed write never drops the next, independent one")
    promote: bool = Field(True, description="copy lower-tier hits into the faster tiers")
    queue_bytes: PositiveSize = Field(parse_size("1Gi"), description="bytes a lower tier's write "
                                      "queue may hold (beyond: dropped and counted), so a slow "
                                      "backend cannot grow host memory")
    max_object_size: PositiveSize = Field(parse_size("256Mi"), description="largest object a "
                                          "read accepts when the caller gives no buffer; larger "
                                          "ones are refused without being read whole")
    metrics: bool = Field(True, description="export Prometheus metrics")
    security: SecurityConfig = Field(default_factory=SecurityConfig,
                                     description="pool key (object MACs, names) and encryption")

    @model_validator(mode="after")
    def _unique_names(self) -> Self:
        names = tier_names(self.tiers)
        if len(set(names)) != len(names):
            raise ValueError(f"tiers: names must be unique, got {names}")
        return self


def transport_warnings(cfg: StoreConfig) -> list[str]:
    """One line per tier whose transport settings weaken it (see transport_warnings)."""
    return [f"tier {name}: {w}" for name, t in zip(tier_names(cfg.tiers), cfg.tiers, strict=True)
            for w in t.transport_warnings()]


def tier_names(tiers: list[Any]) -> list[str]:
    """Label of each tier: its `name`, else its type (disk, disk2, ... when a type repeats)."""
    seen: dict[str, int] = {}
    out = []
    for t in tiers:
        if t.name:
            out.append(t.name)
            continue
        seen[t.type] = seen.get(t.type, 0) + 1
        out.append(t.type if seen[t.type] == 1 else f"{t.type}{seen[t.type]}")
    return out


def read_documents(path: str | Path, text: str | None = None) -> list[Any]:
    """The documents of a config file: a `.json` file holds one JSON document, anything else
    is a YAML stream (empty documents left out). `text`: the content when the caller already
    has it (stdin). The one reader of config files in this package. Raises OSError,
    ValueError (bad JSON) or yaml.YAMLError."""
    if text is None:
        text = Path(path).read_text()
    if str(path).endswith(".json"):
        return [json.loads(text)]
    return [d for d in yaml.safe_load_all(text) if d is not None]


class UsageError(ValueError):
    """A command cannot run as asked (a path it cannot read, bad settings): CLIs exit 2, where an
    invalid document exits 1. The message is one line."""


class UnreadableFile(UsageError):
    """A config file that cannot be read at all (missing, a directory, no permission): the
    command was given the wrong path (CLIs exit 2). One line, naming the path."""


class MalformedFile(ValueError):
    """A config file that was read but holds no usable documents (a YAML or JSON syntax error,
    not text, empty): the input is invalid (CLIs exit 1). One line, naming path, line and column."""


def _syntax_error(path: str, exc: Exception) -> MalformedFile:
    if isinstance(exc, json.JSONDecodeError):
        return MalformedFile(f"{path}:{exc.lineno}:{exc.colno}: JSON syntax error: {exc.msg}")
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else path
    problem = " ".join(str(getattr(exc, "problem", None) or exc).split())
    if "'\\t'" in problem:
        problem += " (YAML indents with spaces, never tabs)"
    return MalformedFile(f"{where}: YAML syntax error: {problem}")


def load_documents(path: str | Path, text: str | None = None) -> list[Any]:
    """`read_documents` for commands: the documents of a file ('-': `text`, read from stdin by
    the caller), or one-line errors: UnreadableFile for a path that cannot be read,
    MalformedFile for a syntax error, bytes that are not UTF-8 or a file with no document."""
    shown = str(path)
    if text is None:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise UnreadableFile(f"{shown}: no such file") from None
        except IsADirectoryError:
            raise UnreadableFile(f"{shown}: is a directory, not a file") from None
        except PermissionError:
            raise UnreadableFile(f"{shown}: permission denied") from None
        except UnicodeDecodeError as exc:
            raise MalformedFile(f"{shown}: not UTF-8 text (byte {exc.start})") from None
        except OSError as exc:
            raise UnreadableFile(f"{shown}: cannot read: {exc.strerror or exc}") from None
    try:
        docs = read_documents(path, text)
    except (yaml.YAMLError, json.JSONDecodeError) as exc:
        raise _syntax_error(shown, exc) from None
    if not docs:
        raise MalformedFile(f"{shown}: no document (the file is empty)")
    return docs


C = TypeVar("C", bound=StoreConfig)


def load_store_config(source: Any, model: type[C] = StoreConfig) -> C:  # type: ignore[assignment]
    """A validated config from a model instance, a dict, or a YAML/JSON file path.

    `model` lets a subclass (the connector's config) reuse the loader.
    """
    if isinstance(source, model):
        return source
    if isinstance(source, StoreConfig):
        return model.model_validate(source.model_dump())
    if isinstance(source, (str, Path)):
        docs = read_documents(source)
        if len(docs) != 1 or not isinstance(docs[0], dict):
            raise ValueError(f"{source}: expected a mapping at the top level")
        return model.model_validate(docs[0])
    if isinstance(source, dict):
        return model.model_validate(source)
    raise TypeError(f"store config must be a dict, a file path or {model.__name__}, "
                    f"not {type(source).__name__}")
