"""The KVCachePool API (`kvpool.dev/v1alpha1`): the single source of truth.

The CRD's OpenAPI schema (crd.py), the offline renderer and the reconciler all read these
pydantic models. Every rule that the API server enforces with CEL (`x-kubernetes-validations`,
attached here with `json_schema_extra`) is also enforced by a pydantic validator with the same
message, so a spec rejected by the cluster is rejected offline too, and vice versa.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel

from kvpool_connector.config import (
    CREDENTIALS_IN_URL,
    REDIS_QUERY_KEYS,
    SIZE_MAX_CHARS,
    format_size as format_size,  # re-exported: the renderers call models.format_size
    parse_size,
    url_problem,
)

GROUP = "kvpool.dev"
VERSION = "v1alpha1"
KIND = "KVCachePool"
PLURAL = "kvcachepools"
SINGULAR = "kvcachepool"
SHORT_NAMES = ["kvp"]
API_VERSION = f"{GROUP}/{VERSION}"

# Sizes. One parser reads them: the connector's `parse_size`, for the CRD as for the connector's
# own config. The CRD admits its Kubernetes-quantity spelling (the string is also copied into
# Kubernetes fields: memory requests, sizeLimit, storage), with at most three decimals, so that a
# CEL regex can tell exactly which of them parse_size reads as whole bytes (CEL has no arithmetic on
# an unbounded fraction): `1.5Gi` and `0.5k` are bytes, `1.5` and `0.3Ki` (307.2) are not.
SIZE_SUFFIXES = ("Ki", "Mi", "Gi", "Ti", "Pi", "Ei", "k", "M", "G", "T", "P", "E")
SIZE_DECIMALS = 3
SIZE_PATTERN = rf"^[0-9]+([.][0-9]{{1,{SIZE_DECIMALS}}})?({'|'.join(SIZE_SUFFIXES)})?$"
SIZE_MESSAGE = f"must be a size such as 64Gi, 1.5Ti or 500G (at most {SIZE_DECIMALS} decimals)"
WHOLE_BYTES_MESSAGE = "must be a whole number of bytes"
POSITIVE_MESSAGE = "must be a positive size"
ZERO_PATTERN = r"^0+([.]0+)?[a-zA-Z]*$"


def _whole_bytes_pattern() -> str:
    """A regex for the sizes of SIZE_PATTERN that parse_size reads as whole bytes, derived from
    parse_size itself: per suffix, which fractions of up to SIZE_DECIMALS digits it accepts (the
    integer part is always whole). Suffixes accepting the same fractions share an alternative."""
    by_fractions: dict[tuple[str, ...], list[str]] = {}
    for suffix in (*SIZE_SUFFIXES, ""):
        fractions = []
        for digits in range(1, SIZE_DECIMALS + 1):
            for n in range(10**digits):
                try:
                    parse_size(f"0.{n:0{digits}d}{suffix}")
                except ValueError:
                    continue
                fractions.append(f"{n:0{digits}d}")
        by_fractions.setdefault(tuple(fractions), []).append(suffix)
    every = sum(10**d for d in range(1, SIZE_DECIMALS + 1))
    alternatives = []
    for accepted, suffixes in by_fractions.items():
        fraction = f"[0-9]{{1,{SIZE_DECIMALS}}}" if len(accepted) == every else "|".join(accepted)
        named = "|".join(filter(None, suffixes))
        suffix = f"({named})" + ("" if all(suffixes) else "?") if named else ""
        alternatives.append(f"[0-9]+([.]({fraction}))?{suffix}")
    return "^(" + "|".join(alternatives) + ")$"


WHOLE_BYTES_PATTERN = _whole_bytes_pattern()


def _positive_size(value: str) -> str:
    if not re.fullmatch(SIZE_PATTERN, value):
        raise ValueError(f"{value!r} {SIZE_MESSAGE}")
    try:
        nbytes = parse_size(value)
    except ValueError:
        raise ValueError(WHOLE_BYTES_MESSAGE) from None
    if nbytes == 0:
        raise ValueError(POSITIVE_MESSAGE)
    return value


def _matches(pattern: str) -> str:
    """A CEL `matches` call of a Python regex (RE2-compatible; backslashes escaped for CEL)."""
    return "self.matches('" + pattern.replace("\\", "\\\\") + "')"


Size = Annotated[
    str,
    AfterValidator(_positive_size),
    Field(
        max_length=SIZE_MAX_CHARS,
        json_schema_extra={"pattern": SIZE_PATTERN, "x-kubernetes-validations": [
            {"rule": _matches(WHOLE_BYTES_PATTERN), "message": WHOLE_BYTES_MESSAGE},
            {"rule": f"!{_matches(ZERO_PATTERN)}", "message": POSITIVE_MESSAGE},
        ]},
    ),
]


# A URL in a spec is copied into ConfigMaps, pod specs and status, and its client reads every part
# of it: it must carry nothing but where the backend is. The models parse it as the connector does
# (kvpool_connector.config.url_problem: userinfo, a fragment, percent-decoded query keys outside an
# allow-list), and the CRD's CEL rule mirrors that with a grammar that admits exactly what both
# accept: a plain host, a database number (Redis) or path (S3), and for Redis at most `?db=<n>`.
_HOST = r"([A-Za-z0-9._~-]+|\[[0-9A-Fa-f:.]+\])(:[0-9]{1,5})?"
REDIS_URL_PATTERN = rf"^rediss?://{_HOST}(/[0-9]*)?([?]db=[0-9]+)?$"
S3_ENDPOINT_PATTERN = rf"^https?://{_HOST}(/[^?#]*)?$"
_USERINFO_RULE = "!self.matches('^[A-Za-z][A-Za-z0-9+.-]*://[^/?#]*@')"
_CREDENTIALS_MESSAGE = f"{CREDENTIALS_IN_URL}: use a Secret reference"
REDIS_URL_MESSAGE = ("must be redis[s]://host[:port][/db] with no query but db=<n> and no fragment: credentials "
                     "come from passwordSecretRef, TLS settings from caSecretRef")
S3_ENDPOINT_MESSAGE = ("must be http[s]://host[:port][/path] with no query and no fragment: credentials come "
                       "from credentialsSecretRef, TLS settings from caSecretRef")


def _backend_url(pattern: str, message: str, query_keys: frozenset[str]) -> Any:
    def check(value: str) -> str:
        problem = url_problem(value, query_keys)
        if problem == CREDENTIALS_IN_URL:
            raise ValueError(_CREDENTIALS_MESSAGE)
        if problem is not None or not re.fullmatch(pattern, value):
            raise ValueError(f"{problem}: {message}" if problem else message)
        return value

    rules: list[JsonValue] = [{"rule": _USERINFO_RULE, "message": _CREDENTIALS_MESSAGE},
                              {"rule": _matches(pattern), "message": message}]
    return Annotated[str, AfterValidator(check), Field(json_schema_extra={"x-kubernetes-validations": rules})]


if TYPE_CHECKING:  # to a type checker both are strings; the checks run in pydantic
    RedisUrl = str
    S3Endpoint = str
else:
    RedisUrl = _backend_url(REDIS_URL_PATTERN, REDIS_URL_MESSAGE, REDIS_QUERY_KEYS)
    S3Endpoint = _backend_url(S3_ENDPOINT_PATTERN, S3_ENDPOINT_MESSAGE, frozenset())


# Empty (the operator's default) or an image by tag or digest (`repo:tag@sha256:<64 hex>`).
OPTIONAL_IMAGE_PATTERN = r"^([^\s@]+(@sha256:[a-f0-9]{64})?)?$"

NORMAL_PATH_RULE = ("!self.matches('(^|/)[.]{1,2}(/|$)|//')",
                    "must be a normal absolute path (no '.', '..' or empty segments)")


def _normal_path(value: str) -> str:
    if re.search(NORMAL_PATH_RULE[0].removeprefix("!self.matches('").removesuffix("')"), value):
        raise ValueError(NORMAL_PATH_RULE[1])
    return value


def _rules(*rules: tuple[str, str, str | None]) -> dict[str, Any]:
    """`x-kubernetes-validations` entries: (CEL rule, message, fieldPath or None)."""
    out = []
    for rule, message, path in rules:
        entry = {"rule": rule, "message": message}
        if path:
            entry["fieldPath"] = path
        out.append(entry)
    return {"x-kubernetes-validations": out}


class _Model(BaseModel):
    """camelCase on the wire, snake_case in Python; unknown fields are errors (typos surface)."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid"
    )


