"""Run a built image the way a rendered pod spec runs it, with podman; inspect built images.

`run_args` turns a pod spec and one of its containers into `podman run` arguments: the user and
groups (runAsUser/runAsGroup/fsGroup, runAsNonRoot enforced), a read-only root filesystem with
nothing writable but the emptyDirs (podman's own tmpfs on /tmp, /run and /var/tmp is turned off),
dropped capabilities, no privilege escalation, the command and args, the env (values from Secrets
and the downward API are passed by name, never on a command line) and the volumes. Anything in a
security context it cannot reproduce is an error, never silently dropped. What a kubelet adds and
a smoke test must stand in for (a kubeconfig instead of the service account token, a model
directory) the caller adds explicitly.

`probe_runtime` finds the podman flags that start a container on this host: the default runtime
first; crun refuses hosts with hybrid cgroups ("drop all controllers from cgroupv2"), where runc
works, and a host whose hard limits are below podman's default ulimits needs lower ones.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Candidates tried in order by probe_runtime: (global podman flags, `podman run` flags).
MODEST_ULIMITS = ("--ulimit=nofile=16384:16384", "--ulimit=nproc=16384:16384")
RUNTIME_CANDIDATES: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...] = (
    ((), ()),
    (("--runtime=runc",), ()),
    (("--runtime=runc",), MODEST_ULIMITS),
)
POD_SECURITY_KEYS = {"runAsNonRoot", "runAsUser", "runAsGroup", "fsGroup", "fsGroupChangePolicy",
                     "supplementalGroups", "seccompProfile"}
CONTAINER_SECURITY_KEYS = {"runAsNonRoot", "runAsUser", "runAsGroup", "readOnlyRootFilesystem",
                           "allowPrivilegeEscalation", "capabilities", "seccompProfile"}


def podman_size(quantity: str) -> str:
    """A Kubernetes memory quantity in podman's notation: 64Mi -> 64m, 2Gi -> 2g, 1000 -> 1000."""
    m = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti)?", str(quantity))
    if m is None:
        raise Unsupported(f"sizeLimit {quantity}: only whole Ki/Mi/Gi/Ti or byte quantities are reproduced here")
    return m.group(1) + (m.group(2) or "")[:1].lower()


class Unsupported(ValueError):
    """A pod spec field that podman cannot reproduce here (named in the message)."""


@dataclass(frozen=True)
class Runtime:
    global_flags: tuple[str, ...] = ()
    run_flags: tuple[str, ...] = ()

    def podman(self, *args: str) -> list[str]:
        return ["podman", *self.global_flags, *args]

    def run(self, *args: str) -> list[str]:
        return self.podman("run", *self.run_flags, *args)

    def describe(self) -> str:
        flags = " ".join((*self.global_flags, *self.run_flags))
        return f"podman {flags}".strip() if flags else "podman (default runtime and limits)"


def probe_runtime(image: str) -> Runtime:
    """The first candidate that runs `true` in `image`; raises with every candidate's error."""
    errors = []
    for global_flags, run_flags in RUNTIME_CANDIDATES:
        rt = Runtime(global_flags, run_flags)
        proc = subprocess.run(rt.run("--rm", "--network=none", "--entrypoint=true", image),
                              capture_output=True, text=True, timeout=120)
        if proc.returncode == 0:
            return rt
        errors.append(f"{rt.describe()}: {proc.stderr.strip()[-300:]}")
    raise RuntimeError("no podman configuration starts a container here:\n" + "\n".join(errors))


@dataclass
class RunSpec:
    """`podman run` arguments (image included) and the environment podman itself must get (values
    passed by name: Secrets and downward-API fields never appear in an argv)."""

    args: list[str]
    env: dict[str, str] = field(default_factory=dict)


