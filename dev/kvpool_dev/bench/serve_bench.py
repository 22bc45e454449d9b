"""`kvpool bench serve`: kvpool's connector (cpu tier only) against vLLM's native offloading
and plain vLLM, measured the way a user comparing them would: one OpenAI server per arm,
driven by vLLM's own `bench serve` client and datasets.

Arms (same model, dtype, engine environment, block size, engine KV cache and host memory):
  plain    no connector: vLLM's own prefix cache only
  kvpool   KVPoolConnector with one cpu tier of --host-bytes
  native   vLLM's OffloadingConnector with kvpool's spec (HostCopyWorker), cpu_bytes_to_use
           --host-bytes
  ARM-twin on request: a second server identical to ARM (native-twin, kvpool-twin), an A/A
           pair: how far two identical servers land apart in the run on the goal's figures
           is the noise every other ratio of that run sits in
Every server runs with `--block-size 32 --max-num-seqs 4 --num-gpu-blocks-override N`, N
such that about --fit-prefixes prompts fit in the engine's own cache: with more distinct
prefixes than that, a returning prefix has been evicted there and only an offloading arm
can serve it without recomputing.

Datasets (vLLM's): prefix_repetition (--num-prefixes prefixes of --prefix-len tokens,
--suffix-len-token suffixes) and random with one shared prefix of --prefix-len tokens (it
fits the engine's cache: what a connector costs when it cannot help).

All servers boot together and stay up; every pass runs each dataset on every arm, one arm
at a time, in alternating order (pass 1 plain, kvpool, native; pass 2 native, kvpool,
plain), with a seed of its own, so no pass finds another's prefixes and the machine's drift
falls on every arm alike. Ratios are per pass: the shared machine's absolute figures move,
an arm's standing within one pass is what the bench reports.

prefix_repetition's TTFTs are also split (from the client's per-request TTFTs and the
dataset rebuilt with the pass's seed): the first request of each prefix, which every arm
computes, and the returning ones, which the engine's cache or an offloading arm serves: the
hot path the connectors differ on, apart from the prefill work they share.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from kvpool_dev.bench import kv_configs

ARMS = ("plain", "kvpool", "native")
# on request (--arms): kvpool saving prompt chunks only (no tail objects, partial blocks or
# decode KV), what native offloading saves here: what those finish saves cost this workload
EXTRA_ARMS = ("kvpool-prompt",)
# any arm + TWIN (say native-twin): a second server identical to that arm, an A/A pair: how
# far two identical servers land apart in this run is the noise any other ratio sits in
TWIN = "-twin"
DATASETS = ("prefix_repetition", "random")
BLOCK_SIZE = 32
MAX_NUM_SEQS = 4
METRICS = ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "request_throughput")
# for these lower is better; request_throughput: higher is better
LOWER_IS_BETTER = {"mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms"}
# the figures issue 27's goal judges kvpool against native on (the median is shown, not
# judged: with 40 prompts it is one request's TTFT, and the goal does not name it)
GOAL_METRICS = ("mean_ttft_ms", "p99_ttft_ms", "request_throughput")
# with Poisson arrivals (--request-rate) req/s is the arrival rate, the same for every arm
OPEN_LOOP_GOAL_METRICS = ("mean_ttft_ms", "p99_ttft_ms")


@dataclass(frozen=True)
class Workload:
    num_prompts: int = 40
    prefix_len: int = 1024
    suffix_len: int = 32
    num_prefixes: int = 8
    output_len: int = 8
    concurrency: int = 2
    fit_prefixes: int = 3        # prompts that fit the engine's own KV cache
    host_bytes: int = 2 << 30    # each offloading arm's host memory
    chunk_tokens: int = 256      # kvpool chunk = native host block
    # None: a closed loop (each of `concurrency` clients sends when its last request ends,
    # the workload); requests/s: Poisson arrivals at that rate, still at most
    # `concurrency` in flight, so no two arms' requests fall into step with each other's
    request_rate: float | None = None

    @property
    def prompt_tokens(self) -> int:
        return self.prefix_len + self.suffix_len + self.output_len


QUICK = Workload(num_prompts=12, prefix_len=512, suffix_len=32, num_prefixes=4, output_len=4,
                 concurrency=2, fit_prefixes=2, host_bytes=256 << 20)


def max_model_len(w: Workload) -> int:
    """Room for a prompt (a detokenized, re-tokenized prompt may come out a little longer)."""
    return -(-(w.prompt_tokens + 64) // BLOCK_SIZE) * BLOCK_SIZE


def gpu_blocks(w: Workload) -> int:
    """The engine's KV cache in blocks: about `fit_prefixes` prompts, and at least one
    longest request plus vLLM's null block (pure)."""
    per_prompt = -(-w.prompt_tokens // BLOCK_SIZE)
    return max(w.fit_prefixes * per_prompt, max_model_len(w) // BLOCK_SIZE + 1)


def pass_orders(arms: list[str], passes: int) -> list[list[str]]:
    """Arm order per pass: as given, then reversed, alternating (pure)."""
    return [list(arms) if p % 2 == 0 else list(reversed(arms)) for p in range(passes)]


def base_arm(arm: str) -> str:
    """The arm a twin copies (native-twin: native); any other arm itself (pure)."""
    return arm[:-len(TWIN)] if arm.endswith(TWIN) and arm != TWIN else arm


def transfer_config(arm: str, w: Workload, namespace: str) -> dict[str, Any] | None:
    """The arm's --kv-transfer-config: the same host memory and chunk size for both
    offloading arms (pure). A twin gets its base arm's."""
    name, arm = arm, base_arm(arm)
    if arm in ("kvpool", "kvpool-prompt"):
        only_prompt = ({"tail_objects": False, "save_decode_tokens": False}
                       if arm == "kvpool-prompt" else {})
        return kv_configs.kvpool_config([{"type": "cpu", "size": w.host_bytes}], namespace,
                                        chunk_tokens=w.chunk_tokens, **only_prompt)
    if arm == "native":
        return kv_configs.native_config(w.host_bytes, chunk_tokens=w.chunk_tokens)
    if arm == "plain":
        return None
    raise ValueError(f"--arms: unknown arm {name!r}; choose from "
                     f"{', '.join(ARMS + EXTRA_ARMS)}, each also as ARM{TWIN}")


def check_arms(arms: list[str], w: Workload) -> None:
    """ValueError naming --arms for an unknown arm, one given twice, or a twin without the
    arm it copies (pure)."""
    if not arms:
        raise ValueError("--arms: name at least one arm")
    for a in arms:
        transfer_config(a, w, "check")
        if arms.count(a) > 1:
            raise ValueError(f"--arms: {a} given twice (for a second identical server: "
                             f"{a}{TWIN})")
        if base_arm(a) != a and base_arm(a) not in arms:
            raise ValueError(f"--arms: {a} is compared with {base_arm(a)}: add it")


def server_args(w: Workload) -> list[str]:
    return ["--block-size", str(BLOCK_SIZE), "--max-num-seqs", str(MAX_NUM_SEQS),
            "--num-gpu-blocks-override", str(gpu_blocks(w))]


def client_args(dataset: str, w: Workload, base_url: str, model: str, seed: int,
                result_dir: Path, result_file: str) -> list[str]:
    """vLLM `bench serve` arguments for one dataset against one server (pure)."""
    args = ["--backend", "vllm", "--base-url", base_url, "--endpoint", "/v1/completions",
            "--model", model, "--served-model-name", "local", "--tokenizer", model,
            "--dataset-name", dataset, "--num-prompts", str(w.num_prompts),
            "--max-concurrency", str(w.concurrency), "--seed", str(seed), "--ignore-eos",
            *(["--request-rate", str(w.request_rate)] if w.request_rate else []),
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            # the ready check sends the first prompt untimed: it would warm that prefix
            "--ready-check-timeout-sec", "0", "--num-warmups", "0", "--disable-tqdm",
            "--save-result", "--save-detailed",  # per-request TTFTs: split_ttfts
            "--result-dir", str(result_dir), "--result-filename", result_file]
    if dataset == "prefix_repetition":
        args += ["--prefix-repetition-prefix-len", str(w.prefix_len),
                 "--prefix-repetition-suffix-len", str(w.suffix_len),
                 "--prefix-repetition-num-prefixes", str(w.num_prefixes),
                 "--prefix-repetition-output-len", str(w.output_len)]
    elif dataset == "random":
        args += ["--random-prefix-len", str(w.prefix_len), "--random-input-len",
                 str(w.suffix_len), "--random-output-len", str(w.output_len),
                 "--random-range-ratio", "0"]
    else:
        raise ValueError(f"--datasets: unknown dataset {dataset!r}; choose from "
                         f"{', '.join(DATASETS)}")
    return args


# server counters worth a look next to the figures: the engine's own prefix cache, the
# connector's (external) hits, kvpool's loads, saves and load errors
COUNTER_PREFIXES = ("vllm:prefix_cache_", "vllm:external_prefix_cache_", "kvpool_")


def counters(text: str) -> dict[str, float]:
    """Totals per counter name (summed over label sets) of the Prometheus text, for the
    COUNTER_PREFIXES names ending in _total (pure)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, rest = line.partition("{") if "{" in line.split(" ")[0] else line.partition(" ")
        name = name.strip()
        if not name.endswith("_total") or not name.startswith(COUNTER_PREFIXES):
            continue
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        out[name] = out.get(name, 0.0) + value
    return out


def counter_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0)}


def pick(result: dict[str, Any], groups: list[int] | None = None,
         from_arrival: bool = False) -> dict[str, Any]:
    """The figures the table shows, from vLLM's result JSON, and with `groups` (each
    request's prefix, in request order: prefix_groups) its TTFTs split by split_ttfts (pure).
    `from_arrival` (Poisson arrivals): every TTFT counted from the request's arrival, the
    time it waited in the client's queue for a free slot included; vLLM's client starts its
    clock at the send, so an arm that falls behind the arrivals would show it nowhere."""
    out = {m: result.get(m) for m in METRICS}
    out["completed"] = result.get("completed")
    out["failed"] = result.get("failed", 0)
    out["duration_s"] = result.get("duration")
    ttfts = result.get("ttfts")
    queued = result.get("queue_times")
    if not (from_arrival and ttfts and queued and len(queued) == len(ttfts)):
        queued = None
    if queued:
        import numpy as np

        ms = (np.asarray(ttfts) + np.asarray(queued)) * 1000
        out.update(mean_ttft_ms=float(ms.mean()), median_ttft_ms=float(np.percentile(ms, 50)),
                   p99_ttft_ms=float(np.percentile(ms, 99)), ttft_from_arrival=True,
                   mean_client_queue_ms=float(np.mean(queued) * 1000))
    if groups is not None and ttfts:
        out.update(split_ttfts(ttfts, groups, result.get("start_times"), queued))
    return out


def split_ttfts(ttfts: list[float], groups: list[int], starts: list[float] | None = None,
                queued: list[float] | None = None) -> dict[str, Any]:
    """TTFT (ms) of each prefix's first request (computed by every arm) and of the returning
    ones (served from a cache), mean and median (pure). `ttfts` in request order, seconds;
    nothing when the two lists do not line up. With the requests' send times (`starts`,
    seconds): the returning requests sent while a first request waited for its first token
    (`exposed`), which share that prefill's step whatever cache serves them, and their mean
    TTFT: how often the client's timing, not the cache, set a returning request's TTFT.
    With the client's queue times (`queued`, Poisson arrivals) the means and medians count
    from each request's arrival; exposure is about the send, so it does not."""
    from kvpool_dev.demo_report import percentile

    if len(ttfts) != len(groups) or (queued is not None and len(queued) != len(ttfts)):
        return {}
    waits = queued if queued is not None else [0.0] * len(ttfts)
    seen: set[int] = set()
    first, repeat = [], []
    for t, q, g in zip(ttfts, waits, groups, strict=True):
        (repeat if g in seen else first).append((t + q) * 1000)
        seen.add(g)
    out: dict[str, Any] = {"first_requests": len(first), "repeat_requests": len(repeat)}
    for name, xs in (("first", first), ("repeat", repeat)):
        out[f"{name}_mean_ttft_ms"] = sum(xs) / len(xs) if xs else None
        out[f"{name}_median_ttft_ms"] = percentile(xs, 50) if xs else None
    if starts is not None and len(starts) == len(ttfts):
        seen.clear()
        pending: list[tuple[float, float]] = []  # first requests' (sent, first token)
        exposed = []
        for t, g, s0 in sorted(zip(ttfts, groups, starts, strict=True), key=lambda x: x[2]):
            if g in seen:
                if any(a <= s0 < b for a, b in pending):
                    exposed.append(t * 1000)  # from the send: the shared step's wait
            else:
                pending.append((s0, s0 + t))
            seen.add(g)
        out["exposed_requests"] = len(exposed)
        out["exposed_mean_ttft_ms"] = sum(exposed) / len(exposed) if exposed else None
    return out


def judged_metrics(w: Workload | dict[str, Any]) -> tuple[str, ...]:
    """The figures the verdict judges: the goal's, less req/s under Poisson arrivals (pure)."""
    rate = w.get("request_rate") if isinstance(w, dict) else w.request_rate
    return OPEN_LOOP_GOAL_METRICS if rate else GOAL_METRICS


def summarize(runs: list[dict[str, Any]], arms: list[str],
              judged: tuple[str, ...] = GOAL_METRICS) -> dict[str, Any]:
    """Per dataset and pass: each arm's figures and its ratio to plain and to native; per
    dataset the arms' means over passes and whether kvpool is at or ahead of native on the
    goal's figures (`judged`: GOAL_METRICS, judged_metrics) in every pass (pure). A ratio
    > 1 is better for kvpool on every figure; with twins, the A/A spread (aa_spread) and
    whether kvpool is within it of native."""
    out: dict[str, Any] = {}
    for dataset in dict.fromkeys(r["dataset"] for r in runs):
        passes = sorted({r["pass"] for r in runs if r["dataset"] == dataset})
        rows = []
        for p in passes:
            by = {r["arm"]: r["figures"] for r in runs if r["dataset"] == dataset
                  and r["pass"] == p}
            rows.append({"pass": p, "arms": by,
                         "kvpool_vs_native": _ratios(by.get("kvpool"), by.get("native")),
                         "kvpool_vs_plain": _ratios(by.get("kvpool"), by.get("plain")),
                         "native_vs_plain": _ratios(by.get("native"), by.get("plain")),
                         "twin_vs_base": {a: r for a in by if a != base_arm(a)
                                          if (r := _ratios(by[a], by.get(base_arm(a))))}})
        means = {a: {m: _mean([row["arms"][a][m] for row in rows if a in row["arms"]])
                     for m in METRICS} for a in arms}
        verdicts = [row["kvpool_vs_native"] for row in rows if row["kvpool_vs_native"]]
        spread = aa_spread((row["twin_vs_base"] for row in rows), judged)
        out[dataset] = {"passes": rows, "mean": means,
                        "kvpool_at_or_ahead_of_native": (
                            all(r.get(m, 0.0) >= 1.0 for r in verdicts for m in judged)
                            if verdicts else None),
                        "aa_spread": spread,
                        "kvpool_within_aa_spread_of_native": (
                            all(r.get(m, 0.0) * (1 + spread.get(m, 0.0)) >= 1.0
                                for r in verdicts for m in judged)
                            if verdicts and spread is not None else None)}
    return out


def aa_spread(per_pass, judged: tuple[str, ...] = GOAL_METRICS) -> dict[str, float] | None:
    """How far apart identical servers landed, per judged figure: the largest
    max(r, 1/r) - 1 over every twin's ratio to its base arm in every pass (0.08: 8%). Each
    figure has its own: p99's noise must not excuse a gap in the mean. None without a twin
    (pure)."""
    out: dict[str, float] = {}
    for twins in per_pass:
        for r in twins.values():
            for m in judged:
                if r.get(m):
                    out[m] = max(out.get(m, 0.0), max(r[m], 1 / r[m]) - 1)
    return out or None


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _ratios(a: dict | None, b: dict | None) -> dict[str, float] | None:
    """How many times better `a` is than `b` on each figure (>1: a is better)."""
    if not a or not b:
        return None
    out = {}
    for m in METRICS:
        x, y = a.get(m), b.get(m)
        if not x or not y:
            continue
        out[m] = y / x if m in LOWER_IS_BETTER else x / y
    return out


def render(report: dict[str, Any]) -> str:
    """The human table (pure)."""
    w = report["workload"]
    out = [f"kvpool bench serve: {report['cpu']}, dtype {report['dtype']}, model "
           f"{report['model']}; {w['num_prompts']} prompts, prefixes of {w['prefix_len']} "
           f"tokens + {w['suffix_len']}, {w['output_len']} output tokens, concurrency "
           f"{w['concurrency']}"
           + (f" (Poisson arrivals at {w['request_rate']:g} req/s; every TTFT from the "
              "request's arrival, its wait in the client's queue included)"
              if w.get("request_rate") else " (closed loop)")
           + f"; --block-size {BLOCK_SIZE} --max-num-seqs {MAX_NUM_SEQS} "
           f"--num-gpu-blocks-override {report['gpu_blocks']}; host memory "
           f"{w['host_bytes'] / 2**30:.2f} GiB per offloading arm", ""]
    for dataset, s in report["summary"].items():
        extra = (f" ({w['num_prefixes']} prefixes)" if dataset == "prefix_repetition"
                 else " (one shared prefix)")
        out.append(f"{dataset}{extra}:")
        aw = max([8] + [len(a) + 1 for row in s["passes"] for a in row["arms"]])
        head = (f"  {'pass':<5}{'arm':<{aw}}{'mean TTFT':>11}{'median':>10}{'p99 TTFT':>10}"
                f"{'req/s':>8}{'hit tok (engine+conn)':>23}   kvpool/native (x better: mean, median, p99, req/s)")
        out.append(head)
        for row in s["passes"]:
            for arm, f in row["arms"].items():
                ratio = ""
                r = (row["kvpool_vs_native"] if arm == "kvpool"
                     else row.get("twin_vs_base", {}).get(arm))
                if r:
                    ratio = "   " + ", ".join(f"{r.get(m, float('nan')):.3f}" for m in METRICS)
                    if arm != "kvpool":
                        ratio += f" ({arm}/{base_arm(arm)}: identical servers)"
                out.append(f"  {row['pass']:<5}{arm:<{aw}}{_ms(f['mean_ttft_ms']):>11}"
                           f"{_ms(f['median_ttft_ms']):>10}{_ms(f['p99_ttft_ms']):>10}"
                           f"{_num(f['request_throughput']):>8}{_hits(f):>23}{ratio}")
        for arm, f in s["mean"].items():
            out.append(f"  {'mean':<5}{arm:<{aw}}{_ms(f['mean_ttft_ms']):>11}"
                       f"{_ms(f['median_ttft_ms']):>10}{_ms(f['p99_ttft_ms']):>10}"
                       f"{_num(f['request_throughput']):>8}")
        split = [(row["pass"], arm, f) for row in s["passes"] for arm, f in row["arms"].items()
                 if f.get("repeat_mean_ttft_ms") is not None]
        if split:
            out.append("  TTFT split: each prefix's first request (computed by every arm) / the "
                       "returning ones (served from a cache), mean and median")
            for p, arm, f in split:
                exposed = ("" if f.get("exposed_requests") is None else
                           f"; of them sent during a first request's prefill "
                           f"{f['exposed_requests']}: {_ms(f['exposed_mean_ttft_ms'])}")
                out.append(f"  {p:<5}{arm:<{aw}}first {f['first_requests']}: "
                           f"{_ms(f['first_mean_ttft_ms'])}, {_ms(f['first_median_ttft_ms'])}; "
                           f"returning {f['repeat_requests']}: {_ms(f['repeat_mean_ttft_ms'])}, "
                           f"{_ms(f['repeat_median_ttft_ms'])}{exposed}")
        verdict = s["kvpool_at_or_ahead_of_native"]
        figures = ("mean TTFT and p99 TTFT (req/s is the arrival rate)"
                   if judged_metrics(w) == OPEN_LOOP_GOAL_METRICS
                   else "mean TTFT, p99 TTFT and req/s")
        out.append(f"  kvpool at or ahead of native on {figures} in every pass: "
                   + _YES_NO[verdict])
        if s.get("aa_spread") is not None:
            within = _YES_NO[s["kvpool_within_aa_spread_of_native"]]
            gaps = ", ".join(f"{_FIGURE_NAMES[m]} {g:.1%}" for m, g in s["aa_spread"].items())
            out.append(f"  identical servers (the twins) apart by up to: {gaps}; kvpool within "
                       f"that of native on each in every pass: {within}")
        out.append("")
    for arm, err in report.get("errors", {}).items():
        out.append(f"arm {arm} FAILED: {err.strip().splitlines()[-1] if err.strip() else ''}")
    return "\n".join(out).rstrip()


_YES_NO = {True: "yes", False: "no", None: "n/a"}
_FIGURE_NAMES = {"mean_ttft_ms": "mean TTFT", "median_ttft_ms": "median TTFT",
                 "p99_ttft_ms": "p99 TTFT", "request_throughput": "req/s"}


def _hits(f: dict[str, Any]) -> str:
    e, c = f.get("engine_hit_tokens"), f.get("connector_hit_tokens")
    if e is None and c is None:
        return "-"
    return f"{int(e or 0)}+{int(c or 0)}"


def _ms(v: float | None) -> str:
    return "-" if v is None or not math.isfinite(v) else f"{v:.0f} ms"


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


# -- I/O shell -------------------------------------------------------------------------------


def cpu_line() -> str:
    """lscpu's model name, family/model and whether avx512_bf16 is flagged."""
    from kvpool_dev.testbed.dtype import cpu_flags, cpu_model, read_cpuinfo

    info = read_cpuinfo()
    fields = {}
    for line in info.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    bf16 = "avx512_bf16" in cpu_flags(info)
    return (f"{cpu_model(info)} (family {fields.get('cpu family', '?')} model "
            f"{fields.get('model', '?')}, avx512_bf16 {'present' if bf16 else 'absent'})")


def with_positive(w: Any, args: argparse.Namespace, fields: tuple[str, ...]) -> Any:
    """The workload dataclass `w` with the command line's values of `fields` (None: kept);
    ValueError naming the option for one that is not positive."""
    for field_ in fields:
        value = getattr(args, field_)
        if value is not None:
            if not (0 < value < math.inf):  # nan and inf too
                raise ValueError(f"--{field_.replace('_', '-')} must be a positive number")
            w = replace(w, **{field_: value})
    return w


def check_paths(args: argparse.Namespace) -> None:
    """ValueError naming the option for a --model that is not a model directory or a
    --json-out whose directory does not exist: found before any server starts, not after
    the whole run."""
    if args.model and not (Path(args.model) / "config.json").is_file():
        raise ValueError(f"--model: {args.model} is not a model directory (no config.json)")
    if args.json_out and not Path(args.json_out).resolve().parent.is_dir():
        raise ValueError(f"--json-out: the directory of {args.json_out} does not exist")


def emit(report: dict[str, Any], args: argparse.Namespace, render_fn) -> int:
    """Write the report (--json-out), print it (--json or the table); 1 if an arm failed."""
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2) if args.json else render_fn(report))
    return 1 if report.get("errors") else 0