# Kubernetes types passed through untouched; the API server validates them in the child objects.
K8sObject = Annotated[
    dict[str, Any],
    Field(json_schema_extra={"x-kubernetes-preserve-unknown-fields": True}),
]


class SecretKeyRef(_Model):
    name: str = Field(min_length=1, max_length=253, description="Name of a Secret in the pool's namespace.")
    key: str = Field(min_length=1, max_length=253, description="Key inside the Secret.")


# vLLM flags whose value is a secret: in extraArgs it would sit in the pod spec for anyone to read.
# vLLM's parser (FlexibleArgumentParser) reads `_` as `-` in a flag's name and takes an unambiguous
# prefix of a flag for the flag (argparse's allow_abbrev), and `--config FILE` reads flags from a
# file: so every spelling of each, any prefix of it included, is refused, with `=value` or a
# `.key` (vLLM's dict arguments) after it. One pattern, read by CEL (RE2) and by the model.
SECRET_ARGS = ("--api-key", "--hf-token", "--config")


def _any_prefix(flag: str) -> str:
    """A regex for every prefix of `flag` (`--api-key`: `--a` ... `--api-key`), `_` for `-`."""
    body = flag.removeprefix("--")
    chars = ["[-_]" if c == "-" else re.escape(c) for c in body]
    nested = ""
    for char in reversed(chars[1:]):
        nested = f"({char}{nested})?"
    return chars[0] + nested


SECRET_ARG_PATTERN = "^--(" + "|".join(_any_prefix(f) for f in SECRET_ARGS) + ")([=.].*)?$"
_SECRET_ARGS_RULE = f"!has(self.extraArgs) || !self.extraArgs.exists(a, a.matches('{SECRET_ARG_PATTERN}'))"
_SECRET_ARGS_MESSAGE = ("extraArgs must not pass --api-key, --hf-token or --config, in any spelling or prefix "
                        "vLLM reads as them (the value would sit in the pod spec): use service.apiKeySecretRef, "
                        "or model.env with valueFrom.secretKeyRef")


def secret_arg(arg: str) -> bool:
    """Whether vLLM would read `arg` as one of SECRET_ARGS (the CEL rule's pattern)."""
    return re.match(SECRET_ARG_PATTERN, arg, flags=re.DOTALL) is not None


IMAGE_PATTERN = r"^[^\s@]+(@sha256:[a-f0-9]{64})?$"
PULL_POLICIES = Literal["Always", "IfNotPresent", "Never"]
# Where the engine container keeps things of its own; a model volume mounted over one would hide it.
MODEL_MOUNT_DEFAULT = "/models"
HF_CACHE_DIR = "/var/cache/huggingface"  # HF_HOME when spec.model.hfCache is set
RESERVED_MOUNTS = ("/etc/kvpool", "/etc/kvpool-tls", "/dev/shm", "/home/kvpool", "/var/lib/kvpool", HF_CACHE_DIR)
_RESERVED_RULE = ("![" + ", ".join(f"'{p}'" for p in RESERVED_MOUNTS) + "].exists(p, self == p || "
                  "self.startsWith(p + '/') || p.startsWith(self + '/')) && self != '/'")
_RESERVED_MESSAGE = ("must not be /, nor be, hold or lie under a directory of the engine's own ("
                     + ", ".join(RESERVED_MOUNTS) + ")")
_RELATIVE_RULE = "!self.startsWith('/') && !self.matches('(^|/)[.]{1,2}(/|$)|//')"
_RELATIVE_MESSAGE = "must be a relative path inside the volume (no leading /, no '.', '..' or empty segments)"


def _model_mount(value: str) -> str:
    _normal_path(value)
    path = value.rstrip("/")
    if not path or any(path == p or path.startswith(p + "/") or p.startswith(path + "/") for p in RESERVED_MOUNTS):
        raise ValueError(_RESERVED_MESSAGE)
    return value


def _relative(value: str) -> str:
    if value and (value.startswith("/") or re.search(r"(^|/)[.]{1,2}(/|$)|//", value)):
        raise ValueError(_RELATIVE_MESSAGE)
    return value


class ModelImage(_Model):
    """A Kubernetes image volume (`volumes[].image`): an OCI image or artifact holding the weights,
    pulled by the kubelet like a container image and mounted read-only (Kubernetes 1.33+ with the
    ImageVolume feature; on by default from 1.35)."""

    reference: str = Field(
        min_length=1, max_length=1024, pattern=IMAGE_PATTERN,
        description="Image reference, by tag or pinned by digest (repo@sha256:...); subject to the operator's "
        "allowedImagePrefixes like every image a pool names.",
    )
    pull_policy: PULL_POLICIES | None = Field(
        None, description="Always, IfNotPresent or Never; empty: Kubernetes' default (Always for :latest).")


class ModelVolume(_Model):
    """Where the weights are read from, mounted read-only: serve them from here (model.name = a path
    under mountPath) instead of downloading them at every pod start."""

    persistent_volume_claim: PvcVolume | None = Field(
        None, description="An existing claim holding the weights (ReadOnlyMany or ReadWriteMany for several replicas)."
    )
    host_path: HostPathVolume | None = Field(
        None, description="A node directory with the weights, mounted whole and read-only; under the operator's "
        "allowedModelHostPathPrefixes, and never over a disk tier's directory."
    )
    image: ModelImage | None = Field(None, description="An OCI image volume with the weights.")
    mount_path: Annotated[str, AfterValidator(_model_mount)] = Field(
        MODEL_MOUNT_DEFAULT, min_length=1, max_length=1024, pattern=r"^/",
        description="Where the engine sees the volume (read-only).",
        json_schema_extra={"x-kubernetes-validations": [
            {"rule": NORMAL_PATH_RULE[0], "message": NORMAL_PATH_RULE[1]},
            {"rule": _RESERVED_RULE, "message": _RESERVED_MESSAGE}]},
    )
    sub_path: Annotated[str, AfterValidator(_relative)] = Field(
        "", max_length=1024, description="A directory inside the volume to mount instead of its root.",
        json_schema_extra={"x-kubernetes-validations": [
            {"rule": f"self == '' || ({_RELATIVE_RULE})", "message": _RELATIVE_MESSAGE}]},
    )

    model_config = ConfigDict(
        json_schema_extra=_rules(
            ("[has(self.persistentVolumeClaim), has(self.hostPath), has(self.image)].filter(x, x).size() == 1",
             "exactly one of persistentVolumeClaim, hostPath, image must be set", None),
        )
    )

    @model_validator(mode="after")
    def _one_source(self) -> ModelVolume:
        if sum(v is not None for v in (self.persistent_volume_claim, self.host_path, self.image)) != 1:
            raise ValueError("exactly one of persistentVolumeClaim, hostPath, image must be set")
        return self


class HfCache(_Model):
    """A Hugging Face cache shared by the replicas: HF_HOME on a claim, so a hub model is downloaded
    once (by the first pod) instead of at every pod start."""

    persistent_volume_claim: PvcVolume = Field(
        description="An existing claim (ReadWriteMany for several replicas) mounted at HF_HOME "
        f"({HF_CACHE_DIR})."
    )
    read_only: bool = Field(
        False, description="Mount it read-only and run the engines offline (HF_HUB_OFFLINE=1): the cache is "
        "filled beforehand, pods never download."
    )


