"""Pod Security Standards: which level every pod the operator renders passes, per disk volume type
(what docs/operator.md, "Pod Security", tells cluster admins to label namespaces with).

The checks are the Pod Security Standards' `baseline` and `restricted` controls (Kubernetes 1.30+)
that a rendered pod can touch: host namespaces, privileged containers, capabilities, hostPath
volumes, host ports, seccomp, /proc mount, sysctls; volume types, privilege escalation, non-root,
capabilities drop ALL. A pod's level is the strictest it passes.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvpool_dev.golden import GOLDEN_SETTINGS
from kvpool_operator.render import render
from tests.operator.conftest import example_ids, load_example

BASELINE_CAPABILITIES = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
                         "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                      "projected", "secret"}


def _containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return [*pod.get("initContainers", []), *pod["containers"]]


def baseline_violations(pod: dict[str, Any]) -> list[str]:
    out = [f"host namespace {k}" for k in ("hostNetwork", "hostPID", "hostIPC") if pod.get(k)]
    out += [f"hostPath volume {v['name']}" for v in pod.get("volumes", []) if "hostPath" in v]
    for c in _containers(pod):
        sc = c.get("securityContext", {})
        if sc.get("privileged"):
            out.append(f"{c['name']}: privileged")
        if set(sc.get("capabilities", {}).get("add", [])) - BASELINE_CAPABILITIES:
            out.append(f"{c['name']}: capabilities added")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            out.append(f"{c['name']}: hostPort")
        if sc.get("procMount", "Default") != "Default":
            out.append(f"{c['name']}: procMount")
        if sc.get("seccompProfile", {}).get("type") == "Unconfined":
            out.append(f"{c['name']}: seccomp Unconfined")
    if pod.get("securityContext", {}).get("seccompProfile", {}).get("type") == "Unconfined":
        out.append("seccomp Unconfined")
    if pod.get("securityContext", {}).get("sysctls"):
        out.append("sysctls")
    return out


def restricted_violations(pod: dict[str, Any]) -> list[str]:
    out = [f"volume type of {v['name']}" for v in pod.get("volumes", [])
           if not set(v) - {"name"} <= RESTRICTED_VOLUMES]
    psc = pod.get("securityContext", {})
    for c in _containers(pod):
        sc = c.get("securityContext", {})
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{c['name']}: allowPrivilegeEscalation")
        if not sc.get("runAsNonRoot", psc.get("runAsNonRoot")) or sc.get("runAsUser", psc.get("runAsUser")) == 0:
            out.append(f"{c['name']}: runAsNonRoot")
        seccomp = sc.get("seccompProfile", psc.get("seccompProfile", {})).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"{c['name']}: seccompProfile")
        caps = sc.get("capabilities", {})
        if "ALL" not in caps.get("drop", []) or set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            out.append(f"{c['name']}: capabilities")
    return out


def level(pod: dict[str, Any]) -> str:
    if baseline_violations(pod):
        return "privileged"
    return "baseline" if restricted_violations(pod) else "restricted"


def pods(manifests: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {f"{m['kind']}/{m['metadata']['name']}": m["spec"]["template"]["spec"]
            for m in manifests if m["kind"] in ("Deployment", "StatefulSet")}


@pytest.mark.parametrize("name", example_ids())
def test_every_pod_is_restricted_except_where_a_hostpath_tier_needs_privileged(name):
    """Engines, routers and managed backends pass `restricted`; a hostPath disk tier is the one thing
    that fails even `baseline` (hostPath volumes), and only in the engines' pod."""
    pool = load_example(name)
    host_path = "hostPath" in pool["spec"]["tiers"].get("disk", {}).get("volume", {})
    for pod_name, pod in pods(render(pool, GOLDEN_SETTINGS, "ml")).items():
        engines = pod_name == f"Deployment/{pool['metadata']['name']}"
        if host_path and engines:
            assert baseline_violations(pod) == ["hostPath volume kv-disk"], pod_name
        else:
            assert level(pod) == "restricted", (pod_name, baseline_violations(pod), restricted_violations(pod))


@pytest.mark.parametrize(
    "volume", [{"emptyDir": {}}, {"ephemeral": {}}, {"persistentVolumeClaim": {"claimName": "kv"}}]
)
def test_per_pod_and_claimed_volumes_keep_the_engines_restricted(volume):
    pool = load_example("tiered-full")
    pool["spec"]["tiers"]["disk"]["volume"] = volume
    assert level(pods(render(pool, GOLDEN_SETTINGS, "ml"))["Deployment/tiered-full"]) == "restricted"


def test_the_checker_sees_what_it_must():
    """The checks themselves: each control catches its violation."""
    good = {"securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [{"name": "c", "securityContext": {"allowPrivilegeEscalation": False,
                                                             "capabilities": {"drop": ["ALL"]}}}],
            "volumes": [{"name": "v", "emptyDir": {}}]}
    assert level(good) == "restricted"
    assert level({**good, "volumes": [{"name": "h", "hostPath": {"path": "/"}}]}) == "privileged"
    assert level({**good, "hostNetwork": True}) == "privileged"
    assert level({**good, "securityContext": {"runAsNonRoot": True}}) == "baseline"  # no seccomp profile
    assert level({**good, "volumes": [{"name": "n", "nfs": {"server": "x", "path": "/"}}]}) == "baseline"
    loose = {"name": "c", "securityContext": {"capabilities": {"drop": ["ALL"]}}}
    assert level({**good, "containers": [loose]}) == "baseline"  # allowPrivilegeEscalation unset


def test_the_operator_pod_of_the_chart_is_restricted():
    from tests.operator.chartkit import one, render as helm_render

    assert level(one(helm_render(), "Deployment")["spec"]["template"]["spec"]) == "restricted"