def _security(pod: Mapping[str, Any], container: Mapping[str, Any]) -> list[str]:
    pod_sc = dict(pod.get("securityContext") or {})
    ctr_sc = dict(container.get("securityContext") or {})
    for where, sc, known in (("pod", pod_sc, POD_SECURITY_KEYS), ("container", ctr_sc, CONTAINER_SECURITY_KEYS)):
        unknown = sorted(set(sc) - known)
        if unknown:
            raise Unsupported(f"{where} securityContext.{unknown[0]}: not reproduced by podman here")
    merged = {**pod_sc, **ctr_sc}
    out = []
    uid, gid = merged.get("runAsUser"), merged.get("runAsGroup")
    if merged.get("runAsNonRoot") and (uid is None or int(uid) == 0):
        raise Unsupported("securityContext.runAsNonRoot: needs a numeric non-root runAsUser to check here")
    if uid is not None:
        out.append(f"--user={uid}" + (f":{gid}" if gid is not None else ""))
    for group in [pod_sc.get("fsGroup"), *pod_sc.get("supplementalGroups", [])]:
        if group is not None:
            out.append(f"--group-add={group}")
    seccomp = (merged.get("seccompProfile") or {}).get("type", "RuntimeDefault")
    if seccomp == "Unconfined":
        out.append("--security-opt=seccomp=unconfined")
    elif seccomp != "RuntimeDefault":
        raise Unsupported(f"securityContext.seccompProfile.type {seccomp}: not reproduced by podman here")
    if ctr_sc.get("readOnlyRootFilesystem"):
        out += ["--read-only", "--read-only-tmpfs=false"]
    if ctr_sc.get("allowPrivilegeEscalation") is False:
        out.append("--security-opt=no-new-privileges")
    caps = ctr_sc.get("capabilities") or {}
    out += [f"--cap-drop={c.lower()}" for c in caps.get("drop", [])]
    out += [f"--cap-add={c.lower()}" for c in caps.get("add", [])]
    return out


def _env(container: Mapping[str, Any], resolved: Mapping[str, str]) -> tuple[list[str], dict[str, str]]:
    args, env = [], {}
    for item in container.get("env", []):
        name = item["name"]
        if "value" in item:
            args.append(f"--env={name}={item['value']}")
        elif name in resolved:
            args.append(f"--env={name}")  # podman takes the value from its own environment
            env[name] = resolved[name]
        elif (item.get("valueFrom", {}).get("secretKeyRef") or {}).get("optional"):
            continue  # an optional key the Secret lacks: the kubelet leaves the variable unset
        else:
            raise Unsupported(f"env {name}: valueFrom {json.dumps(item.get('valueFrom'))} has no value here")
    return args, env


def _mounts(pod: Mapping[str, Any], container: Mapping[str, Any], host_paths: Mapping[str, str]) -> list[str]:
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    out = []
    for mount in container.get("volumeMounts", []):
        volume = volumes[mount["name"]]
        path = mount["mountPath"]
        if "emptyDir" in volume and mount["name"] not in host_paths:
            size = (volume["emptyDir"] or {}).get("sizeLimit")
            if path == "/dev/shm":
                out.append(f"--shm-size={podman_size(size or '64Mi')}")
            else:
                out.append(f"--tmpfs={path}:rw,mode=1777" + (f",size={podman_size(size)}" if size else ""))
            continue
        if mount["name"] not in host_paths:
            kind = next(iter(set(volume) - {"name"}), "?")
            raise Unsupported(f"volume {mount['name']} ({kind}): needs a host directory here")
        src = Path(host_paths[mount["name"]]) / mount.get("subPath", "")
        src.mkdir(parents=True, exist_ok=True)
        out.append(f"--volume={src}:{path}" + (":ro" if mount.get("readOnly") else ""))
    return out


def expand(text: str, values: Mapping[str, str]) -> str:
    """The kubelet's $(VAR) expansion in command and args ($$ escapes; unknown names stay)."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else values.get(m.group(1), m.group(0)), text)


def run_args(pod: Mapping[str, Any], container_name: str, image: str, *,
             host_paths: Mapping[str, str] | None = None, resolved_env: Mapping[str, str] | None = None,
             publish: Mapping[int, int] | None = None) -> RunSpec:
    """The `podman run` arguments (from the security flags to the args after the image) that run
    `container_name` of `pod` from `image`. host_paths: a host directory per volume that is not
    an emptyDir; resolved_env: values of valueFrom env entries; publish: container port -> host
    port on 127.0.0.1."""
    container = next(c for c in pod["containers"] if c["name"] == container_name)
    args = _security(pod, container)
    env_args, env = _env(container, resolved_env or {})
    args += env_args
    args += _mounts(pod, container, host_paths or {})
    for port in container.get("ports", []):
        host_port = (publish or {}).get(port["containerPort"])
        if host_port is not None:
            args.append(f"--publish=127.0.0.1:{host_port}:{port['containerPort']}")
    if container.get("workingDir"):
        args.append(f"--workdir={container['workingDir']}")
    values = {**{e["name"]: e["value"] for e in container.get("env", []) if "value" in e}, **env}
    if container.get("command"):
        args.append(f"--entrypoint={json.dumps([expand(c, values) for c in container['command']])}")
    return RunSpec(args=[*args, image, *(expand(a, values) for a in container.get("args", []))], env=env)


def probe_url(container: Mapping[str, Any], probe: str, publish: Mapping[int, int]) -> str:
    """The host URL of a container's httpGet probe, through the published port."""
    get = container[probe]["httpGet"]
    port = get["port"]
    if isinstance(port, str):
        port = next(p["containerPort"] for p in container["ports"] if p["name"] == port)
    return f"http://127.0.0.1:{publish[port]}{get['path']}"


