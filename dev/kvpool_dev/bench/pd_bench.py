"""`kvpool bench pd`: prefill/decode disaggregation through the pool against colocated
engines on the same cores, and vLLM's own NixlConnector as the anchor (issue 25).

Arms, one after another in one run, each engine pinned to its cores (`taskset` for every
process of the server, `VLLM_CPU_OMP_THREADS_BIND` for its compute threads):
  colo1      one plain engine on both cores (0 and 1)
  colo2      two plain engines, one core each, behind vllm-router (round robin)
  pd-kvpool  a prefill engine on core 0, a decode engine on core 1, the KV handed over
             through a shared Redis (the connector's handover, connector/handover.py)
  pd-nixl    the same with vLLM's NixlConnector (DRAM to DRAM over UCX on the CPU
             platform, the nixl-cu12 wheel); if it does not start, its one-line reason
             is reported and the run goes on. NIXL runs as vLLM configures it, with its
             progress thread, which busy-polls beside the forward (vLLM reserves a core for
             it on the CPU platform): on one core per engine it halved the prefill engine
             (a 1024-token prefill 3.3 s with it, 1.3 s without, under load).
             --nixl-no-progress-thread turns it off; then a transfer moves only when both
             engines poll, between their steps (the hop took seconds behind a prefill)
Redis and the bench's client run unpinned (their cost falls on both cores alike). Threads
an engine moves off its cores by itself are put back before the run (pin_group) and
reported.

Workload: long prompts (--prompt-min..--prompt-max tokens, token ids drawn at random, each
prompt new to every cache) arriving every --interval seconds while --decoders short-prompt
requests keep decoding (one after another, --decode-len tokens each, until the last long
request is done): the decode steps the long prompts' prefills interrupt are what the
inter-token latency shows. Every request streams (`/v1/completions`, ignore_eos).

The P/D arms' requests go prefill first (`max_tokens: 1`, non-streaming, the
`kv_transfer_params` vllm-router's P/D mode sends), then decode (streaming, with the
prefill's `kv_transfer_params` as returned): what vllm-router's P/D mode does (it forwards
them verbatim, src/routers/http/vllm_pd_router.rs; tests/operator/test_router_discovery.py
runs it), done by the bench's client itself so that each stage is timed (the router
reports neither stage) and both P/D arms are driven alike.

Per arm: TTFT p50/p99 of the long requests (request sent -> first token; P/D: prefill
included), inter-token latency p50/p99 over every stream, prompt tokens the decode side
computed per request (prompt tokens - cached tokens, from the usage of the decode
engine's response), and for P/D the handover: the decode stage's time to its first token
(the KV's hop from the pool or the prefill engine + the blocks past the last whole one + one
decode step), with the prefill stage's time beside it. The kvpool arm also reports the
decode engine's kvpool_handover_* counters.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import random
import shutil
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from kvpool_dev.bench import kv_configs
from kvpool_dev.bench.completions import complete, computed_of, stream

ARMS = ("colo1", "colo2", "pd-kvpool", "pd-nixl")
PD_ARMS = ("pd-kvpool", "pd-nixl")
BLOCK_SIZE = 32
REDIS_PASSWORD_ENV = "KVPOOL_BENCH_REDIS_PASSWORD"
HANDOVER_WAIT_S = 10.0
# what vllm-router's P/D mode (and llm-d's nixlv2 sidecar) put on the prefill request
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False,
                  "remote_engine_id": None, "remote_block_ids": None, "remote_host": None,
                  "remote_port": None}
HANDOVER_COUNTERS = ("kvpool_handovers_total", "kvpool_handover_hits_total",
                     "kvpool_handover_timeouts_total", "kvpool_handover_rejected_total",
                     "kvpool_handover_write_failures_total",
                     "kvpool_prompt_tokens_computed_total", "kvpool_loaded_bytes_total")


@dataclass(frozen=True)
class Workload:
    requests: int = 12           # long-prompt requests
    prompt_min: int = 2048
    prompt_max: int = 8192
    output_len: int = 64         # tokens each long request generates
    interval_s: float = 12.0     # between long-prompt arrivals
    decoders: int = 2            # short-prompt streams decoding all along
    decoder_prompt: int = 128
    decode_len: int = 128        # tokens per decoder request
    seed: int = 0
    vocab: int = 32768


QUICK = Workload(requests=4, prompt_min=256, prompt_max=1024, output_len=16, interval_s=0.8,
                 decoders=1, decoder_prompt=64, decode_len=32)


def max_model_len(w: Workload) -> int:
    longest = max(w.prompt_max + w.output_len, w.decoder_prompt + w.decode_len)
    return -(-(longest + 64) // BLOCK_SIZE) * BLOCK_SIZE


def plan(w: Workload) -> list[dict[str, Any]]:
    """The long requests: arrival (s after the start), prompt token ids (pure, seeded)."""
    rng = random.Random(w.seed)
    out = []
    for i in range(w.requests):
        n = rng.randint(w.prompt_min, w.prompt_max)
        out.append({"i": i, "at": i * w.interval_s,
                    "prompt": [rng.randrange(100, w.vocab) for _ in range(n)]})
    return out


def decoder_prompt(w: Workload, decoder: int, k: int) -> list[int]:
    """The k-th request of a background decoder: a prompt no other request shares (pure)."""
    rng = random.Random(f"{w.seed}-{decoder}-{k}")
    return [rng.randrange(100, w.vocab) for _ in range(w.decoder_prompt)]


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks, as numpy's default (pure)."""
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


