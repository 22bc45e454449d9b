"""The Argo CD health check for KVCachePool (charts/kvpool/health/kvcachepool.lua), run in Lua 5.1.

Argo CD evaluates resource health scripts with gopher-lua, a Lua 5.1 implementation; lupa's
lua51 runtime is the closest real interpreter on PyPI. The script gets the object as the global
`obj` (a table converted from JSON) and returns {status, message}.
"""

from __future__ import annotations

import copy

import pytest
from lupa import lua51

from tests.operator.chartkit import CHART

SCRIPT = (CHART / "health" / "kvcachepool.lua").read_text()


def _to_lua(runtime, value):
    if isinstance(value, dict):
        return runtime.table_from({k: _to_lua(runtime, v) for k, v in value.items()})
    if isinstance(value, list):
        return runtime.table_from([_to_lua(runtime, v) for v in value])
    return value


def health(obj: dict) -> tuple[str, str]:
    runtime = lua51.LuaRuntime(unpack_returned_tuples=True)
    runtime.globals().obj = _to_lua(runtime, obj)
    result = runtime.execute(SCRIPT)
    return result["status"], result["message"]


def cond(type_: str, status: str, reason: str = "", message: str = "", generation: int = 3) -> dict:
    return {
        "type": type_,
        "status": status,
        "reason": reason or ("AsExpected" if status == "True" else "NotYet"),
        "message": message,
        "observedGeneration": generation,
        "lastTransitionTime": "2026-01-01T00:00:00Z",
    }


def pool(status: dict | None, generation: int = 3) -> dict:
    obj = {
        "apiVersion": "kvpool.dev/v1alpha1",
        "kind": "KVCachePool",
        "metadata": {"name": "llama", "namespace": "llm", "generation": generation},
        "spec": {"replicas": 2, "model": {"name": "m"}},
    }
    if status is not None:
        obj["status"] = status
    return obj


READY = {
    "observedGeneration": 3,
    "phase": "Ready",
    "replicas": 2,
    "readyReplicas": 2,
    "conditions": [
        cond("Ready", "True", "AllReplicasReady", "2/2 engines ready"),
        cond("Progressing", "False", "Converged"),
        cond("Degraded", "False", "AsExpected"),
        cond("ConfigValid", "True", "Valid"),
        cond("BackendsReady", "True", "BackendsReady"),
    ],
}


def with_conditions(base: dict, **changes: tuple[str, str, str]) -> dict:
    status = copy.deepcopy(base)
    for c in status["conditions"]:
        if c["type"] in changes:
            c["status"], c["reason"], c["message"] = changes[c["type"]]
    return status


def test_ready_current_generation_is_healthy():
    assert health(pool(READY)) == ("Healthy", "2/2 engines ready")


def test_no_status_yet_is_progressing():
    status, message = health(pool(None))
    assert status == "Progressing"
    assert "operator" in message


def test_stale_observed_generation_is_progressing_even_if_ready():
    """The user changed the spec (generation 4); Ready=True was about generation 3."""
    status, message = health(pool(READY, generation=4))
    assert status == "Progressing"
    assert "generation 4" in message


def test_stale_degraded_is_progressing_not_degraded():
    """A fix was just pushed: the old Degraded verdict must not fail the sync."""
    old = with_conditions(READY, Degraded=("True", "BackendUnavailable", "redis down"),
                          Ready=("False", "BackendUnavailable", "redis down"))
    assert health(pool(old, generation=5))[0] == "Progressing"


def test_missing_observed_generation_is_progressing():
    status = copy.deepcopy(READY)
    del status["observedGeneration"]
    assert health(pool(status))[0] == "Progressing"


def test_degraded_condition_wins_over_ready():
    status = with_conditions(READY, Degraded=("True", "BackendUnavailable", "redis tier unreachable: 0/1 ready"))
    status["phase"] = "Degraded"
    assert health(pool(status)) == ("Degraded", "redis tier unreachable: 0/1 ready")


