"""How to compare generated outputs of two engines whose batch schedule or prefill chunking
may differ (vLLM's own `check_logprobs_close` rule).

Greedy tokens of a random-weight bf16 model flip on tiny numeric noise: two near-tied logits
swap when the batch or the prefill split changes, even without any connector. So outputs
are compared position by position; at the first position where the tokens differ, each
side's token must be among the other side's top-k logprobs (a near tie), and the rest of the
sequences is not compared (they continue from different tokens). A wrong KV cache shows up
as a token that the other side does not even rank in its top-k. Exact token equality is
the right test only where both runs have the same schedule by construction (for example
two cache hits of the same prompt, alone in the batch); the exact oracle of the KV itself is
the connector's KV audit (`kvpool_connector.connector.audit`).

Outputs are `OfflineEngine.generate` results: {"token_ids": [...], "logprobs": [[[token,
logprob], ...] per position]}.
"""

from __future__ import annotations

from typing import Any


def _top(position: list) -> dict[int, float]:
    return {int(t): float(lp) for t, lp in position}


def logprobs_mismatch(a: dict[str, Any], b: dict[str, Any]) -> str | None:
    """None when a and b agree under the rule above, else a description of the difference."""
    ta, tb = a["token_ids"], b["token_ids"]
    if len(ta) != len(tb):
        return f"lengths differ: {len(ta)} vs {len(tb)} tokens"
    for i, (x, y) in enumerate(zip(ta, tb, strict=True)):
        if x == y:
            continue
        la, lb = a.get("logprobs"), b.get("logprobs")
        if not la or not lb:
            return f"position {i}: token {x} vs {y}, and no logprobs to compare"
        top_a, top_b = _top(la[i]), _top(lb[i])
        if x not in top_b or y not in top_a:
            return (f"position {i}: token {x} vs {y}, not in each other's top-{len(top_a)} "
                    f"(a: {sorted(top_a, key=top_a.get, reverse=True)}, "
                    f"b: {sorted(top_b, key=top_b.get, reverse=True)})")
        return None  # diverged at a near tie: the continuations are not comparable
    return None


def check_logprobs_close(outputs_a: list[dict], outputs_b: list[dict],
                         names: list[str] | None = None, label: str = "") -> None:
    """Assert every pair agrees (see logprobs_mismatch); the message lists each failing pair."""
    assert len(outputs_a) == len(outputs_b), (len(outputs_a), len(outputs_b))
    names = names or [str(i) for i in range(len(outputs_a))]
    bad = [f"{n}: {why}" for n, a, b in zip(names, outputs_a, outputs_b, strict=True)
           if (why := logprobs_mismatch(a, b)) is not None]
    assert not bad, f"{label} outputs differ beyond near ties:\n  " + "\n  ".join(bad)