CPU_KV_CACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"  # GiB of vLLM's paged KV cache on its CPU platform
# env is a list of free-form objects, which CEL cannot read: the operator's validation refuses it
CPU_KV_CACHE_ENV_MESSAGE = (f"env: {CPU_KV_CACHE_ENV} is rendered from model.cpuKvCacheGiB (the memory request "
                            "counts it): set that field instead")


class ModelSpec(_Model):
    name: str = Field(
        min_length=1,
        description="What vLLM serves: a Hugging Face hub id (downloaded at start: see hfCache, hfTokenSecretRef) "
        "or a path inside the image or under volume.mountPath.",
    )
    image: str = Field(
        "",
        max_length=1024,
        pattern=OPTIONAL_IMAGE_PATTERN,
        description="Engine image (vLLM with kvpool_connector installed), by tag or pinned by digest "
        "(repo@sha256:...). Empty: the operator's default connector image.",
    )
    gpus: int = Field(1, ge=0, le=64, description="GPUs per replica (nvidia.com/gpu). 0 runs vLLM on CPU.")
    tensor_parallel_size: int = Field(
        1, ge=1, le=64, description="vLLM --tensor-parallel-size; must not exceed gpus when gpus > 0."
    )
    extra_args: list[Annotated[str, Field(max_length=4096)]] = Field(
        default_factory=list, max_length=256,
        description="Extra `vllm serve` arguments, appended after the operator's (no secrets: they sit in "
        "the pod spec).",
    )
    env: list[K8sObject] = Field(
        default_factory=list, description="core/v1 EnvVar list passed to the engine container unchanged."
    )
    resources: K8sObject = Field(
        default_factory=dict,
        description="core/v1 ResourceRequirements merged over the operator's (GPU limit, memory, tier requests).",
    )
    shm_size: Size = Field("2Gi", description="sizeLimit of the engine's /dev/shm (memory-backed; counts as memory).")
    volume: ModelVolume | None = Field(
        None, description="A volume holding the weights, mounted read-only at its mountPath (default /models): "
        "set name to the model's directory there (for example /models/llama-3.1-8b)."
    )
    hf_cache: HfCache | None = Field(
        None, description="A shared Hugging Face cache (HF_HOME on a claim) for a hub model id in name."
    )
    hf_token_secret_ref: SecretKeyRef | None = Field(
        None, description="The Hugging Face token for gated or private models: HF_TOKEN from this Secret key "
        "(by secretKeyRef: the value never appears in a manifest)."
    )
    memory_overhead: Size = Field(
        "8Gi",
        description="Host memory of vLLM's own process (on CPU nodes, gpus: 0, the model's weights too). "
        "Memory request = limit = this + the CPU tier (native mode: vLLM's host region, a file in /dev/shm) + "
        "the connector's write queues and staging (1Gi per tier after the first, 1Gi staging in tiered mode) + "
        "shmSize + cpuKvCacheGiB on CPU nodes; `kvpool render --explain` itemizes it.",
    )
    cpu_kv_cache_gib: int = Field(
        4, ge=1, le=65536, alias="cpuKvCacheGiB",
        description=f"gpus: 0 only: GiB of vLLM's paged KV cache per tensor-parallel rank, in host memory on CPU "
        f"nodes ({CPU_KV_CACHE_ENV}; counted in the memory request). Unset, vLLM would take 90% of the node's memory.",
    )

    model_config = ConfigDict(
        json_schema_extra=_rules(
            (
                "self.gpus == 0 || self.tensorParallelSize <= self.gpus",
                "tensorParallelSize must not exceed gpus",
                ".tensorParallelSize",
            ),
            (_SECRET_ARGS_RULE, _SECRET_ARGS_MESSAGE, ".extraArgs"),
        )
    )

    @model_validator(mode="after")
    def _parallelism_and_args(self) -> ModelSpec:
        if self.gpus and self.tensor_parallel_size > self.gpus:
            raise ValueError("tensorParallelSize must not exceed gpus")
        if any(secret_arg(arg) for arg in self.extra_args):
            raise ValueError(_SECRET_ARGS_MESSAGE)
        if any(isinstance(e, dict) and e.get("name") == CPU_KV_CACHE_ENV for e in self.env):
            raise ValueError(CPU_KV_CACHE_ENV_MESSAGE)
        return self


class CpuTier(_Model):
    size: Size = Field(description="Pinned host memory for the CPU tier per replica (for example 64Gi).")
    eviction_policy: Literal["lru", "arc"] = Field("lru", description="Eviction policy of the CPU tier.")


class HostPathVolume(_Model):
    path: Annotated[str, AfterValidator(_normal_path)] = Field(
        min_length=1,
        max_length=1024,
        pattern=r"^/",
        description="Node directory (for example an NVMe mount); it must exist (hostPath type Directory) and "
        "lie under one of the operator's allowedHostPathPrefixes. Each pool mounts only its own subdirectory.",
        json_schema_extra={"x-kubernetes-validations": [{"rule": NORMAL_PATH_RULE[0], "message": NORMAL_PATH_RULE[1]}]},
    )


class EmptyDirVolume(_Model):
    medium: Literal["", "Memory"] = Field(
        "", description="emptyDir medium; the tier size becomes sizeLimit and an ephemeral-storage request."
    )


class EphemeralVolume(_Model):
    storage_class_name: str = Field(
        "", description="StorageClass of the per-pod generic ephemeral volume (empty: cluster default)."
    )


class PvcVolume(_Model):
    claim_name: str = Field(min_length=1, description="Existing PersistentVolumeClaim shared by all replicas.")


_ONE_OF_VOLUME = (
    "[has(self.hostPath), has(self.emptyDir), has(self.ephemeral), "
    "has(self.persistentVolumeClaim)].filter(x, x).size() == 1"
)


class DiskVolume(_Model):
    host_path: HostPathVolume | None = Field(None, description="A node directory, typically local NVMe.")
    empty_dir: EmptyDirVolume | None = Field(None, description="Pod-local scratch space.")
    ephemeral: EphemeralVolume | None = Field(None, description="A generic ephemeral volume per pod.")
    persistent_volume_claim: PvcVolume | None = Field(None, description="An existing claim.")

    model_config = ConfigDict(
        json_schema_extra=_rules(
            (
                _ONE_OF_VOLUME,
                "exactly one of hostPath, emptyDir, ephemeral, persistentVolumeClaim must be set",
                None,
            )
        )
    )

    @model_validator(mode="after")
    def _one_of(self) -> DiskVolume:
        chosen = [self.host_path, self.empty_dir, self.ephemeral, self.persistent_volume_claim]
        if sum(v is not None for v in chosen) != 1:
            raise ValueError("exactly one of hostPath, emptyDir, ephemeral, persistentVolumeClaim must be set")
        return self

    @property
    def kind(self) -> str:
        for name in ("host_path", "empty_dir", "ephemeral", "persistent_volume_claim"):
            if getattr(self, name) is not None:
                return name
        raise AssertionError("validated one-of")


class DiskTier(_Model):
    size: Size = Field(description="Capacity of the disk tier per replica (the store evicts beyond it).")
    volume: DiskVolume = Field(description="Where the disk tier lives; exactly one volume source.")


class TlsSecret(_Model):
    secret_name: str = Field(
        min_length=1, max_length=253,
        description="kubernetes.io/tls Secret (tls.crt, tls.key) with the issuing CA in ca.crt, as cert-manager "
        "writes it; engines get only ca.crt. The certificate must name the Service <name>-redis.<namespace>.svc "
        "(or -minio).",
    )