STALL_S = 0.5  # an inter-token gap this long is a stall (a prefill step in the stream's way)


def arm_figures(requests: list[dict[str, Any]]) -> dict[str, Any]:
    """One arm's figures from its requests' records (pure): TTFT of the long requests, the
    inter-token gaps of every stream, decode-side computed prompt tokens, the P/D stages."""
    long = [r for r in requests if r["kind"] == "long" and r.get("ok")]
    done = [r for r in requests if r.get("ok")]
    ttft = [r["ttft_s"] for r in long]
    itl = [g for r in done for g in r["itl_s"]]
    computed = [r["decode_computed"] for r in done if r.get("decode_computed") is not None]
    computed_long = [r["decode_computed"] for r in long
                     if r.get("decode_computed") is not None]
    hop = [r["decode_ttft_s"] for r in long if r.get("decode_ttft_s") is not None]
    prefill = [r["prefill_s"] for r in long if r.get("prefill_s") is not None]

    def ms(values: list[float], q: float) -> float | None:
        v = percentile(values, q)
        return None if v is None else v * 1000

    return {
        "long_done": len(long), "requests_done": len(done),
        "failed": sum(1 for r in requests if not r.get("ok")),
        "ttft_p50_ms": ms(ttft, 50), "ttft_p99_ms": ms(ttft, 99),
        "itl_p50_ms": ms(itl, 50), "itl_p99_ms": ms(itl, 99), "itl_count": len(itl),
        "itl_max_ms": max(itl) * 1000 if itl else None,
        "itl_p999_ms": ms(itl, 99.9),
        # gaps a reader sees as the stream freezing: how many, whatever share of the
        # gaps they are (p99 sees them only above 1% of the gaps)
        "stalls": sum(1 for g in itl if g >= STALL_S),
        "decode_computed_max": max(computed) if computed else None,
        "decode_computed_mean": sum(computed) / len(computed) if computed else None,
        "decode_computed_long_mean": (sum(computed_long) / len(computed_long)
                                      if computed_long else None),
        "prompt_tokens_long_mean": (sum(r["prompt_tokens"] for r in long) / len(long)
                                    if long else None),
        "handover_p50_ms": ms(hop, 50), "handover_p99_ms": ms(hop, 99),
        "prefill_p50_ms": ms(prefill, 50), "prefill_p99_ms": ms(prefill, 99),
    }