def test_config_invalid_is_degraded_with_the_operator_message():
    status = with_conditions(
        READY,
        ConfigValid=("False", "SecretNotFound", "tiers.redis.external.passwordSecretRef: Secret redis not found"),
        Ready=("False", "InvalidConfig", ""),
    )
    status["phase"] = "Invalid"
    assert health(pool(status)) == ("Degraded", "tiers.redis.external.passwordSecretRef: Secret redis not found")


def test_phase_invalid_without_conditions_is_degraded():
    assert health(pool({"observedGeneration": 3, "phase": "Invalid"}))[0] == "Degraded"


def test_rolling_out_is_progressing_with_progress_message():
    status = with_conditions(
        READY,
        Ready=("False", "ReplicasNotReady", "1/2 engines ready"),
        Progressing=("True", "RollingOut", "rolling out config a1b2c3"),
    )
    status["phase"] = "Progressing"
    assert health(pool(status)) == ("Progressing", "rolling out config a1b2c3")


def test_not_ready_without_progressing_condition_uses_ready_message():
    status = {
        "observedGeneration": 3,
        "phase": "Pending",
        "conditions": [cond("Ready", "False", "Pending", "0/2 engines ready")],
    }
    assert health(pool(status)) == ("Progressing", "0/2 engines ready")


def test_message_falls_back_to_reason():
    status = with_conditions(READY, Degraded=("True", "EngineCrashLoop", ""))
    assert health(pool(status)) == ("Degraded", "EngineCrashLoop")


@pytest.mark.parametrize("conditions", [[], [{"status": "True"}], [cond("Unrelated", "True")]])
def test_odd_condition_lists_never_error(conditions):
    status = {"observedGeneration": 3, "conditions": conditions}
    assert health(pool(status))[0] == "Progressing"


def test_stalled_condition_is_degraded():
    status = copy.deepcopy(READY)
    status["conditions"].append(cond("Stalled", "True", "ApplyFailed", "Deployment llama: forbidden"))
    assert health(pool(status)) == ("Degraded", "Deployment llama: forbidden")


# The statuses the operator really writes (kvpool_operator.status.compute_status), end to end.

def _operator_status(**observation) -> dict:
    from kvpool_operator.status import Observation, compute_status

    base = {"generation": 3, "desired_replicas": 2, "selector": "app.kubernetes.io/instance=llama"}
    return compute_status(Observation(**{**base, **observation}), now="2026-01-01T00:00:00Z")


def _deployment(ready: int, updated: int = 2, generation: int = 1, observed: int = 1) -> dict:
    return {
        "metadata": {"generation": generation},
        "spec": {"replicas": 2},
        "status": {"replicas": 2, "readyReplicas": ready, "updatedReplicas": updated, "observedGeneration": observed},
    }


def test_operator_ready_status_is_healthy():
    status = _operator_status(
        deployment=_deployment(ready=2), backends={"redis": {"spec": {"replicas": 1}, "status": {"readyReplicas": 1}}}
    )
    assert status["phase"] == "Ready"
    assert health(pool(status))[0] == "Healthy"
    # ...until the user edits the spec and the operator has not caught up.
    assert health(pool(status, generation=4))[0] == "Progressing"


def test_operator_rollout_status_is_progressing():
    status = _operator_status(deployment=_deployment(ready=1, updated=1), previous={"phase": "Progressing"})
    assert status["phase"] == "Progressing"
    assert health(pool(status)) == ("Progressing", status["conditions"][1]["message"])


def test_operator_pending_status_is_progressing():
    status = _operator_status(deployment=None)
    assert health(pool(status))[0] == "Progressing"


def test_operator_invalid_status_is_degraded_with_its_message():
    status = _operator_status(invalid="tiers.redis.external.passwordSecretRef: Secret 'redis' not found")
    assert health(pool(status)) == ("Degraded", "tiers.redis.external.passwordSecretRef: Secret 'redis' not found")


def test_operator_lost_replicas_status_is_degraded():
    status = _operator_status(deployment=_deployment(ready=1), previous={"phase": "Ready"})
    assert status["phase"] == "Degraded"
    assert health(pool(status))[0] == "Degraded"