class ManagedRedis(_Model):
    memory: Size = Field(description="Redis memory; maxmemory is 85% of it with allkeys-lru eviction.")
    tls: TlsSecret | None = Field(None, description="Serve TLS only (engines connect with rediss:// and verify it).")
    image: str = Field("", max_length=1024, pattern=OPTIONAL_IMAGE_PATTERN,
                       description="Redis image, by tag or digest (empty: the operator's default).")


# What kvpool_connector.config.RedisTierConfig accepts for `cluster: true` (one node, database 0).
CLUSTER_URL_PATTERN = r"^rediss?://[^/?#]+(/0?)?$"
_CLUSTER_URL_MESSAGE = ("cluster needs a redis:// or rediss:// url naming one node, database 0 at most "
                        "(Redis Cluster has no other)")


class ExternalRedis(_Model):
    url: RedisUrl = Field(
        min_length=1,
        max_length=2048,
        pattern=r"^rediss?://",
        description="redis:// or rediss:// (TLS) URL: host, port and database only (no credentials, no query "
        "but db=<n>: redis-py would read any other key as a connection setting).",
    )
    username: str = Field(
        "", max_length=256, description="Redis ACL user the engines log in as (empty: the default user)."
    )
    ca_secret_ref: SecretKeyRef | None = Field(
        None, description="Secret key with the CA certificate that verifies a rediss:// server (empty: system CAs)."
    )

    password_secret_ref: SecretKeyRef | None = Field(
        None, description="Secret key holding the Redis password (reaches the engine only as env)."
    )
    cluster: bool = Field(
        False,
        description="A Redis Cluster: url names one node (a seed; the client discovers the others and "
        "spreads keys over the slot owners). Needs a redis:// or rediss:// url without a database other "
        "than 0. The engines' user needs +cluster|slots +command besides the tier's commands.",
    )

    model_config = ConfigDict(json_schema_extra=_rules(
        ("!has(self.caSecretRef) || self.url.startsWith('rediss://')", "caSecretRef needs a rediss:// url",
         ".caSecretRef"),
        (f"!self.cluster || self.url.matches('{CLUSTER_URL_PATTERN}')", _CLUSTER_URL_MESSAGE, ".url")))

    @model_validator(mode="after")
    def _ca_needs_tls(self) -> ExternalRedis:
        if self.ca_secret_ref is not None and not self.url.startswith("rediss://"):
            raise ValueError("caSecretRef needs a rediss:// url")
        if self.cluster and not re.fullmatch(CLUSTER_URL_PATTERN, self.url):
            raise ValueError(_CLUSTER_URL_MESSAGE)
        return self


_ONE_OF_BACKEND = "[has(self.managed), has(self.external)].filter(x, x).size() == 1"
_ONE_OF_BACKEND_MESSAGE = "exactly one of managed, external must be set"


class _Backend(_Model):
    """A backend tier run by the operator (`managed`) or brought by the user (`external`)."""

    model_config = ConfigDict(json_schema_extra=_rules((_ONE_OF_BACKEND, _ONE_OF_BACKEND_MESSAGE, None)))

    @model_validator(mode="after")
    def _one_of(self) -> _Backend:
        # both fields are declared by each subclass (their types differ)
        if (getattr(self, "managed") is None) == (getattr(self, "external") is None):  # noqa: B009
            raise ValueError(_ONE_OF_BACKEND_MESSAGE)
        return self


class RedisTier(_Backend):
    managed: ManagedRedis | None = Field(None, description="A Redis StatefulSet run by the operator.")
    external: ExternalRedis | None = Field(None, description="An existing Redis.")


class ManagedS3(_Model):
    storage: Size = Field(description="Size of MinIO's persistent volume; the bucket's quota is 90% of it.")
    expire_days: int = Field(
        1, ge=1, le=3650,
        description="Objects expire this many days after their write (a lifecycle rule), so the bucket "
        "frees space on its own; writes beyond the quota are refused meanwhile.",
    )
    tls: TlsSecret | None = Field(None, description="Serve TLS only (engines verify it with the Secret's ca.crt).")
    storage_class_name: str = Field("", description="StorageClass of MinIO's volume (empty: cluster default).")
    image: str = Field("", max_length=1024, pattern=OPTIONAL_IMAGE_PATTERN,
                       description="MinIO image, by tag or digest (empty: the operator's default).")


class S3CredentialsRef(_Model):
    name: str = Field(min_length=1, max_length=253, description="Secret with the S3 access key pair.")
    access_key_key: str = Field("accessKey", description="Key of the access key id in the Secret.")
    secret_key_key: str = Field("secretKey", description="Key of the secret access key in the Secret.")


class ExternalS3(_Model):
    endpoint: S3Endpoint = Field(
        min_length=1,
        max_length=2048,
        pattern=r"^https?://",
        description="S3 endpoint URL: host, port and path only (no credentials, no query, no fragment).",
    )
    bucket: str = Field(min_length=3, max_length=63, description="Bucket for KV objects.")
    region: str = Field("us-east-1", description="S3 region.")
    prefix: str = Field("", description="Key prefix inside the bucket.")
    path_style: bool = Field(False, description="Path-style addressing (MinIO, Ceph); AWS uses virtual hosts.")
    credentials_secret_ref: S3CredentialsRef | None = Field(
        None, description="Secret with the access key pair (empty: the pod's own identity, e.g. IRSA)."
    )
    ca_secret_ref: SecretKeyRef | None = Field(
        None, description="Secret key with the CA certificate that verifies an https:// endpoint (empty: system CAs)."
    )


class S3Tier(_Backend):
    managed: ManagedS3 | None = Field(None, description="A MinIO StatefulSet run by the operator.")
    external: ExternalS3 | None = Field(None, description="An existing S3-compatible store.")


class Tiers(_Model):
    cpu: CpuTier | None = Field(None, description="Host-memory tier (required in native mode).")
    disk: DiskTier | None = Field(None, description="Local disk / NVMe tier.")
    redis: RedisTier | None = Field(None, description="Redis tier shared by all replicas.")
    s3: S3Tier | None = Field(None, description="S3 / MinIO tier shared by all replicas and pools.")

    model_config = ConfigDict(
        json_schema_extra=_rules(
            (
                "has(self.cpu) || has(self.disk) || has(self.redis) || has(self.s3)",
                "at least one tier is required",
                None,
            )
        )
    )

    @model_validator(mode="after")
    def _any(self) -> Tiers:
        if not (self.cpu or self.disk or self.redis or self.s3):
            raise ValueError("at least one tier is required")
        return self


class NativeOptions(_Model):
    offload_worker: Literal["auto", "kvpool", "vllm"] = Field(
        "auto",
        description="Who moves blocks between the paged KV cache and the host tier. auto: vLLM's "
        "OffloadingConnector loads kvpool's KVPoolOffloadingSpec (vLLM's TieringOffloadingSpec: vLLM's "
        "scheduler, eviction and secondary tiers), whose worker is kvpool's torch-copy worker on vLLM's "
        "CPU platform (where vLLM's own refuses to run) and vLLM's own on CUDA/XPU; needs the kvpool "
        "connector image. kvpool: the torch-copy worker always (CPU nodes only). vllm: vLLM's stock "
        "spec (CPUOffloadingSpec, or TieringOffloadingSpec with secondary tiers), GPU nodes only; a cpu "
        "tier alone (or with vLLM's fs disk tier, kvpoolSecondaryTier=false) then runs on a plain vLLM image.",
    )
    kvpool_secondary_tier: bool = Field(
        True,
        description="In native mode, reach disk, Redis and S3 through kvpool's secondary tier for vLLM's "
        "TieringOffloadingSpec (needs the kvpool connector image): every object authenticated with the pool key. "
        "False: native mode takes cpu and a disk tier on a per-pod volume (emptyDir, ephemeral) only, held by "
        "vLLM's own fs tier, which neither authenticates nor encrypts its files.",
    )


