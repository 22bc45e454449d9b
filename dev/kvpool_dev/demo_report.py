"""The demo's results and how they are shown: per-turn records, the servers' /metrics, the
side-by-side text report, one user's answers turn by turn, and the PNG chart (pure but for
writing the chart)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvpool_dev.demo import Settings


@dataclass
class TurnResult:
    conversation: int
    turn: int
    ttft_s: float
    latency_s: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    answer: str = ""


@dataclass
class RunResult:
    label: str
    wall_s: float
    turns: list[TurnResult] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]."""
    xs = sorted(values)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q / 100.0
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def parse_metrics(text: str) -> dict[str, Any]:
    """Hit counters from a vLLM server's Prometheus text (summed over engine labels)."""
    from prometheus_client.parser import text_string_to_metric_families

    sums: dict[str, float] = {}
    per_tier: dict[str, dict[str, float]] = {}
    by_source: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name
            if name == "vllm:prompt_tokens_cached_by_source_total":
                src = sample.labels.get("source", "")
                by_source[src] = by_source.get(src, 0.0) + sample.value
            elif name.startswith("kvpool_tier_") and name.endswith("_total") and "tier" in sample.labels:
                kind = name[len("kvpool_tier_"):-len("_total")]
                tier = per_tier.setdefault(sample.labels["tier"], {})
                tier[kind] = tier.get(kind, 0.0) + sample.value
            elif name.endswith("_total"):
                sums[name] = sums.get(name, 0.0) + sample.value

    def ratio(hits: str, queries: str) -> float | None:
        q = sums.get(queries, 0.0)
        return sums.get(hits, 0.0) / q if q else None

    return {
        "local_hit_rate": ratio("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"),
        "external_hit_rate": ratio("vllm:external_prefix_cache_hits_total",
                                   "vllm:external_prefix_cache_queries_total"),
        "prompt_tokens": sums.get("vllm:prompt_tokens_total"),
        "external_hit_tokens": sums.get("vllm:external_prefix_cache_hits_total", 0.0),
        "cached_tokens_by_source": by_source,
        "connector": {k: sums.get(f"kvpool_{k}_total", 0.0) for k in
                      ("saved_chunks", "loaded_chunks", "load_error_chunks", "lookups")},
        "tiers": {name: {"hit_chunks": v.get("hit_chunks", 0.0),
                         "miss_chunks": v.get("miss_chunks", 0.0),
                         "hit_rate": (v.get("hit_chunks", 0.0)
                                      / (v.get("hit_chunks", 0.0) + v.get("miss_chunks", 0.0))
                                      if v.get("hit_chunks", 0.0) + v.get("miss_chunks", 0.0)
                                      else None)}
                  for name, v in per_tier.items()},
    }


def summarize(run: RunResult) -> dict[str, Any]:
    ttfts = [t.ttft_s for t in run.turns]
    prompt = sum(t.prompt_tokens for t in run.turns)
    return {
        "label": run.label,
        "requests": len(run.turns),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p95_s": percentile(ttfts, 95),
        "ttft_by_turn_s": [statistics.median(t.ttft_s for t in run.turns if t.turn == k)
                           for k in sorted({t.turn for t in run.turns})],
        "ttft_by_conversation_s": [[t.ttft_s for t in sorted(run.turns, key=lambda t: t.turn)
                                    if t.conversation == c]
                                   for c in sorted({t.conversation for t in run.turns})],
        "requests_per_s": len(run.turns) / run.wall_s if run.wall_s else None,
        "output_tokens_per_s": (sum(t.completion_tokens for t in run.turns) / run.wall_s
                                if run.wall_s else None),
        "cached_tokens": sum(t.cached_tokens for t in run.turns),
        "cached_token_share": sum(t.cached_tokens for t in run.turns) / prompt if prompt else None,
        "wall_s": run.wall_s,
        "metrics": run.metrics,
        "answers": [[t.answer for t in sorted(run.turns, key=lambda t: t.turn)
                     if t.conversation == c]
                    for c in sorted({t.conversation for t in run.turns})],
    }


