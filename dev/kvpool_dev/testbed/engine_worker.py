"""Child process behind `OfflineEngine`: owns a `vllm.LLM`, answers JSON requests on stdin.

Replies are single lines prefixed with `KVPOOL_REPLY ` on stdout, so anything vLLM prints
there cannot be mistaken for a reply.
"""

from __future__ import annotations

import json
import os
import sys
import time


def _reply(msg: dict) -> None:
    sys.stdout.write("KVPOOL_REPLY " + json.dumps(msg) + "\n")
    sys.stdout.flush()


def metrics_snapshot(llm) -> list[dict]:
    """vLLM's Prometheus metrics of this engine (`LLM.get_metrics`, needs
    `disable_log_stats=False`) as JSON: counters and gauges with `value`, histograms with
    `count` and `sum`."""
    out = []
    for m in llm.get_metrics():
        entry = {"name": m.name, "labels": dict(m.labels)}
        if hasattr(m, "value"):
            entry["value"] = m.value
        elif hasattr(m, "count"):
            entry.update(count=m.count, sum=m.sum)
        else:
            entry["values"] = list(getattr(m, "values", []))
        out.append(entry)
    return out + kvpool_metrics()


def kvpool_metrics() -> list[dict]:
    """kvpool's own series (`kvpool_*`, both modes) in metrics_snapshot's format: vLLM's
    `get_metrics` reads only `vllm:` names from the same Prometheus registry."""
    from prometheus_client import REGISTRY

    out: list[dict] = []
    for metric in REGISTRY.collect():
        if not metric.name.startswith("kvpool_"):
            continue
        hist: dict[tuple, dict] = {}
        for s in metric.samples:
            labels = {k: v for k, v in s.labels.items() if k != "le"}
            if (metric.type == "counter" and s.name.endswith("_total")) or metric.type == "gauge":
                out.append({"name": metric.name, "labels": labels, "value": s.value})
            elif metric.type == "histogram" and s.name.endswith(("_count", "_sum")):
                entry = hist.setdefault(tuple(sorted(labels.items())),
                                        {"name": metric.name, "labels": labels})
                entry[s.name.rsplit("_", 1)[1]] = s.value
        out += hist.values()
    return out


def _lora_request(spec: dict):
    from vllm.lora.request import LoRARequest

    return LoRARequest(spec["name"], int(spec["id"]), spec["path"])


def preload() -> None:
    """What every engine imports before it starts (a zygote imports it once: zygote.py)."""
    import gc

    from vllm import LLM, SamplingParams  # noqa: F401 - vllm's lazy names, imported

    # Everything imported so far lives as long as the process: out of the collector's
    # sight, the gc.collect() calls of vLLM's start cost ~0.1 s instead of ~2.5 s.
    gc.freeze()


def main(args: dict | None = None) -> None:
    """Serve one engine: `args` (default: the JSON in argv[1]) as OfflineEngine sends them."""
    if args is None:
        args = json.loads(sys.argv[1])
    preload()
    from vllm import LLM, SamplingParams

    kwargs = dict(args["llm_kwargs"])
    if args.get("kv_transfer_config") is not None:
        kwargs["kv_transfer_config"] = args["kv_transfer_config"]
    if isinstance(kwargs.get("kv_events_config"), dict):  # LLM() converts only the first
        from vllm.config.kv_events import KVEventsConfig

        kwargs["kv_events_config"] = KVEventsConfig(**kwargs["kv_events_config"])
    llm = LLM(model=args["model"], **kwargs)
    _reply({"ready": True})
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            if req.get("metrics"):
                _reply({"metrics": metrics_snapshot(llm)})
                continue
            # a prompt: token ids, or {"prompt_token_ids": [...], "cache_salt": "...",
            # "kv_transfer_params": {...}, "lora": {"name", "id", "path"}} (the transfer
            # params go into its SamplingParams, the adapter into its LoRARequest)
            prompts = [dict(p) if isinstance(p, dict) else {"prompt_token_ids": p}
                       for p in req["prompts"]]
            params, loras = [], []
            for p in prompts:
                lora = p.pop("lora", None)
                loras.append(_lora_request(lora) if lora else None)
                xfer = p.pop("kv_transfer_params", None)
                params.append(SamplingParams(
                    max_tokens=req.get("max_tokens", 16), temperature=0.0, ignore_eos=True,
                    logprobs=req.get("logprobs") or None,
                    prompt_logprobs=0 if req.get("prompt_logprobs") else None,
                    extra_args={"kv_transfer_params": xfer} if xfer else None))
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False,
                                lora_request=loras if any(loras) else None)
            elapsed = time.perf_counter() - t0
            result = []
            for o in outs:
                m = o.metrics
                ttft = None
                if m is not None and getattr(m, "first_token_latency", None) is not None:
                    ttft = m.first_token_latency
                lps = o.outputs[0].logprobs or []
                # each prompt token's own logprob (None for the first: nothing precedes it)
                plps = [None if pos is None else pos[tok].logprob
                        for tok, pos in zip(o.prompt_token_ids or [], o.prompt_logprobs or [],
                                            strict=False)]
                result.append({"prompt_logprobs": plps,"token_ids": list(o.outputs[0].token_ids),
                               "logprobs": [[[t, lp.logprob] for t, lp in pos.items()]
                                            for pos in lps],
                               "num_cached_tokens": o.num_cached_tokens or 0,
                               "kv_transfer_params": o.kv_transfer_params,
                               "ttft_s": ttft, "batch_s": elapsed})
            _reply({"outputs": result})
        except Exception as exc:  # report, keep serving: the caller decides
            _reply({"error": f"{type(exc).__name__}: {exc}"})
    # stdin closed: shut the engine down in order (its KV connector flushes and closes its
    # stores), then exit at once. The interpreter's own teardown of torch and vLLM after
    # that took 2.5 of the 3.8 s an engine stop cost, and releases nothing the OS does not.
    llm.llm_engine.engine_core.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