class Scheduling(_Model):
    node_selector: dict[str, str] = Field(default_factory=dict, description="Engine pod nodeSelector.")
    tolerations: list[K8sObject] = Field(default_factory=list, description="core/v1 Tolerations for engine pods.")
    affinity: K8sObject = Field(default_factory=dict, description="core/v1 Affinity for engine pods.")


class ServiceSpec(_Model):
    type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = Field("ClusterIP", description="Service type.")
    port: int = Field(8000, ge=1, le=65535, description="Service port of the OpenAI-compatible API.")
    api_key_secret_ref: SecretKeyRef | None = Field(
        None,
        description="Secret key holding the API key clients must send (Authorization: Bearer); reaches vLLM "
        "as VLLM_API_KEY by secretKeyRef. Empty: the API is open to whoever reaches the port.",
    )


class ApiIngress(_Model):
    enabled: bool = Field(
        False, description="Create the NetworkPolicy <name>-engines: only `from` reaches the engines' OpenAI "
        "port (which also serves /metrics)."
    )
    from_: list[K8sObject] = Field(
        default_factory=list, alias="from",
        description="core/v1 NetworkPolicyPeer list allowed in; empty: pods of the pool's namespace.",
    )


class KeysSecretRef(_Model):
    name: str = Field(
        min_length=1, max_length=253,
        description="Secret in the pool's namespace with poolKey (>= 32 characters), hashSeed (a decimal "
        "in [0, 4294967295]) and, during a rotation, previousPoolKey.",
    )


class SecuritySpec(_Model):
    keys_secret_ref: KeysSecretRef | None = Field(
        None,
        description="Bring your own pool keys; empty: the operator generates the Secret <name>-kvpool-keys "
        "once (random pool key and hash seed) and never rewrites it.",
    )
    encryption: bool = Field(
        False,
        description="Encrypt objects in the shared tiers (disk, Redis, S3) with AES-256-GCM under the pool "
        "key; they are authenticated (MAC) either way.",
    )
    require_cache_salt: bool = Field(
        False,
        description="Requests without vLLM's cache_salt are neither looked up nor saved (tenant isolation; "
        "tiered mode).",
    )


class NetworkPolicySpec(_Model):
    enabled: bool = Field(
        True, description="Create a NetworkPolicy so only this pool's engine pods reach its managed Redis/MinIO."
    )
    api_ingress: ApiIngress = Field(
        default_factory=ApiIngress, description="Who may reach the engines' OpenAI port (off by default)."
    )


ROUTER_POLICIES = ("cache_aware", "consistent_hash", "power_of_two", "round_robin")


class RouterSpec(_Model):
    """vllm-router (the vLLM project's Rust router) in front of the engines, found by Kubernetes
    service discovery of this pool's engine pods."""

    policy: Literal[ROUTER_POLICIES] = Field(  # type: ignore[valid-type]
        "cache_aware",
        description="cache_aware: an approximate prefix tree per router replica (a prompt matching an "
        "engine's tree above cacheThreshold goes there, else to the least loaded; the engines then run "
        "--enable-scale-out, the router tokenizes through their render endpoint); consistent_hash: sticky "
        "by the x-session-id header (or the request's `user`); power_of_two: the less loaded of two random "
        "engines; round_robin.",
    )
    replicas: int = Field(
        1, ge=0, le=16,
        description="Router replicas. cache_aware learns its tree per replica, so more than one splits what "
        "it knows about a conversation; consistent_hash is stateless and scales out.",
    )
    image: str = Field(
        "", max_length=1024, pattern=OPTIONAL_IMAGE_PATTERN,
        description="Router image (Dockerfile target `router`), by tag or digest. Empty: the operator's "
        "routerImage setting.",
    )
    cache_threshold: float | None = Field(
        None, ge=0, le=1,
        description="cache_aware: the prefix match ratio above which a request follows the cache "
        "(--cache-threshold; router default 0.3).",
    )
    balance_abs_threshold: int | None = Field(
        None, ge=0, le=1_000_000,
        description="cache_aware: the load gap (requests) beyond which routing balances load instead "
        "(--balance-abs-threshold; router default 64).",
    )
    balance_rel_threshold: float | None = Field(
        None, ge=1, le=1000,
        description="cache_aware: the load ratio beyond which routing balances load instead "
        "(--balance-rel-threshold; router default 1.5).",
    )
    resources: K8sObject = Field(
        default_factory=dict,
        description="core/v1 ResourceRequirements of the router container, merged over the operator's "
        "(requests cpu 250m, memory 256Mi; limits cpu 2, memory 1Gi).",
    )


_PICKER_PORT_RULE = ("self.kind != 'Service' || has(self.port)",
                     "port is required when kind is 'Service' or unspecified (defaults to 'Service')")


class PortNumber(_Model):
    number: int = Field(ge=1, le=65535, description="Port number.")


class EndpointPickerRef(_Model):
    """inference.networking.k8s.io/v1 EndpointPickerRef (the same fields, defaults and rules)."""

    group: str = Field(
        "", max_length=253, pattern=r"^$|^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$",
        description="API group of the endpoint picker object; empty: the core group.",
    )
    kind: str = Field(
        "Service", min_length=1, max_length=63, pattern=r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$",
        description="Kind of the endpoint picker object (never an ExternalName Service).",
    )
    name: str = Field(min_length=1, max_length=253, description="Name of the endpoint picker object.")
    port: PortNumber | None = Field(
        None, description="Port of the endpoint picker Service (its service port, required for a Service)."
    )
    failure_mode: Literal["FailOpen", "FailClose"] = Field(
        "FailClose",
        description="When the picker does not answer: FailClose drops the request, FailOpen lets the "
        "Gateway pick an engine itself.",
    )

    model_config = ConfigDict(json_schema_extra=_rules((*_PICKER_PORT_RULE, None)))

    @model_validator(mode="after")
    def _port_for_service(self) -> EndpointPickerRef:
        if self.kind == "Service" and self.port is None:
            raise ValueError(_PICKER_PORT_RULE[1])
        return self


class InferencePoolSpec(_Model):
    """Gateway API Inference Extension: an InferencePool selecting this pool's engines."""

    enabled: bool = Field(
        False,
        description="Render the InferencePool <name> (inference.networking.k8s.io/v1): the engines' pods "
        "and port for a Gateway that runs the inference extension. Needs its CRD in the cluster and the "
        "operator setting inferencePools.",
    )
    endpoint_picker_ref: EndpointPickerRef | None = Field(
        None,
        description="The endpoint picker (EPP) the Gateway asks for an engine. InferencePool releases "
        "v1.0-v1.5 require it; v1.6 made it optional.",
    )


ENGINE_PORT = 8000  # the engines' container port (OpenAI API and /metrics)
_KV_EVENTS_PORT_MESSAGE = f"port must differ from the engines' API port {ENGINE_PORT}"


class KvEventsSpec(_Model):
    enabled: bool = Field(
        False,
        description="Engines publish vLLM's KV cache events over ZMQ (--kv-events-config, topic "
        "kv@<pod name>), the connector adds its CPU and disk tier events: for precise external routers "
        "(an endpoint picker). The events carry token ids of the prompts: subscribers read prompts.",
    )
    port: int = Field(5557, ge=1024, le=65535, description="Container port `kv-events` of the ZMQ publisher.")
    from_: list[K8sObject] = Field(
        default_factory=list, alias="from",
        description="core/v1 NetworkPolicyPeer list that may subscribe (NetworkPolicy <name>-engines, "
        "with networkPolicy.enabled); empty: pods of the pool's namespace.",
    )

    model_config = ConfigDict(json_schema_extra=_rules(
        (f"self.port != {ENGINE_PORT}", _KV_EVENTS_PORT_MESSAGE, ".port")))

    @model_validator(mode="after")
    def _own_port(self) -> KvEventsSpec:
        if self.port == ENGINE_PORT:
            raise ValueError(_KV_EVENTS_PORT_MESSAGE)
        return self