def identical_answers(base: dict[str, Any], pool: dict[str, Any]) -> tuple[int, int]:
    """(turns whose answer is the same text with and without kvpool, turns whose history was
    the same in both arms) (pure). A conversation's turns count until its answers first
    differ: after that the two arms ask about different histories. Greedy answers can differ
    where a loaded prefix's bf16 rounding, against a recompute in other chunks, flips a
    near-tied token; the KV audit tests compare the loaded KV bit for bit, this is what a
    user sees."""
    same = comparable = 0
    for ca, cb in zip(base["answers"], pool["answers"], strict=True):
        for a, b in zip(ca, cb, strict=True):
            comparable += 1
            if a != b:
                break
            same += 1
    return same, comparable


def _one_line(text: str, width: int = 240) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[:width - 3] + "..."


def render_answers(base: dict[str, Any], pool: dict[str, Any], workload: list[dict[str, Any]],
                   max_tokens: int, conversation: int = 0) -> str:
    """One user's conversation, turn by turn: question, TTFT in each arm, the answer with
    kvpool (and without, where it differs) (pure)."""
    same, total = identical_answers(base, pool)
    lines = [f"conversation {conversation + 1} (answers stop at {max_tokens} tokens):"]
    for k, answer in enumerate(pool["answers"][conversation]):
        other = base["answers"][conversation][k]
        ttft = (f"TTFT {base['ttft_by_conversation_s'][conversation][k]:.3f} s without, "
                f"{pool['ttft_by_conversation_s'][conversation][k]:.3f} s with kvpool")
        lines.append(f"  turn {k + 1}  {ttft}")
        lines.append(f"    Q: {_one_line(workload[conversation]['questions'][k])}")
        lines.append(f"    A: {_one_line(answer)}")
        if other != answer:
            lines.append(f"    A without kvpool: {_one_line(other)}")
    lines.append(f"same answer with and without kvpool: {same} of the {total} turns whose history "
                 "was the same in both arms")
    return "\n".join(lines)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def _ratio(base: float | None, pool: float | None) -> str:
    if not pool or not base:
        return ""
    r = base / pool
    return f"({r:.1f}x faster)" if r >= 1 else f"({1 / r:.1f}x slower)"


def render(base: dict[str, Any], pool: dict[str, Any], s: Settings, tiers: list[str],
           machine: str = "") -> str:
    """The side-by-side text report (pure)."""
    rows = [
        ("TTFT p50", f"{base['ttft_p50_s']:.3f} s",
         f"{pool['ttft_p50_s']:.3f} s {_ratio(base['ttft_p50_s'], pool['ttft_p50_s'])}"),
        ("TTFT p95", f"{base['ttft_p95_s']:.3f} s",
         f"{pool['ttft_p95_s']:.3f} s {_ratio(base['ttft_p95_s'], pool['ttft_p95_s'])}"),
    ]
    for k, (b, p) in enumerate(zip(base["ttft_by_turn_s"], pool["ttft_by_turn_s"], strict=True)):
        note = "  nothing cached yet" if k == 0 else ""
        rows.append((f"  TTFT p50, turn {k + 1}", f"{b:.3f} s", f"{p:.3f} s {_ratio(b, p)}{note}"))
    rows += [
        ("throughput", f"{base['requests_per_s']:.2f} req/s, {base['output_tokens_per_s']:.1f} tok/s",
         f"{pool['requests_per_s']:.2f} req/s, {pool['output_tokens_per_s']:.1f} tok/s"),
        ("time serving", f"{base['wall_s']:.1f} s", f"{pool['wall_s']:.1f} s"),
        ("prompt tokens cached", _pct(base["cached_token_share"]), _pct(pool["cached_token_share"])),
        ("  vLLM prefix cache", _pct(base["metrics"].get("local_hit_rate")),
         _pct(pool["metrics"].get("local_hit_rate"))),
        ("  kvpool (external)", "-", _pct(pool["metrics"].get("external_hit_rate"))),
    ]
    for tier in tiers:
        t = pool["metrics"].get("tiers", {}).get(tier) or {"hit_chunks": 0, "hit_rate": None}
        reads = ("no reads reached it" if t["hit_rate"] is None
                 else f"{_pct(t['hit_rate'])} of its reads")
        cell = f"{t['hit_chunks']:.0f} chunks served ({reads})"
        rows.append((f"  kvpool {tier} tier", "-", cell))
    head = (f"kvpool demo: {s.conversations} conversations x {s.turns} turns, concurrency "
            f"{s.concurrency}, ~{s.doc_tokens}-token documents, engine KV cache "
            f"{s.kv_cache_tokens} tokens; the two servers took turns round by round")
    if machine:
        head += f"\n{machine}"
    w = max(len(r[1]) for r in rows) + 2
    lines = [head, "", f"{'':<24}{'without kvpool':<{w}}with kvpool ({'+'.join(tiers)})"]
    lines += [f"{a:<24}{b:<{w}}{c}" for a, b, c in rows]
    return "\n".join(lines)