class Container:
    """A detached container: start, logs, IP address, stop (SIGTERM, then its exit code)."""

    def __init__(self, runtime: Runtime, name: str, spec: RunSpec, extra: list[str] | None = None):
        self.runtime, self.name, self.spec, self.extra = runtime, name, spec, list(extra or [])

    def start(self) -> Container:
        subprocess.run(self.runtime.podman("rm", "--force", "--ignore", self.name), capture_output=True)
        proc = subprocess.run(self.runtime.run("--detach", f"--name={self.name}", *self.extra, *self.spec.args),
                              capture_output=True, text=True, env={**os.environ, **self.spec.env}, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"podman run {self.name} failed: {proc.stderr.strip()}")
        return self

    def running(self) -> bool:
        out = subprocess.run(self.runtime.podman("inspect", "--format={{.State.Running}}", self.name),
                             capture_output=True, text=True)
        return out.stdout.strip() == "true"

    def logs(self, tail: int = 80) -> str:
        out = subprocess.run(self.runtime.podman("logs", f"--tail={tail}", self.name), capture_output=True, text=True)
        return out.stdout + out.stderr

    def ip(self) -> str:
        out = subprocess.run(self.runtime.podman("inspect", "--format={{.NetworkSettings.IPAddress}}", self.name),
                             capture_output=True, text=True, check=True)
        return out.stdout.strip()

    def stop(self, timeout: int = 30) -> int:
        """SIGTERM (SIGKILL after `timeout` s), then the exit code."""
        subprocess.run(self.runtime.podman("stop", f"--time={timeout}", self.name), capture_output=True)
        out = subprocess.run(self.runtime.podman("inspect", "--format={{.State.ExitCode}}", self.name),
                             capture_output=True, text=True)
        return int(out.stdout.strip() or -1)

    def remove(self) -> None:
        subprocess.run(self.runtime.podman("rm", "--force", "--ignore", self.name), capture_output=True)


def wait_http(url: str, container: Container, timeout: float, ok=lambda status, body: status == 200) -> bytes:
    """Poll `url` until `ok(status, body)`; raises with the container's log tail when it exits or
    the time is up."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                body = resp.read()
                if ok(resp.status, body):
                    return body
                last = f"HTTP {resp.status}"
        except urllib.error.HTTPError as exc:
            last = f"HTTP {exc.code}"
        except OSError as exc:
            last = str(exc)
        if not container.running():
            raise RuntimeError(f"{container.name} exited before {url} answered; log tail:\n{container.logs()}")
        time.sleep(1)
    raise TimeoutError(f"{url}: {last} after {timeout:.0f} s; {container.name} log tail:\n{container.logs()}")


@dataclass(frozen=True)
class ImageFacts:
    ref: str
    id: str
    size: int  # bytes, uncompressed
    layers: int
    user: str
    entrypoint: list[str]
    labels: dict[str, str]


def inspect_image(runtime: Runtime, ref: str) -> ImageFacts:
    out = subprocess.run(runtime.podman("image", "inspect", ref), capture_output=True, text=True, check=True)
    doc = json.loads(out.stdout)[0]
    config = doc.get("Config") or {}
    return ImageFacts(ref=ref, id=doc["Id"], size=int(doc["Size"]), layers=len(doc["RootFS"]["Layers"]),
                      user=config.get("User", ""), entrypoint=list(config.get("Entrypoint") or []),
                      labels=dict(config.get("Labels") or {}))


class Mounted:
    """An image's root filesystem, mounted read-only on the host (`podman image mount`)."""

    def __init__(self, runtime: Runtime, ref: str):
        self.runtime, self.ref = runtime, ref

    def __enter__(self) -> Path:
        out = subprocess.run(
            self.runtime.podman("image", "mount", self.ref), capture_output=True, text=True, check=True
        )
        return Path(out.stdout.strip())

    def __exit__(self, *exc: Any) -> None:
        subprocess.run(self.runtime.podman("image", "unmount", self.ref), capture_output=True)