ENABLE_LORA_PATTERN = "^--enable[-_]lora(=.*)?$"  # vLLM reads `_` as `-`; the engine refuses any other spelling
_SHARED_TIER_RULE = ("has(self.tiers.redis) || has(self.tiers.s3) || "
                     "(has(self.tiers.disk) && has(self.tiers.disk.volume.persistentVolumeClaim))")
_SHARED_TIERS = "tiers.redis, tiers.s3 or tiers.disk on a persistentVolumeClaim"
_PREFILL_RULES = (
    (
        f"!has(self.prefill) || self.connector == 'native' || {_SHARED_TIER_RULE}",
        f"needs a tier both roles reach ({_SHARED_TIERS}): the prefill engine hands its KV to the decode "
        "engine through it; a cpu tier, a hostPath (per node) or a per-pod disk is not shared",
        ".prefill",
    ),
    (
        "!has(self.prefill) || self.connector != 'native' || "
        f"(self.native.kvpoolSecondaryTier && ({_SHARED_TIER_RULE}))",
        f"in native mode needs a shared tier through kvpool's secondary tier (native.kvpoolSecondaryTier=true "
        f"and {_SHARED_TIERS}): the prefill engine hands its KV to the decode engine through it",
        ".prefill",
    ),
    (
        "!has(self.prefill) || has(self.router)",
        "needs router: the router sends each request to a prefill engine, then to a decode engine",
        ".prefill",
    ),
)


# Autoscaling (render/autoscaling.py): one model, shaped so that each engine role can carry its own.
AUTOSCALING_RANGE_MESSAGE = "minReplicas must not exceed maxReplicas"
TRIGGER_MESSAGE = ("at least one trigger is required (waitingRequests, kvCacheUsage, promptTokensComputed, "
                   "routerRequests)")
RATE_WINDOW_PATTERN = r"^[1-9][0-9]{0,3}[smh]$"


def scale_to_zero_rule(path: str) -> tuple[str, str, str]:
    """The spec-level rule for an Autoscaling at `path` (`autoscaling`, `prefill.autoscaling`): zero
    engines only where a shared tier keeps the cache for the next ones."""
    parts = path.split(".")
    absent = " || ".join(f"!has(self.{'.'.join(parts[:n])})" for n in range(1, len(parts) + 1))
    return (f"{absent} || self.{path}.minReplicas > 0 || has(self.tiers.redis) || has(self.tiers.s3)",
            f"{path}.minReplicas 0 (scale to zero) needs a shared tier (tiers.redis or tiers.s3) that keeps "
            "the cache while no engine runs", f".{path}.minReplicas")


ROUTER_TRIGGER_MESSAGE = "triggers.routerRequests needs spec.router (the router counts the requests)"


def router_trigger_rule(path: str) -> tuple[str, str, str]:
    """The spec-level rule for the router trigger of an Autoscaling at `path`."""
    parts = path.split(".")
    absent = " || ".join(f"!has(self.{'.'.join(parts[:n])})" for n in range(1, len(parts) + 1))
    return (f"{absent} || !has(self.{path}.triggers.routerRequests) || has(self.router)",
            ROUTER_TRIGGER_MESSAGE, f".{path}.triggers.routerRequests")


class ScalingTriggers(_Model):
    """Per-engine targets (to the thousandth: HPA targets are quantities); the autoscaler picks the
    smallest replica count that keeps every trigger set at or under its target (the largest of
    their proposals)."""

    waiting_requests: float | None = Field(
        None, ge=0.001, le=100_000,
        description="Average vllm:num_requests_waiting per engine (requests queued, not yet scheduled). Starting "
        "point 3: llm-d's saturation detector and WVA count an engine saturated at 5 waiting, WVA scales up "
        "when fewer than 3 of those are spare.",
    )
    kv_cache_usage: float | None = Field(
        None, ge=0.001, le=1,
        description="Average vllm:kv_cache_usage_perc per engine (0-1, the paged KV cache in use). Starting point "
        "0.7: WVA's kvCacheThreshold 0.8 less its kvSpareTrigger 0.1.",
    )
    prompt_tokens_computed: float | None = Field(
        None, ge=0.001, le=1_000_000_000,
        description="Prompt tokens per second per engine that neither vLLM's prefix cache nor any kvpool tier "
        "served (rate of kvpool_prompt_tokens_computed_total; native mode: of vllm:prompt_tokens_by_source_total"
        "{source=\"local_compute\"}): the prefill work left, so tier hits count as capacity. Start near half "
        "the prefill throughput one engine sustains.",
    )
    router_requests: float | None = Field(
        None, ge=0.001, le=100_000,
        description="Requests per second per engine arriving at the pool's router (rate of "
        "vllm_router_requests_total plus its no_available_workers errors; needs spec.router). The one "
        "trigger that still reads while no engine runs: with KEDA and minReplicas 0, the first request "
        "wakes the pool (it fails or waits for the router's retries until an engine is ready).",
    )

    model_config = ConfigDict(json_schema_extra=_rules(
        ("has(self.waitingRequests) || has(self.kvCacheUsage) || has(self.promptTokensComputed) || "
         "has(self.routerRequests)", TRIGGER_MESSAGE, None)))

    @model_validator(mode="after")
    def _any(self) -> ScalingTriggers:
        if all(getattr(self, name) is None for name in (
                "waiting_requests", "kv_cache_usage", "prompt_tokens_computed", "router_requests")):
            raise ValueError(TRIGGER_MESSAGE)
        return self


class Autoscaling(_Model):
    """A horizontal autoscaler of a Deployment of engines: a KEDA ScaledObject where the operator's
    setting `keda` says KEDA is installed, else an autoscaling/v2 HorizontalPodAutoscaler on Pods
    metrics (served by prometheus-adapter). The operator then leaves the Deployment's replicas to it."""

    min_replicas: int = Field(
        1, ge=0, le=1000,
        description="Fewest engines. 0 (scale to zero) needs KEDA (the operator setting keda) and a shared tier "
        "(redis or s3) that keeps the cache meanwhile.",
    )
    max_replicas: int = Field(ge=1, le=1000, description="Most engines.")
    triggers: ScalingTriggers = Field(description="What to scale on: per-engine targets, at least one.")
    rate_window: str = Field(
        "2m", pattern=RATE_WINDOW_PATTERN,
        description="Prometheus range of the rate() of promptTokensComputed: at least four scrape intervals.",
    )
    scale_down_stabilization_seconds: int = Field(
        300, ge=0, le=3600,
        description="Scale down only to the highest recommendation of this many seconds (an engine that goes "
        "takes its CPU and disk tiers with it; a new one loads the model again).",
    )

    model_config = ConfigDict(json_schema_extra=_rules(
        ("self.minReplicas <= self.maxReplicas", AUTOSCALING_RANGE_MESSAGE, ".minReplicas")))

    @model_validator(mode="after")
    def _range(self) -> Autoscaling:
        if self.min_replicas > self.max_replicas:
            raise ValueError(AUTOSCALING_RANGE_MESSAGE)
        return self