def _log(msg: str) -> None:
    print(f"[bench serve {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _scrape(server) -> dict[str, float]:
    try:
        return counters(server.metrics())
    except OSError:
        return {}


def warm_up(base_url: str, tokens: int) -> None:
    """One short completion nobody asks about again: first-call costs out of the timed
    passes, the same for every arm."""
    body = {"model": "local", "prompt": list(range(100, 100 + tokens)), "max_tokens": 2,
            "temperature": 0}
    req = urllib.request.Request(base_url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        r.read()


def prefix_groups(w: Workload, model: Path, seed: int) -> list[int] | None:
    """Each request's prefix (0..num_prefixes-1) in the order vLLM's bench serve sends
    prefix_repetition with this seed: its dataset rebuilt the way its client builds it. None
    when the rebuild does not find num_prefixes prefixes."""
    from vllm.benchmarks.datasets.datasets import PrefixRepetitionRandomDataset
    from vllm.tokenizers import get_tokenizer

    tok = get_tokenizer(str(model))
    requests = PrefixRepetitionRandomDataset(random_seed=seed).sample(
        tokenizer=tok, num_requests=w.num_prompts, prefix_len=w.prefix_len,
        suffix_len=w.suffix_len, num_prefixes=w.num_prefixes, output_len=w.output_len)
    # the prompt is decoded text: its first half re-encodes alike for one prefix
    keys = [tuple(tok.encode(r.prompt, add_special_tokens=False)[:w.prefix_len // 2])
            for r in requests]
    ids = {k: i for i, k in enumerate(dict.fromkeys(keys))}
    return [ids[k] for k in keys] if len(ids) == w.num_prefixes else None


def run_client(dataset: str, w: Workload, base_url: str, model: Path, seed: int,
               workdir: Path, label: str) -> dict[str, Any]:
    name = f"{label}.json"
    args = client_args(dataset, w, base_url, str(model), seed, workdir, name)
    log = workdir / f"{label}.client.log"
    with open(log, "w") as f:
        proc = subprocess.run([sys.executable, "-m", "kvpool_dev.bench.vllm_client", *args],
                              stdout=f, stderr=subprocess.STDOUT, timeout=3600)
    if proc.returncode != 0 or not (workdir / name).exists():
        tail = log.read_text()[-3000:]
        raise RuntimeError(f"vllm bench serve ({label}) exited {proc.returncode}:\n{tail}")
    return json.loads((workdir / name).read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvpool bench serve", description=(
        "plain vLLM vs kvpool's connector (cpu tier) vs vLLM's OffloadingConnector, on "
        "OpenAI servers driven by vLLM's own bench serve client"))
    ap.add_argument("--quick", action="store_true",
                    help="tiny model, 12 prompts of 4 prefixes x 512 tokens, one pass of "
                         "prefix_repetition (a smoke run)")
    ap.add_argument("--arms", default=",".join(ARMS),
                    help=f"comma list from {','.join(ARMS + EXTRA_ARMS)}; ARM{TWIN} (say "
                         f"native{TWIN}) adds a second server identical to ARM: how far two "
                         "identical servers land apart in the run, the noise of every ratio")
    ap.add_argument("--datasets", default=None, help=f"comma list from {','.join(DATASETS)} "
                    "(default: both; --quick: prefix_repetition)")
    ap.add_argument("--passes", type=int, default=None, help="passes, alternating the arms' "
                    "order (default 2; --quick: 1)")
    ap.add_argument("--num-prompts", type=int, default=None)
    ap.add_argument("--prefix-len", type=int, default=None)
    ap.add_argument("--num-prefixes", type=int, default=None)
    ap.add_argument("--concurrency", type=int, default=None)
    ap.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals at "
                    "this many requests/s (vLLM's client), at most --concurrency in flight "
                    "(default: a closed loop of --concurrency clients)")
    ap.add_argument("--host-bytes", type=int, default=None, help="host memory of each "
                    "offloading arm (default 2 GiB; --quick 256 MiB)")
    ap.add_argument("--model", default=None, help="model path (default: the generated bench "
                    "model; --quick: the tiny one)")
    ap.add_argument("--dtype", default=None, help="engine dtype for every arm (default: the "
                    "test bed's choice for this CPU, testbed/dtype.py)")
    ap.add_argument("--json-out", default=None, help="write the report here as JSON")
    ap.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    ap.add_argument("--workdir", default=None, help="server logs and client results "
                    "(default: a temp dir, removed)")
    args = ap.parse_args(argv)

    from kvpool_dev.testbed.dtype import DtypeError, engine_dtype
    from kvpool_dev.testbed.engine import VllmServer
    from kvpool_dev.testbed.localmodel import ensure_model

    w = QUICK if args.quick else Workload()
    try:
        w = with_positive(w, args, ("num_prompts", "prefix_len", "num_prefixes", "concurrency",
                                    "host_bytes", "request_rate"))
        check_paths(args)
    except ValueError as exc:
        print(f"kvpool bench serve: {exc}", file=sys.stderr)
        return 2
    arms = [a for a in args.arms.split(",") if a]
    datasets = (args.datasets.split(",") if args.datasets
                else ["prefix_repetition"] if args.quick else list(DATASETS))
    passes = args.passes or (1 if args.quick else 2)
    try:
        check_arms(arms, w)
        for d in datasets:
            client_args(d, w, "", "", 0, Path("."), "")
        dtype = engine_dtype(args.dtype)
    except (ValueError, DtypeError) as exc:
        print(f"kvpool bench serve: {exc}", file=sys.stderr)
        return 2
    if "kvpool" in arms and not kv_configs.kvpool_connector_available():
        print("kvpool bench serve: kvpool_connector.vllm.KVPoolConnector does not import",
              file=sys.stderr)
        return 2
    model = Path(args.model) if args.model else ensure_model("tiny" if args.quick else "bench")
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="kvpool-serve-"))
    workdir.mkdir(parents=True, exist_ok=True)
    namespace = f"bench-serve-{int(time.time())}"
    env = kv_configs.pool_key_env()
    servers = {a: VllmServer(model, kv_transfer_config=transfer_config(a, w, namespace),
                             extra_args=server_args(w), env=env, max_model_len=max_model_len(w),
                             dtype=dtype, log_path=workdir / f"server-{a}.log") for a in arms}
    runs: list[dict[str, Any]] = []
    errors: dict[str, str] = {}
    t0 = time.monotonic()
    try:
        _log(f"starting {len(servers)} servers ({', '.join(arms)}), dtype {dtype}, "
             f"{gpu_blocks(w)} engine blocks of {BLOCK_SIZE} tokens")
        for s in servers.values():
            s.launch()
        for a, s in servers.items():
            s.wait_ready()
            warm_up(s.base_url, min(w.prefix_len, 200))
            _log(f"{a} up at {s.base_url} ({time.monotonic() - t0:.0f}s)")
        for p, order in enumerate(pass_orders(arms, passes), start=1):
            for di, dataset in enumerate(datasets):
                seed = 1000 * p + di  # a pass's prompts are its own, the same for every arm
                groups = prefix_groups(w, model, seed) if dataset == "prefix_repetition" else None
                for a in order:
                    if a in errors:
                        continue
                    label = f"p{p}-{dataset}-{a}"
                    before = _scrape(servers[a])
                    try:
                        result = run_client(dataset, w, servers[a].base_url, model, seed,
                                            workdir, label)
                    except (RuntimeError, subprocess.TimeoutExpired) as exc:
                        errors[a] = f"{exc}\n{servers[a].log_tail(30)}"
                        _log(f"{label} failed: {str(exc)[-400:]}")
                        continue
                    figures = pick(result, groups, from_arrival=bool(w.request_rate))
                    if figures["failed"] or not figures["completed"]:
                        errors[a] = (f"{label}: {figures['failed']} of {w.num_prompts} requests "
                                     f"failed\n{servers[a].log_tail(30)}")
                        _log(f"{label}: {figures['failed']} requests failed; {a} is out")
                        continue
                    delta = counter_delta(before, _scrape(servers[a]))
                    figures["engine_hit_tokens"] = delta.get("vllm:prefix_cache_hits_total")
                    figures["connector_hit_tokens"] = delta.get(
                        "vllm:external_prefix_cache_hits_total")
                    runs.append({"pass": p, "dataset": dataset, "arm": a, "seed": seed,
                                 "figures": figures, "counters": delta})
                    _log(f"{label}: mean TTFT {_ms(figures['mean_ttft_ms'])}, p99 "
                         f"{_ms(figures['p99_ttft_ms'])}, {_num(figures['request_throughput'])}"
                         f" req/s")
    finally:
        for s in servers.values():
            s.stop()
            if s.removed_regions:  # vLLM leaves its native host region behind
                _log(f"removed the host region(s) the server left: {', '.join(s.removed_regions)}")
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    report = {"cpu": cpu_line(), "dtype": dtype, "model": model.name, "arms": arms,
              "datasets": datasets, "passes": passes, "workload": asdict(w),
              "gpu_blocks": gpu_blocks(w), "server_args": server_args(w),
              "max_model_len": max_model_len(w), "runs": runs,
              "summary": summarize(runs, arms, judged_metrics(w)), "errors": errors,
              "wall_s": time.monotonic() - t0}
    return emit(report, args, render)


if __name__ == "__main__":
    sys.exit(main())