def verdicts(figures: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The issue's goals, judged on the arms that ran (pure); None where an arm is missing.
    - decode-side prompt tokens computed <= 1 per request (pd-kvpool)
    - ITL p99 of pd-kvpool at least 2x lower than colo2's (same cores, no interference)
    - kvpool's hop at least as fast as NIXL's (handover p50: decode stage's first token)"""
    kv, colo2, nixl = figures.get("pd-kvpool"), figures.get("colo2"), figures.get("pd-nixl")
    out: dict[str, Any] = {"decode_computed_le_1": None, "itl_p99_ratio_vs_colo2": None,
                           "itl_p99_2x_lower": None, "hop_vs_nixl": None,
                           "hop_at_least_as_fast_as_nixl": None}
    if kv and kv.get("decode_computed_max") is not None:
        out["decode_computed_le_1"] = kv["decode_computed_max"] <= 1
    if kv and colo2 and kv.get("itl_p99_ms") and colo2.get("itl_p99_ms"):
        r = colo2["itl_p99_ms"] / kv["itl_p99_ms"]
        out["itl_p99_ratio_vs_colo2"] = r
        out["itl_p99_2x_lower"] = r >= 2.0
    if kv and nixl and kv.get("handover_p50_ms") and nixl.get("handover_p50_ms"):
        r = nixl["handover_p50_ms"] / kv["handover_p50_ms"]
        out["hop_vs_nixl"] = r
        out["hop_at_least_as_fast_as_nixl"] = r >= 1.0
    return out


def transfer_config(arm: str, namespace: str, redis_url: str = "",
                    role: str = "prefill") -> dict[str, Any] | None:
    """The arm's --kv-transfer-config for one role (pure): kvpool's the same for prefill and
    decode but for `handover_requests` on the prefill engine, as the operator renders them;
    NIXL's producer and consumer, as vLLM asks (kv_both is deprecated there)."""
    if arm in ("colo1", "colo2"):
        return None
    if arm == "pd-kvpool":
        return kv_configs.kvpool_config(
            [kv_configs.cpu_tier("512Mi"), kv_configs.redis_tier(redis_url, REDIS_PASSWORD_ENV)],
            namespace, handover_wait_seconds=HANDOVER_WAIT_S,
            **({"handover_requests": True} if role == "prefill" else {}))
    if arm == "pd-nixl":
        # the CPU platform registers its paged cache with NIXL as DRAM (base_worker.py)
        return {"kv_connector": "NixlConnector",
                "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
                "kv_buffer_device": "cpu", "kv_connector_extra_config": {"backends": ["UCX"]}}
    raise ValueError(f"--arms: unknown arm {arm!r}; choose from {', '.join(ARMS)}")


def engine_layout(arm: str, cores: list[int]) -> list[tuple[str, str]]:
    """(role, cores as taskset writes them) per engine of the arm (pure)."""
    a, b = str(cores[0]), str(cores[1])
    if arm == "colo1":
        return [("colocated", f"{a},{b}")]
    if arm == "colo2":
        return [("colocated-0", a), ("colocated-1", b)]
    return [("prefill", a), ("decode", b)]


NIXL_PROG_THREAD_ENV = "KVPOOL_BENCH_NIXL_PROG_THREAD"
NIXL_API_SHIM = f"""from nixl_cu12._api import *  # noqa: F403
import os as _os
from nixl_cu12._api import nixl_agent, nixl_agent_config as _config  # noqa: F401


class nixl_agent_config(_config):
    \"\"\"{NIXL_PROG_THREAD_ENV}=0: no progress thread (vLLM does not expose the flag).\"\"\"

    def __init__(self, *args, **kwargs):
        if _os.environ.get("{NIXL_PROG_THREAD_ENV}") == "0":
            kwargs.setdefault("enable_prog_thread", False)
        super().__init__(*args, **kwargs)
"""


def nixl_shim(into: Path) -> Path | None:
    """vLLM imports `nixl._api`; the `nixl-cu12` wheel installs `nixl_cu12` (PyPI's `nixl`
    is a meta package that pulls a second, CUDA 13 build). A two-line `nixl` package that
    re-exports `nixl_cu12`, put on the NIXL engines' PYTHONPATH only. None when neither
    imports."""
    import importlib.util

    if importlib.util.find_spec("nixl") is not None:
        return into  # nothing to add
    if importlib.util.find_spec("nixl_cu12") is None:
        return None
    pkg = into / "nixl"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("from nixl_cu12 import *  # noqa: F403\n")
    (pkg / "_api.py").write_text(NIXL_API_SHIM)
    (pkg / "_bindings.py").write_text("from nixl_cu12._bindings import *  # noqa: F403\n")
    return into


def one_request(arm: str, urls: dict[str, str], prompt: list[int], max_tokens: int,
                kind: str) -> dict[str, Any]:
    """A request as the arm serves it, timed: colocated straight to `urls["serve"]`, P/D
    prefill then decode (see the module docstring)."""
    rec: dict[str, Any] = {"kind": kind, "prompt_tokens": len(prompt), "ok": False}
    try:
        t0 = time.perf_counter()
        params = None
        if arm in PD_ARMS:
            pre = complete(urls["prefill"], prompt, 1, PREFILL_PARAMS)
            params = pre.get("kv_transfer_params")
            rec["prefill_s"] = time.perf_counter() - t0
            rec["handed_over"] = bool(params)
        s = stream(urls["decode"] if arm in PD_ARMS else urls["serve"], prompt, max_tokens,
                   params)
        if not s["times"]:
            raise RuntimeError("no token streamed")
        rec["ttft_s"] = s["times"][0] - t0
        rec["itl_s"] = [b - a for a, b in zip(s["times"], s["times"][1:], strict=False)]
        rec["tokens"] = len(s["times"])
        if arm in PD_ARMS:
            rec["decode_ttft_s"] = s["times"][0] - s["t0"]
        # NIXL's decode reports the prefill engine's cache hits as its own cached tokens
        # (vLLM's scheduler, remote_prefill_cached_tokens): only the engine counter tells
        rec["decode_computed"] = None if arm == "pd-nixl" else computed_of(s["usage"])
        rec["ok"] = True
    except (OSError, RuntimeError, ValueError, http.client.HTTPException) as exc:
        rec["error"] = f"{type(exc).__name__}: {exc}"[:300]
    return rec


def drive(arm: str, urls: dict[str, str], w: Workload) -> list[dict[str, Any]]:
    """The workload against one arm: the long requests at their arrival times, the
    decoders all along until the last long request is done."""
    records: list[dict[str, Any]] = []
    lock = threading.Lock()
    done = threading.Event()

    def keep(rec: dict[str, Any]) -> None:
        with lock:
            records.append(rec)

    def decoder(d: int) -> None:
        k = 0
        while not done.is_set():
            keep(one_request(arm, urls, decoder_prompt(w, d, k), w.decode_len, "decoder"))
            k += 1

    t0 = time.perf_counter()

    def long_request(item: dict[str, Any]) -> None:
        time.sleep(max(0.0, t0 + item["at"] - time.perf_counter()))
        rec = one_request(arm, urls, item["prompt"], w.output_len, "long")
        rec["i"] = item["i"]
        keep(rec)

    decoders = [threading.Thread(target=decoder, args=(d,), daemon=True)
                for d in range(w.decoders)]
    longs = [threading.Thread(target=long_request, args=(item,), daemon=True)
             for item in plan(w)]
    for t in decoders + longs:
        t.start()
    for t in longs:
        t.join()
    done.set()
    for t in decoders:
        t.join()
    return records


# -- rendering ---------------------------------------------------------------------------------


def render(report: dict[str, Any]) -> str:
    """The human table (pure)."""
    w = report["workload"]
    out = [f"kvpool bench pd: {report['cpu']}, dtype {report['dtype']}, model {report['model']}, "
           f"cores {report['cores']}; {w['requests']} prompts of {w['prompt_min']}-"
           f"{w['prompt_max']} tokens every {w['interval_s']} s, {w['output_len']} output "
           f"tokens each, {w['decoders']} decoders ({w['decoder_prompt']}-token prompts, "
           f"{w['decode_len']} tokens); --block-size {BLOCK_SIZE}; NIXL progress thread "
           f"{'on' if report.get('nixl_progress_thread') else 'off'}", ""]
    head = (f"  {'arm':<10}{'engines':<30}{'TTFT p50':>10}{'p99':>9}{'ITL p50':>9}"
            f"{'p99':>8}{'max':>9}{'computed max/mean':>19}{'engine':>8}{'handover p50/p99':>18}"
            f"{'prefill p50':>12}")
    out.append(head)
    for arm in report["arms"]:
        if arm not in report["figures"]:
            continue
        f = report["figures"][arm]
        engines = " ".join(f"{r}@{c}" for r, c in report["layout"][arm])
        computed = ("-" if f["decode_computed_max"] is None else
                    f"{f['decode_computed_max']}/{f['decode_computed_mean']:.1f}")
        eng = f.get("decode_computed_engine_mean")
        hop = ("-" if f["handover_p50_ms"] is None else
               f"{_ms(f['handover_p50_ms'])}/{_ms(f['handover_p99_ms'])}")
        out.append(f"  {arm:<10}{engines:<30}{_ms(f['ttft_p50_ms']):>10}"
                   f"{_ms(f['ttft_p99_ms']):>9}{_ms(f['itl_p50_ms']):>9}"
                   f"{_ms(f['itl_p99_ms']):>8}{_ms(f.get('itl_max_ms')):>9}{computed:>19}"
                   f"{'-' if eng is None else f'{eng:.1f}':>8}{hop:>18}"
                   f"{_ms(f['prefill_p50_ms']):>12}")
    out.append("")
    out.append("  TTFT: long prompts, request sent -> first token (P/D: prefill stage "
               "included); ITL: every stream; computed: prompt tokens the serving (P/D: "
               "decode) engine computed per request, from each response's usage (max/mean) "
               "and from the engine's vllm:prompt_tokens_by_source local_compute (mean); "
               "handover: the decode stage's first token (P/D)")
    out.append(f"  stalls (gaps of {STALL_S * 1000:.0f} ms or more) and ITL p99.9: " + "; ".join(
        f"{arm} {f['stalls']} of {f['itl_count']}, {_ms(f.get('itl_p999_ms'))}"
        for arm, f in report["figures"].items() if f.get("stalls") is not None))
    for arm, f in report["figures"].items():
        pinned = dict(report["layout"][arm])
        for r, c in (f.get("escaped_at_start") or {}).items():
            out.append(f"  {arm}: {r}'s threads had left core(s) {pinned[r]} for {c} by "
                       f"themselves; {f['repinned_threads'].get(r, 0)} put back before the run")
        moved = {r: c for r, c in (f.get("affinity") or {}).items() if pinned.get(r) != c}
        if moved:
            out.append(f"  {arm}: threads left their cores during the run: "
                       + ", ".join(f"{r} may run on {c} (pinned {pinned[r]})"
                                   for r, c in moved.items()))
    kv = report.get("counters", {}).get("pd-kvpool")
    if kv:
        out.append("  pd-kvpool counters: " + ", ".join(
            f"{k.removesuffix('_total')} {v:g}" for k, v in kv.items()
            if not k.startswith("reads:")))
    parts = (report["figures"].get("pd-kvpool") or {}).get("hop_parts")
    if parts:
        reads = ", ".join(f"{k.split(':')[1]} {v:.0f} ms" for k, v in parts.items()
                          if k.startswith("read_ms:"))
        out.append(f"  pd-kvpool hop, per decode request: {parts['loaded_mib']:.1f} MiB "
                   f"loaded; the store's reads took {reads or 'no time recorded'} (the rest "
                   f"of the handover p50: the lookups, the copy into the paged cache, the "
                   f"steps the request waits)")
    v = report["verdicts"]
    yn = {True: "yes", False: "no", None: "n/a"}
    out.append(f"  decode-side prompt tokens computed <= 1 per request: "
               f"{yn[v['decode_computed_le_1']]}")
    ratio = v["itl_p99_ratio_vs_colo2"]
    out.append(f"  ITL p99 at least 2x lower than colo2: {yn[v['itl_p99_2x_lower']]}"
               + (f" ({ratio:.2f}x)" if ratio else ""))
    hop = v["hop_vs_nixl"]
    out.append(f"  kvpool's hop at least as fast as NIXL's: "
               f"{yn[v['hop_at_least_as_fast_as_nixl']]}" + (f" ({hop:.2f}x)" if hop else ""))
    for arm, why in report.get("skipped", {}).items():
        out.append(f"arm {arm} did not start: {why}")
    for arm, err in report.get("errors", {}).items():
        out.append(f"arm {arm} FAILED: {err}")
    return "\n".join(out).rstrip()


def _ms(v: float | None) -> str:
    return "-" if v is None or not math.isfinite(v) else f"{v:.0f} ms"


def first_error_line(text: str) -> str:
    """The line of a log tail that says why (pure): the last line naming an error, else
    the last line."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    for ln in reversed(lines):
        if any(k in ln for k in ("Error", "error", "Exception", "not supported")):
            return ln[-400:]
    return lines[-1][-400:] if lines else ""


# -- I/O shell -------------------------------------------------------------------------------


def _log(msg: str) -> None:
    print(f"[bench pd {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def pinned_server(model: Path, cores: str, kv_transfer_config: dict | None, env: dict,
                  w: Workload, dtype: str, log_path: Path):
    """A VllmServer whose every process runs on `cores` (taskset) and computes with one
    OpenMP thread per core there."""
    from kvpool_dev.testbed.engine import VllmServer

    class PinnedServer(VllmServer):
        def command(self) -> list[str]:
            return ["taskset", "-c", cores, *super().command()]

    return PinnedServer(model, kv_transfer_config=kv_transfer_config,
                        extra_args=["--block-size", str(BLOCK_SIZE)],
                        env={**env, "VLLM_CPU_OMP_THREADS_BIND": cores},
                        max_model_len=max_model_len(w), dtype=dtype, log_path=log_path)


def prompt_sources(text: str) -> dict[str, float]:
    """vLLM's `vllm:prompt_tokens_by_source_total` per source (local_compute,
    local_cache_hit, external_kv_transfer), summed over its other labels (pure)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:prompt_tokens_by_source_total{"):
            continue
        labels, _, value = line.rpartition("} ")
        for part in labels.split("{", 1)[1].split(","):
            key, _, val = part.partition("=")
            if key.strip() == "source":
                src = val.strip().strip('"')
                out[src] = out.get(src, 0.0) + float(value)
    return out


def store_reads(text: str) -> dict[str, float]:
    """The store's reads (`kvpool_store_op_seconds{op="get"}`) per tier: seconds in all
    (`reads:<tier>:s`) and calls (`reads:<tier>:n`), summed over stores (pure)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        for suffix, key in (("_sum{", "s"), ("_count{", "n")):
            if not line.startswith("kvpool_store_op_seconds" + suffix):
                continue
            labels, _, value = line.rpartition("} ")
            fields = dict(part.partition("=")[::2] for part in
                          labels.split("{", 1)[1].split(","))
            fields = {k.strip(): v.strip().strip('"') for k, v in fields.items()}
            if fields.get("op") == "get" and fields.get("tier"):
                name = f"reads:{fields['tier']}:{key}"
                out[name] = out.get(name, 0.0) + float(value)
    return out


def hop_parts(delta: dict[str, float], served: int) -> dict[str, float] | None:
    """Per decode request: MiB loaded and seconds the store's reads took, by tier (pure)."""
    if not served or not delta.get("kvpool_loaded_bytes_total"):
        return None
    out = {"loaded_mib": delta["kvpool_loaded_bytes_total"] / served / (1 << 20)}
    for k, v in delta.items():
        if k.startswith("reads:") and k.endswith(":s"):
            out[f"read_ms:{k.split(':')[1]}"] = v / served * 1000
    return out


def parse_cpu_list(text: str) -> set[int]:
    """"0-2,5" -> {0, 1, 2, 5} (pure)."""
    out: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def group_cpus(pgid: int) -> set[int]:
    """The cores any thread of a process group may run on (Cpus_allowed_list of every task):
    where an engine actually computes, whatever it set itself after the start."""
    from kvpool_dev.testbed.process import group_pids

    cpus: set[int] = set()
    for pid in group_pids(pgid):
        for status in Path(f"/proc/{pid}/task").glob("*/status"):
            try:
                for line in status.read_text().splitlines():
                    if line.startswith("Cpus_allowed_list:"):
                        cpus |= parse_cpu_list(line.split(":", 1)[1])
            except OSError:
                continue
    return cpus


def pin_group(pgid: int, cpus: set[int]) -> int:
    """Put every thread of a process group that may run outside `cpus` back on them; how
    many were. vLLM's
    NixlConnector on the CPU platform moves its worker's main thread, which runs the
    forward, onto the last core of the NUMA node (base_worker.py: a core reserved for KV
    transfers), here the other engine's core: left there, the NIXL prefill engine computed
    on the decode engine's core (5x slower prefills in a run under load)."""
    from kvpool_dev.testbed.process import group_pids

    moved = 0
    for pid in group_pids(pgid):
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                tid = int(task.name)
                if not os.sched_getaffinity(tid) <= cpus:  # vLLM binds each OMP thread
                    # to one core of its engine's: those stay as they are
                    os.sched_setaffinity(tid, cpus)
                    moved += 1
            except (OSError, ValueError):
                continue  # a thread that ended meanwhile
    return moved


def scrape(base_url: str) -> dict[str, float]:
    """The connector counters and vLLM's prompt tokens by source of one engine."""
    from kvpool_dev.bench.serve_bench import counters

    try:
        with urllib.request.urlopen(base_url + "/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return {}
    return {**counters(text), **{f"source:{k}": v for k, v in prompt_sources(text).items()},
            **store_reads(text)}


def warm_up(url: str) -> None:
    """One short plain request per engine: first-call costs out of the timed run."""
    rec = one_request("colo1", {"serve": url}, list(range(100, 164)), 2, "warmup")
    if not rec.get("ok"):
        raise RuntimeError(f"warm-up request failed: {rec.get('error')}")


def run_arm(arm: str, model: Path, w: Workload, cores: list[int], dtype: str, workdir: Path,
            namespace: str, nixl_progress_thread: bool = True
            ) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, float]]:
    """Start the arm's engines (and Redis, the router), drive the workload, stop them."""
    from kvpool_dev.testbed.router import VllmRouter
    from kvpool_dev.testbed.servers import RedisServer

    redis = router = None
    servers = []
    env: dict[str, str] = {}
    try:
        if arm == "pd-kvpool":
            redis = RedisServer(maxmemory="2gb").start()
            env = {**kv_configs.pool_key_env(), REDIS_PASSWORD_ENV: redis.password}
        layout = engine_layout(arm, cores)
        for role, c in layout:
            cfg = transfer_config(arm, namespace, redis.url if redis else "", role)
            extra = dict(env)
            if arm == "pd-nixl":
                shim = nixl_shim(workdir / "nixl-shim")
                if shim is None:
                    raise RuntimeError("neither nixl nor nixl_cu12 imports "
                                       "(uv pip install nixl-cu12)")
                extra.update({"PYTHONPATH": os.pathsep.join(
                    [str(shim), *filter(None, [os.environ.get("PYTHONPATH")])]),
                    "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                    "VLLM_NIXL_SIDE_CHANNEL_PORT": str(_free_port()),
                    NIXL_PROG_THREAD_ENV: "1" if nixl_progress_thread else "0"})
            servers.append(pinned_server(model, c, cfg, extra, w, dtype,
                                         workdir / f"{arm}-{role}.log"))
        for s in servers:
            s.launch()
        for s in servers:
            s.wait_ready()
        # where the engines put their threads themselves, then every thread on its cores
        escaped = {role: ",".join(map(str, sorted(group_cpus(s.proc.pid))))
                   for (role, c), s in zip(layout, servers, strict=True)
                   if s.proc is not None and not group_cpus(s.proc.pid) <= parse_cpu_list(c)}
        repinned = {role: pin_group(s.proc.pid, parse_cpu_list(c))
                    for (role, c), s in zip(layout, servers, strict=True) if s.proc is not None}
        for s in servers:
            warm_up(s.base_url)
        if arm == "colo2":
            router = VllmRouter([s.base_url for s in servers], "round_robin",
                                log_path=workdir / "router.log").start()
            urls = {"serve": router.base_url}
        elif arm == "colo1":
            urls = {"serve": servers[0].base_url}
        else:
            urls = {"prefill": servers[0].base_url, "decode": servers[1].base_url}
            # one handover end to end before the clock: the connectors' first transfer
            warm = one_request(arm, urls, list(range(200, 200 + 3 * BLOCK_SIZE + 5)), 2,
                               "warmup")
            if not warm.get("ok"):
                raise RuntimeError(f"warm-up P/D request failed: {warm.get('error')}")
        # the engines that serve the tokens: the decode engine of a P/D pair
        serving = servers[1:] if arm in PD_ARMS else servers
        before = [scrape(s.base_url) for s in serving]
        _log(f"{arm}: engines up ({', '.join(f'{r}@{c}' for r, c in layout)}), driving")
        records = drive(arm, urls, w)
        delta: dict[str, float] = {}
        for s, b in zip(serving, before, strict=True):
            for k, v in scrape(s.base_url).items():
                if k in HANDOVER_COUNTERS or k.startswith(("source:", "reads:")):
                    delta[k] = delta.get(k, 0.0) + v - b.get(k, 0.0)
        figures = arm_figures(records)
        served = figures["requests_done"]
        figures["decode_computed_engine_mean"] = (delta.get("source:local_compute", 0.0) / served
                                                  if served else None)
        if arm == "pd-kvpool":  # where the hop's time goes: the bytes and the store's reads
            figures["hop_parts"] = hop_parts(delta, served)
        # where each engine's threads may run at the end (after pin_group: its own cores
        # unless it moved a thread again), where they had gone by themselves at the start
        figures["affinity"] = {role: ",".join(map(str, sorted(group_cpus(s.proc.pid))))
                               for (role, _), s in zip(layout, servers, strict=True)
                               if s.proc is not None}
        figures["escaped_at_start"] = escaped
        figures["repinned_threads"] = {r: n for r, n in repinned.items() if n}
        return figures, records, delta
    finally:
        if router is not None:
            router.stop()
        for s in servers:
            s.stop()
        if redis is not None:
            redis.stop()


def _free_port() -> int:
    from kvpool_dev.testbed.process import free_port

    return free_port()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvpool bench pd", description=(
        "prefill/decode through kvpool vs colocated engines on the same cores vs vLLM's "
        "NixlConnector: TTFT, inter-token latency, decode-side computed tokens, handover"))
    ap.add_argument("--quick", action="store_true",
                    help="tiny model, 4 prompts of 256-1024 tokens, 1 decoder (a smoke run)")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma list from {','.join(ARMS)}")
    ap.add_argument("--requests", type=int, default=None, help="long-prompt requests")
    ap.add_argument("--prompt-min", type=int, default=None)
    ap.add_argument("--prompt-max", type=int, default=None)
    ap.add_argument("--output-len", type=int, default=None)
    ap.add_argument("--interval", type=float, default=None,
                    help="seconds between long-prompt arrivals")
    ap.add_argument("--decoders", type=int, default=None,
                    help="short-prompt streams decoding all along")
    ap.add_argument("--nixl-no-progress-thread", action="store_true", help="run NIXL "
                    "without its progress thread (vLLM runs it with one, which busy-polls "
                    "beside the forward: vLLM reserves a core for it on the CPU platform, and on "
                    "one core per engine it halves the engine; without it a transfer moves "
                    "only when both engines poll, between their steps)")
    ap.add_argument("--model", default=None, help="model path (default: the generated bench "
                    "model; --quick: the tiny one)")
    ap.add_argument("--dtype", default=None, help="engine dtype (default: the test bed's "
                    "choice for this CPU)")
    ap.add_argument("--json-out", default=None, help="write the report here as JSON")
    ap.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    ap.add_argument("--workdir", default=None, help="server logs (default: a temp dir, "
                    "removed)")
    args = ap.parse_args(argv)

    from kvpool_dev.bench.serve_bench import check_paths, cpu_line, emit
    from kvpool_dev.testbed.dtype import DtypeError, engine_dtype
    from kvpool_dev.testbed.localmodel import ensure_model

    w = QUICK if args.quick else Workload()
    for field_, value in (("requests", args.requests), ("prompt_min", args.prompt_min),
                          ("prompt_max", args.prompt_max), ("output_len", args.output_len),
                          ("interval_s", args.interval), ("decoders", args.decoders)):
        if value is not None:
            if value < 0 or (value == 0 and field_ not in ("decoders", "interval_s")):
                flag = "--interval" if field_ == "interval_s" else f"--{field_.replace('_', '-')}"
                print(f"kvpool bench pd: {flag} must be positive", file=sys.stderr)
                return 2
            w = replace(w, **{field_: value})
    if w.prompt_min > w.prompt_max:
        print("kvpool bench pd: --prompt-min is above --prompt-max", file=sys.stderr)
        return 2
    arms = [a for a in args.arms.split(",") if a]
    cores = sorted(os.sched_getaffinity(0))
    try:
        for a in arms:
            transfer_config(a, "check")
        dtype = engine_dtype(args.dtype)
        check_paths(args)
    except (ValueError, DtypeError) as exc:
        print(f"kvpool bench pd: {exc}", file=sys.stderr)
        return 2
    if len(cores) < 2:
        print("kvpool bench pd: needs 2 cores to pin engines to (this process may use "
              f"{len(cores)})", file=sys.stderr)
        return 2
    if shutil.which("taskset") is None:
        print("kvpool bench pd: taskset not found (util-linux)", file=sys.stderr)
        return 2
    if "pd-kvpool" in arms and not kv_configs.kvpool_connector_available():
        print("kvpool bench pd: kvpool_connector.vllm.KVPoolConnector does not import",
              file=sys.stderr)
        return 2
    cores = cores[:2]
    model = Path(args.model) if args.model else ensure_model("tiny" if args.quick else "bench")
    vocab = json.loads((model / "config.json").read_text()).get("vocab_size", w.vocab)
    w = replace(w, vocab=min(w.vocab, int(vocab)))
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="kvpool-pd-"))
    workdir.mkdir(parents=True, exist_ok=True)
    namespace = f"bench-pd-{int(time.time())}"
    figures: dict[str, dict[str, Any]] = {}
    counters: dict[str, dict[str, float]] = {}
    errors: dict[str, str] = {}
    skipped: dict[str, str] = {}  # the NIXL anchor when it does not start: not a failure
    samples: dict[str, list[dict[str, Any]]] = {}
    t0 = time.monotonic()
    try:
        for arm in arms:
            _log(f"{arm}: starting")
            try:
                figures[arm], records, counters[arm] = run_arm(
                    arm, model, w, cores, dtype, workdir, namespace,
                    not args.nixl_no_progress_thread)
            except (RuntimeError, TimeoutError, OSError) as exc:
                (skipped if arm == "pd-nixl" else errors)[arm] = first_error_line(str(exc))
                _log(f"{arm} did not run: {first_error_line(str(exc))}")
                continue
            samples[arm] = [{k: v for k, v in r.items() if k != "itl_s"} for r in records]
            bad = [r for r in records if not r.get("ok")]
            if bad:
                errors[arm] = f"{len(bad)} request(s) failed: {bad[0].get('error')}"
            f = figures[arm]
            _log(f"{arm}: TTFT p50 {_ms(f['ttft_p50_ms'])} p99 {_ms(f['ttft_p99_ms'])}, "
                 f"ITL p50 {_ms(f['itl_p50_ms'])} p99 {_ms(f['itl_p99_ms'])}")
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    report = {"cpu": cpu_line(), "dtype": dtype, "model": model.name, "arms": arms,
              "cores": cores, "workload": asdict(w), "block_size": BLOCK_SIZE,
              "nixl_progress_thread": not args.nixl_no_progress_thread,
              "max_model_len": max_model_len(w),
              "layout": {a: engine_layout(a, cores) for a in arms},
              "figures": figures, "counters": {a: c for a, c in counters.items() if c},
              "verdicts": verdicts(figures), "errors": errors, "skipped": skipped,
              "requests": samples,
              "wall_s": time.monotonic() - t0}
    return emit(report, args, render)


if __name__ == "__main__":
    sys.exit(main())