class PrefillSpec(_Model):
    """Prefill/decode disaggregation: a second Deployment of the same engine (same image, model,
    connector config, tiers and pool key) that only prefills. The router sends each request to a
    prefill engine first, which stores the prompt's KV in the pool and hands it over in
    kv_transfer_params; the decode engine (the pool's own Deployment) loads it from a shared tier."""

    replicas: int = Field(1, ge=1, le=1000, description="Prefill engine replicas (Deployment <name>-prefill).")
    resources: K8sObject = Field(
        default_factory=dict,
        description="core/v1 ResourceRequirements of the prefill engines, merged over the decode engines' "
        "(model.resources over the operator's).",
    )
    extra_args: list[Annotated[str, Field(max_length=4096)]] = Field(
        default_factory=list, max_length=256,
        description="Extra `vllm serve` arguments of the prefill engines, appended after model.extraArgs "
        "(the last of a repeated flag wins), for example a larger --max-num-batched-tokens.",
    )
    autoscaling: Autoscaling | None = Field(
        None,
        description="Scale the prefill engines on their own triggers, as spec.autoscaling scales the decode "
        "engines (each role's queries read only its own engines). Absent: prefill.replicas is the count.",
    )

    model_config = ConfigDict(json_schema_extra=_rules((_SECRET_ARGS_RULE, _SECRET_ARGS_MESSAGE, ".extraArgs")))

    @model_validator(mode="after")
    def _no_secret_args(self) -> PrefillSpec:
        if any(secret_arg(arg) for arg in self.extra_args):
            raise ValueError(_SECRET_ARGS_MESSAGE)
        return self

WARM_START_MESSAGE = (f"warmStart needs connector: tiered, tiers.cpu and a shared tier ({_SHARED_TIERS}): a "
                      "starting engine loads the pool's hot set from the shared tier into its cpu tier")


class WarmStart(_Model):
    """Warm start: engines count which chunks their requests reuse into the pool's hot set, one sealed
    manifest in the shared tier; a starting engine loads the top of it into its cpu tier before it
    reports ready (docs/scaling.md, Warm start)."""

    max_bytes: Size = Field(
        "4Gi",
        description="Bytes a starting engine loads at most, per pod (split across tensor-parallel ranks); also at "
        "most half the cpu tier.",
    )
    max_seconds: int = Field(
        30, ge=0, le=600,
        description="How long engine start waits for the pre-warm before the engine reports ready; the rest loads "
        "in the background. The startup probe allows this much longer.",
    )
    top_k: int = Field(4096, ge=1, le=1 << 20, description="Chunks the pool's hot set keeps, most hit first.")
    refresh_seconds: int = Field(
        60, ge=1, le=86400, description="How often each engine merges its hits into the hot set manifest."
    )


_SPEC_RULES = (
    (
        "self.connector != 'native' || has(self.tiers.cpu)",
        "native mode needs tiers.cpu (vLLM's OffloadingConnector always has a CPU tier)",
        ".tiers",
    ),
    (
        "self.connector != 'native' || self.native.kvpoolSecondaryTier || "
        "(!has(self.tiers.redis) && !has(self.tiers.s3))",
        "native mode reaches Redis/S3 only through the kvpool secondary tier: set "
        "native.kvpoolSecondaryTier=true or remove tiers.redis and tiers.s3",
        ".tiers",
    ),
    (
        "self.connector != 'native' || self.native.kvpoolSecondaryTier || !has(self.tiers.disk) || "
        "has(self.tiers.disk.volume.emptyDir) || has(self.tiers.disk.volume.ephemeral)",
        "native mode without the kvpool secondary tier keeps the disk tier in vLLM's fs tier, which neither "
        "authenticates nor checks the files it loads: only a per-pod volume (emptyDir, ephemeral) may hold it; "
        "set native.kvpoolSecondaryTier=true for hostPath or persistentVolumeClaim",
        ".tiers.disk",
    ),
    (
        "self.connector != 'native' || self.native.kvpoolSecondaryTier || !has(self.tiers.disk) || "
        "!self.security.encryption",
        "security.encryption: vLLM's fs tier (native mode with native.kvpoolSecondaryTier=false) writes the disk "
        "tier in plaintext; set native.kvpoolSecondaryTier=true",
        ".security.encryption",
    ),
    ("self.chunkTokens % 16 == 0", "chunkTokens must be a multiple of 16 (vLLM's block size)", ".chunkTokens"),
    (
        "self.connector == 'tiered' || !self.security.requireCacheSalt",
        "security.requireCacheSalt needs connector: tiered (vLLM's native offloading cannot refuse "
        "unsalted requests)",
        ".security.requireCacheSalt",
    ),
    scale_to_zero_rule("autoscaling"),
    scale_to_zero_rule("prefill.autoscaling"),
    router_trigger_rule("autoscaling"),
    router_trigger_rule("prefill.autoscaling"),
    (
        f"!has(self.warmStart) || (self.connector == 'tiered' && has(self.tiers.cpu) && ({_SHARED_TIER_RULE}))",
        WARM_START_MESSAGE,
        ".warmStart",
    ),
    (
        "self.connector != 'native' || !self.native.kvpoolSecondaryTier || "
        "!(has(self.tiers.disk) || has(self.tiers.redis) || has(self.tiers.s3)) || "
        f"!has(self.model.extraArgs) || !self.model.extraArgs.exists(a, a.matches('{ENABLE_LORA_PATTERN}'))",
        "native mode's kvpool secondary tier cannot tell LoRA adapter versions apart (its keys name an "
        "adapter by name and path, not its weights) and refuses --enable-lora: use connector: tiered, or "
        "no disk, redis or s3 tier",
        ".model.extraArgs",
    ),
)


