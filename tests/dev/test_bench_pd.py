"""`kvpool bench pd`'s pure parts: the workload plan, the engines' cores, the connector
configs per arm, the figures and verdicts, the metric parsers and the one-line errors for
bad input."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvpool_dev.bench import pd_bench as pb


def test_plan_is_seeded_and_within_the_prompt_range():
    w = pb.Workload(requests=5, prompt_min=100, prompt_max=300, interval_s=2.5, vocab=500)
    a, b = pb.plan(w), pb.plan(w)
    assert a == b and [r["at"] for r in a] == [0.0, 2.5, 5.0, 7.5, 10.0]
    assert all(100 <= len(r["prompt"]) <= 300 for r in a)
    assert all(100 <= t < 500 for r in a for t in r["prompt"])
    assert len({tuple(r["prompt"][:16]) for r in a}) == 5  # no shared prefixes
    assert pb.plan(pb.Workload(requests=5, prompt_min=100, prompt_max=300, seed=1)) != a
    # decoders' prompts: their own, never another request's
    assert pb.decoder_prompt(w, 0, 0) != pb.decoder_prompt(w, 0, 1) != pb.decoder_prompt(w, 1, 0)
    assert pb.max_model_len(w) % pb.BLOCK_SIZE == 0
    assert pb.max_model_len(w) >= w.prompt_max + w.output_len


def test_each_arm_pins_its_engines_to_the_two_cores():
    assert pb.engine_layout("colo1", [4, 7]) == [("colocated", "4,7")]
    assert pb.engine_layout("colo2", [4, 7]) == [("colocated-0", "4"), ("colocated-1", "7")]
    for arm in pb.PD_ARMS:
        assert pb.engine_layout(arm, [4, 7]) == [("prefill", "4"), ("decode", "7")]


def test_transfer_configs_per_arm():
    assert pb.transfer_config("colo1", "ns") is None and pb.transfer_config("colo2", "ns") is None
    pre = pb.transfer_config("pd-kvpool", "ns", "redis://127.0.0.1:1/0", "prefill")
    dec = pb.transfer_config("pd-kvpool", "ns", "redis://127.0.0.1:1/0", "decode")
    # one config for both roles, as the operator renders it, but for the prefill engine's
    # handover_requests (only it honours the router's ask for a handover)
    assert pre["kv_connector_extra_config"].pop("handover_requests") is True
    assert "handover_requests" not in dec["kv_connector_extra_config"]
    assert pre == dec
    extra = pre["kv_connector_extra_config"]
    assert [t["type"] for t in extra["tiers"]] == ["cpu", "redis"]
    assert extra["tiers"][1]["password_env"] == pb.REDIS_PASSWORD_ENV
    assert extra["handover_wait_seconds"] == pb.HANDOVER_WAIT_S
    nixl = {r: pb.transfer_config("pd-nixl", "ns", role=r) for r in ("prefill", "decode")}
    assert {c["kv_connector"] for c in nixl.values()} == {"NixlConnector"}
    assert nixl["prefill"]["kv_role"] == "kv_producer" and nixl["decode"]["kv_role"] == "kv_consumer"
    assert nixl["decode"]["kv_buffer_device"] == "cpu"
    with pytest.raises(ValueError, match="--arms: unknown arm 'bogus'"):
        pb.transfer_config("bogus", "ns")


def test_percentile_interpolates_like_numpy():
    assert pb.percentile([], 50) is None
    assert pb.percentile([3.0], 99) == 3.0
    assert pb.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert pb.percentile(list(map(float, range(101))), 99) == pytest.approx(99.0)


def _rec(kind, ttft, itl, computed, hop=None, prefill=None, ok=True, prompt=1000):
    return {"kind": kind, "ok": ok, "ttft_s": ttft, "itl_s": itl, "decode_computed": computed,
            "decode_ttft_s": hop, "prefill_s": prefill, "prompt_tokens": prompt}


def test_figures_take_ttft_from_long_requests_and_itl_from_every_stream():
    recs = [_rec("long", 1.0, [0.01, 0.02], 5, hop=0.1, prefill=0.9),
            _rec("long", 3.0, [0.03], 7, hop=0.3, prefill=2.7),
            _rec("decoder", 0.05, [0.5], 1),
            {"kind": "long", "ok": False, "error": "x"}]
    f = pb.arm_figures(recs)
    assert f["long_done"] == 2 and f["requests_done"] == 3 and f["failed"] == 1
    assert f["ttft_p50_ms"] == pytest.approx(2000.0)  # the decoder's 50 ms is not a TTFT
    assert f["itl_count"] == 4 and f["itl_p50_ms"] == pytest.approx(25.0)
    assert f["stalls"] == 1 and f["itl_max_ms"] == pytest.approx(500.0)  # the 0.5 s gap
    assert f["decode_computed_max"] == 7 and f["decode_computed_long_mean"] == 6
    assert f["handover_p50_ms"] == pytest.approx(200.0)
    assert f["prefill_p50_ms"] == pytest.approx(1800.0)
    colo = pb.arm_figures([_rec("long", 1.0, [0.01], 1000)])
    assert colo["handover_p50_ms"] is None and colo["prefill_p50_ms"] is None


def test_verdicts_judge_the_issue_goals_on_the_arms_that_ran():
    kv = {"decode_computed_max": 1, "itl_p99_ms": 20.0, "handover_p50_ms": 50.0}
    colo2 = {"decode_computed_max": 3000, "itl_p99_ms": 45.0, "handover_p50_ms": None}
    nixl = {"decode_computed_max": None, "itl_p99_ms": 25.0, "handover_p50_ms": 40.0}
    v = pb.verdicts({"pd-kvpool": kv, "colo2": colo2, "pd-nixl": nixl})
    assert v["decode_computed_le_1"] is True
    assert v["itl_p99_ratio_vs_colo2"] == pytest.approx(2.25) and v["itl_p99_2x_lower"] is True
    assert v["hop_vs_nixl"] == pytest.approx(0.8) and v["hop_at_least_as_fast_as_nixl"] is False
    v = pb.verdicts({"pd-kvpool": {**kv, "decode_computed_max": 31}, "colo2": colo2})
    assert v["decode_computed_le_1"] is False and v["hop_at_least_as_fast_as_nixl"] is None
    assert pb.verdicts({"colo1": colo2}) == {k: None for k in v}


def test_computed_tokens_come_from_the_usage_prompt_details():
    assert pb.computed_of({"prompt_tokens": 700, "prompt_tokens_details": {"cached_tokens": 672}}) == 28
    assert pb.computed_of({"prompt_tokens": 700, "prompt_tokens_details": None}) == 700
    assert pb.computed_of({}) is None


def test_prompt_sources_and_cpu_lists_parse():
    text = "\n".join([
        "# HELP vllm:prompt_tokens_by_source_total x",
        'vllm:prompt_tokens_by_source_total{engine="0",model_name="local",source="local_compute"} 96.0',
        'vllm:prompt_tokens_by_source_total{engine="0",model_name="local",source="external_kv_transfer"} 3000.0',
        'vllm:prompt_tokens_by_source_total{engine="1",model_name="local",source="local_compute"} 4.0',
        'vllm:prompt_tokens_total{engine="0",model_name="local"} 3100.0'])
    assert pb.prompt_sources(text) == {"local_compute": 100.0, "external_kv_transfer": 3000.0}
    assert pb.parse_cpu_list("0-2,5\n") == {0, 1, 2, 5} and pb.parse_cpu_list("1") == {1}


def test_the_reason_an_arm_did_not_start_is_its_last_error_line():
    tail = ("vLLM server exited; log tail:\nINFO starting\n"
            "RuntimeError: cpu with cuda kv_buffer is not supported.\nINFO shutting down\n")
    assert pb.first_error_line(tail) == "RuntimeError: cpu with cuda kv_buffer is not supported."
    assert pb.first_error_line("just one line") == "just one line"


def test_bad_input_is_one_line_naming_the_option(repo_root):
    for args, word in ((["--arms", "colo1,bogus"], "--arms"),
                       (["--requests", "0"], "--requests"),
                       (["--interval", "-1"], "--interval"),
                       (["--prompt-min", "900", "--prompt-max", "100"], "--prompt-min"),
                       (["--dtype", "int3"], "--dtype")):
        proc = subprocess.run([sys.executable, "-m", "kvpool_cli", "bench", "pd", *args],
                              cwd=repo_root, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, (args, proc.stderr)
        lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("kvpool bench pd")]
        assert len(lines) == 1 and word in lines[0], (args, proc.stderr)
        assert "Traceback" not in proc.stderr


def test_the_nixl_shim_puts_a_nixl_package_over_the_cu12_wheel(tmp_path, monkeypatch):
    import importlib.util

    found = {"nixl": None, "nixl_cu12": object()}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: found[name])
    assert pb.nixl_shim(tmp_path) == tmp_path
    for mod in ("__init__", "_api", "_bindings"):
        source = (tmp_path / "nixl" / f"{mod}.py").read_text()
        assert "nixl_cu12" in source
        compile(source, mod, "exec")
    assert pb.NIXL_PROG_THREAD_ENV in (tmp_path / "nixl" / "_api.py").read_text()
    found["nixl_cu12"] = None
    assert pb.nixl_shim(tmp_path / "other") is None  # neither imports: the arm says why
    found["nixl"] = object()
    assert pb.nixl_shim(tmp_path / "third") == tmp_path / "third"  # nixl itself: nothing to add
    assert not (tmp_path / "third" / "nixl").exists()


def test_the_table_names_the_arm_that_did_not_start_and_the_threads_put_back():
    f = pb.arm_figures([_rec("long", 1.0, [0.01, 0.02], 20, hop=0.2, prefill=0.8)])
    f.update(decode_computed_engine_mean=20.0, affinity={"prefill": "0", "decode": "1"},
             escaped_at_start={"prefill": "0,1"}, repinned_threads={"prefill": 1})
    report = {"cpu": "cpu", "dtype": "bfloat16", "model": "m", "cores": [0, 1],
              "workload": vars(pb.QUICK), "arms": ["pd-kvpool", "pd-nixl"],
              "layout": {a: pb.engine_layout(a, [0, 1]) for a in ("pd-kvpool", "pd-nixl")},
              "figures": {"pd-kvpool": f}, "counters": {}, "nixl_progress_thread": True,
              "verdicts": pb.verdicts({"pd-kvpool": f}), "errors": {},
              "skipped": {"pd-nixl": "ModuleNotFoundError: No module named 'nixl'"}}
    text = pb.render(report)
    assert "arm pd-nixl did not start: ModuleNotFoundError: No module named 'nixl'" in text
    assert "prefill's threads had left core(s) 0 for 0,1 by themselves; 1 put back" in text
    assert "decode-side prompt tokens computed <= 1 per request: no" in text
    assert "kvpool's hop at least as fast as NIXL's: n/a" in text
    assert "NIXL progress thread on" in text


def test_the_hop_is_split_into_bytes_loaded_and_store_reads():
    """The decode engine's store reads (its /metrics histogram) per request, per tier."""
    text = "\n".join([
        'kvpool_store_op_seconds_sum{engine="0",op="get",store="ns",tier="redis"} 0.8',
        'kvpool_store_op_seconds_count{engine="0",op="get",store="ns",tier="redis"} 16.0',
        'kvpool_store_op_seconds_sum{engine="0",op="put",store="ns",tier="redis"} 9.0',
        'kvpool_store_op_seconds_bucket{engine="0",le="0.1",op="get",store="ns",tier="redis"} 3',
        'kvpool_store_op_seconds_sum{engine="0",op="get",store="ns",tier="cpu"} 0.2'])
    assert pb.store_reads(text) == {"reads:redis:s": 0.8, "reads:redis:n": 16.0,
                                    "reads:cpu:s": 0.2}
    parts = pb.hop_parts({"kvpool_loaded_bytes_total": 8 * (1 << 20), "reads:redis:s": 0.8,
                          "reads:redis:n": 16.0}, served=4)
    assert parts == {"loaded_mib": 2.0, "read_ms:redis": 200.0}
    assert pb.hop_parts({}, served=4) is None