def chart(base: dict[str, Any], pool: dict[str, Any], tiers: list[str], path: Path,
          title: str = "kvpool demo: multi-turn chat on vLLM") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = ("#9e9e9e", "#1f77b4")
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    ax = axes[0][0]
    xs = range(2)
    for i, (run, color) in enumerate(zip((base, pool), colors, strict=True)):
        ax.bar([x + i * 0.38 for x in xs], [run["ttft_p50_s"], run["ttft_p95_s"]], 0.38,
               color=color, label=("without kvpool", "with kvpool")[i])
    ax.set_xticks([x + 0.19 for x in xs], ["TTFT p50", "TTFT p95"])
    ax.set_ylabel("seconds")
    ax.set_title("Time to first token")
    ax.legend()
    ax = axes[0][1]
    for run, color, label in zip((base, pool), colors, ("without kvpool", "with kvpool"), strict=True):
        turns = range(1, len(run["ttft_by_turn_s"]) + 1)
        ax.plot(list(turns), run["ttft_by_turn_s"], marker="o", color=color, label=label)
    ax.set_xticks(list(range(1, len(base["ttft_by_turn_s"]) + 1)))
    ax.set_xlabel("turn (turn 1: nothing cached yet)")
    ax.set_ylabel("TTFT p50 (s)")
    ax.set_title("TTFT by conversation turn")
    ax.legend()
    ax = axes[1][0]
    vals = [base["output_tokens_per_s"], pool["output_tokens_per_s"]]
    ax.bar(["without kvpool", "with kvpool"], vals, color=colors)
    ax.set_ylabel("output tokens / s")
    ax.set_title("Throughput")
    ax = axes[1][1]
    names = ["vLLM prefix cache", "kvpool (all tiers)"] + [f"kvpool {t}" for t in tiers]
    m = pool["metrics"]
    rates = [m.get("local_hit_rate") or 0.0, m.get("external_hit_rate") or 0.0]
    rates += [(m.get("tiers", {}).get(t) or {}).get("hit_rate") or 0.0 for t in tiers]
    base_rates = [base["metrics"].get("local_hit_rate") or 0.0] + [0.0] * (len(names) - 1)
    ys = range(len(names))
    ax.barh([y + 0.38 for y in ys], base_rates, 0.38, color=colors[0], label="without kvpool")
    ax.barh(list(ys), rates, 0.38, color=colors[1], label="with kvpool")
    ax.set_yticks([y + 0.19 for y in ys], names)
    ax.set_xlim(0, 1)
    ax.set_xlabel("hit rate")
    ax.set_title("Hit rates (server /metrics)")
    ax.legend(loc="lower right")
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