class KVCachePoolSpec(_Model):
    """Desired state: a vLLM fleet with KV offloading tiers and their backends."""

    replicas: int = Field(
        1, ge=0, le=1000,
        description="Engine replicas (scale subresource); ignored with autoscaling, whose autoscaler sets them.",
    )
    model: ModelSpec = Field(description="The model and engine container.")
    connector: Literal["tiered", "native"] = Field(
        "tiered",
        description="tiered: kvpool's KVPoolConnector with all tiers; native: vLLM's OffloadingConnector "
        "(its cpu tier; disk, Redis and S3 through the kvpool secondary tier, sealed with the pool key).",
    )
    chunk_tokens: int = Field(256, ge=16, le=65536, description="Tokens per stored KV chunk (multiple of 16).")
    save_decode: bool = Field(
        True,
        description="tiered: also store the KV of generated tokens (a chat's next turn includes the answer; "
        "requests may opt out with kv_transfer_params {\"kvpool\": {\"save_decode\": false}}). Turn off "
        "for reasoning models whose chat template strips earlier <think> text: the next turn never "
        "repeats those tokens, so their KV is never hit.",
    )
    lookup_wait_ms: float | None = Field(
        None, ge=0, le=1000,
        description="tiered: how long an engine's scheduler waits, inside its step, for a lookup in the shared "
        "tiers (Redis, S3) before the request is told to ask again next step, which costs it a step; one step "
        "waits twice this at most, and nobody waits while recent lookups took longer (unset: the connector's "
        "5 ms, a LAN round trip). Raise it to the Redis round trip when that is longer (another zone); "
        "kvpool_lookups_deferred_total counts the lookups it missed.",
    )
    tiers: Tiers = Field(description="Offloading tiers, fastest first.")
    native: NativeOptions = Field(default_factory=NativeOptions, description="Options of native mode.")
    scheduling: Scheduling = Field(default_factory=Scheduling, description="Engine pod placement.")
    service: ServiceSpec = Field(default_factory=ServiceSpec, description="The OpenAI API Service.")
    network_policy: NetworkPolicySpec = Field(
        default_factory=NetworkPolicySpec, description="NetworkPolicy for managed backends."
    )
    security: SecuritySpec = Field(
        default_factory=SecuritySpec, description="Pool keys, hash seed, encryption and tenant isolation."
    )
    router: RouterSpec | None = Field(
        None,
        description="A router Deployment + Service <name>-router in front of the engines; status.endpoints."
        "openai then names it and the engines' Service is ClusterIP. Absent: clients reach the engines' "
        "Service directly.",
    )
    inference_pool: InferencePoolSpec | None = Field(
        None, description="An InferencePool for the Gateway API Inference Extension."
    )
    kv_events: KvEventsSpec | None = Field(None, description="vLLM KV cache events for external routers.")
    prefill: PrefillSpec | None = Field(
        None,
        description="Prefill/decode disaggregation: a prefill Deployment <name>-prefill beside the engines, "
        "which then decode (pod labels llm-d.ai/role: prefill and decode); the router runs in P/D mode. "
        "Needs spec.router and a tier both roles reach (Redis, S3, or a disk on a shared claim).",
    )
    autoscaling: Autoscaling | None = Field(
        None,
        description="Scale the engines between minReplicas and maxReplicas on queue depth, KV cache usage and "
        "the prefill work tiers do not save (docs/scaling.md). Absent: replicas is the engine count.",
    )
    warm_start: WarmStart | None = Field(
        None,
        description="Pre-warm each starting engine's cpu tier from the pool's hot set in the shared tier before "
        "it reports ready (tiered connector; needs tiers.cpu and a shared tier). Absent: engines start cold.",
    )

    model_config = ConfigDict(json_schema_extra=_rules(*_SPEC_RULES, *_PREFILL_RULES))

    @model_validator(mode="after")
    def _cross_field(self) -> KVCachePoolSpec:
        if self.connector == "native" and self.tiers.cpu is None:
            raise ValueError(_SPEC_RULES[0][1])
        if (
            self.connector == "native"
            and not self.native.kvpool_secondary_tier
            and (self.tiers.redis or self.tiers.s3)
        ):
            raise ValueError(_SPEC_RULES[1][1])
        vllm_fs_disk = self.connector == "native" and not self.native.kvpool_secondary_tier and self.tiers.disk
        disk = self.tiers.disk
        if vllm_fs_disk and disk is not None and disk.volume.kind not in ("empty_dir", "ephemeral"):
            raise ValueError(_SPEC_RULES[2][1])
        if vllm_fs_disk and self.security.encryption:
            raise ValueError(_SPEC_RULES[3][1])
        if self.chunk_tokens % 16:
            raise ValueError(_SPEC_RULES[4][1])
        if self.connector != "tiered" and self.security.require_cache_salt:
            raise ValueError(_SPEC_RULES[5][1])
        for n, scaling in ((6, self.autoscaling), (7, self.prefill.autoscaling if self.prefill else None)):
            if scaling is not None and scaling.min_replicas == 0 and not (self.tiers.redis or self.tiers.s3):
                raise ValueError(_SPEC_RULES[n][1])
        for n, scaling in ((8, self.autoscaling), (9, self.prefill.autoscaling if self.prefill else None)):
            if scaling is not None and scaling.triggers.router_requests is not None and self.router is None:
                raise ValueError(_SPEC_RULES[n][1])
        if self.warm_start is not None:
            disk = self.tiers.disk
            shared = bool(self.tiers.redis or self.tiers.s3
                          or (disk is not None and disk.volume.persistent_volume_claim is not None))
            if self.connector != "tiered" or self.tiers.cpu is None or not shared:
                raise ValueError(_SPEC_RULES[10][1])
        if (self.connector == "native" and self.native.kvpool_secondary_tier
                and (self.tiers.disk or self.tiers.redis or self.tiers.s3)
                and any(re.match(ENABLE_LORA_PATTERN, a, flags=re.DOTALL) for a in self.model.extra_args)):
            raise ValueError(_SPEC_RULES[11][1])
        return self

    @field_validator("prefill")
    @classmethod
    def _prefill(cls, prefill: PrefillSpec | None, info: ValidationInfo) -> PrefillSpec | None:
        """The CEL rules of _PREFILL_RULES, in their order; a field validator, so that the error is
        located at spec.prefill as the API server's (fieldPath .prefill). The fields it reads are
        declared before prefill; one that failed its own validation is reported by itself."""
        if prefill is None or not {"tiers", "connector", "native", "router"} <= info.data.keys():
            return prefill
        tiers: Tiers = info.data["tiers"]
        shared_disk = tiers.disk is not None and tiers.disk.volume.persistent_volume_claim is not None
        shared = bool(tiers.redis or tiers.s3 or shared_disk)
        native = info.data["connector"] == "native"
        if not native and not shared:
            raise ValueError(_PREFILL_RULES[0][1])
        if native and not (info.data["native"].kvpool_secondary_tier and shared):
            raise ValueError(_PREFILL_RULES[1][1])
        if info.data["router"] is None:
            raise ValueError(_PREFILL_RULES[2][1])
        return prefill


class Condition(_Model):
    """metav1.Condition."""

    type: str = Field(description="Condition type, e.g. Ready.")
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    observed_generation: int | None = Field(None, description="Generation this condition was computed for.")
    last_transition_time: str = Field(description="When status last changed (RFC 3339).")
    reason: str = Field(description="CamelCase machine-readable reason.")
    message: str = Field("", description="Human-readable details.")


class Endpoints(_Model):
    openai: str = Field("", description="In-cluster URL of the OpenAI-compatible API (the router when there is one).")
    engines: str = Field(
        "", description="In-cluster URL of the engines' Service (behind the router when there is one)."
    )
    redis: str = Field("", description="Redis URL used by the engines (no credentials, no query).")
    s3: str = Field("", description="S3 endpoint used by the engines (no credentials, no query).")


class RoleStatus(_Model):
    desired_replicas: int = Field(0, description="Engines of this role wanted now (its replicas, or its "
                                  "autoscaler's choice).")
    replicas: int = Field(0, description="Pods of this role.")
    ready_replicas: int = Field(0, description="Pods of this role passing readiness.")
    endpoint: str = Field("", description="In-cluster URL of this role's Service.")


class Roles(_Model):
    """Prefill/decode disaggregation (spec.prefill): each role's engines."""

    prefill: RoleStatus = Field(description="The prefill engines (Deployment and Service <name>-prefill).")
    decode: RoleStatus = Field(description="The decode engines (Deployment and Service <name>).")


class KVCachePoolStatus(_Model):
    """Observed state, kstatus compatible (observedGeneration + Ready/Reconciling/Stalled)."""

    observed_generation: int | None = Field(None, description="metadata.generation last reconciled.")
    phase: Literal["Pending", "Progressing", "Ready", "Degraded", "Invalid"] | None = Field(
        None, description="Summary: Pending, Progressing, Ready, Degraded or Invalid."
    )
    replicas: int | None = Field(None, description="Engine pods (scale subresource).")
    desired_replicas: int | None = Field(
        None, description="Engines wanted now: spec.replicas, or the autoscaler's choice with spec.autoscaling."
    )
    ready_replicas: int | None = Field(None, description="Engine pods passing readiness.")
    selector: str | None = Field(None, description="Label selector of engine pods (scale subresource).")
    conditions: list[Condition] = Field(default_factory=list, description="metav1.Conditions.")
    endpoints: Endpoints | None = Field(None, description="Where clients and engines reach the pool.")
    roles: Roles | None = Field(None, description="Per role, with spec.prefill: replicas, ready, endpoint.")


def parse_spec(spec: dict[str, Any]) -> KVCachePoolSpec:
    """Validate a pool's spec from the API (camelCase dict)."""
    return KVCachePoolSpec.model_validate(spec)


def format_error(exc: Exception) -> str:
    """One line per problem, each naming the field (`spec.tiers.cpu.size: must be a positive size`)."""
    errors = getattr(exc, "errors", None)
    if not callable(errors):
        return str(exc)
    lines = []
    for err in errors():
        loc = ".".join(str(p) for p in ("spec", *err["loc"]))
        msg = err["msg"].removeprefix("Value error, ")
        lines.append(f"{loc}: {msg}")
    return "; ".join(lines)
