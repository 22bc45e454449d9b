"""`kvpool bench chat`: its pure parts, and `--quick` on real servers (the kvpool arms).
Asserts what the arms must do by construction (token-exact history: the tails arm computes
each later turn's new tokens plus at most one block) and the orderings a request's timeline
implies, never timing thresholds."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvpool_dev.bench import chat_bench
from tests.e2e.conftest import dev_tool_env


def test_workload_is_seeded_and_shaped_by_the_settings():
    s = chat_bench.Settings.quick()
    w = chat_bench.workload(s, seed=3)
    assert w == chat_bench.workload(s, seed=3) != chat_bench.workload(s, seed=4)
    assert len(w) == s.conversations
    for c in w:
        assert len(c["turns"]) == len(c["answers"]) == s.turns
        assert s.first_tokens[0] <= len(c["turns"][0]) <= s.first_tokens[1]
        assert all(s.new_tokens[0] <= len(t) <= s.new_tokens[1] for t in c["turns"][1:])


def _turn(k, prompt, cached, new, ttft):
    return {"conversation": 0, "turn": k, "prompt_tokens": prompt, "cached_tokens": cached,
            "new_tokens": new, "ttft_s": ttft}


def test_summary_goals_and_table():
    tails = chat_bench.summarize("tails", [_turn(0, 1000, 0, 1000, 1.0),
                                           _turn(1, 1100, 1024, 60, 0.1)], {"host": 1024.0})
    chunks = chat_bench.summarize("chunks", [_turn(0, 1000, 0, 1000, 1.0),
                                             _turn(1, 1100, 768, 60, 0.4)], {"host": 768.0})
    assert tails["by_turn"][1]["computed_tokens"] == 76 == tails["later_computed_tokens"]
    goals = chat_bench.goals({"chunks": chunks, "tails": tails})
    assert [g["met"] for g in goals] == [True, True]  # 76 <= 60 + 32; 0.4 / 0.1 = 4x
    # with 8-token blocks one block of slack is 8 tokens: 76 > 60 + 8
    assert chat_bench.goals({"chunks": chunks, "tails": tails}, block_size=8)[0]["met"] is False
    # per request: one later request 40 tokens beyond its new ones misses a 32-token block
    # even where the mean is within it
    assert tails["later_max_excess"] == 16
    worse = chat_bench.summarize("tails", [_turn(1, 1100, 1024, 60, 0.1),
                                           _turn(1, 1100, 1000, 60, 0.1),
                                           _turn(1, 1100, 1060, 30, 0.1)], {})
    assert worse["later_max_excess"] == 40 and worse["later_computed_tokens"] < 50 + 32
    assert chat_bench.goals({"chunks": chunks, "tails": worse})[0]["met"] is False
    report = {"settings": json.loads(json.dumps(chat_bench.Settings.quick().__dict__)),
              "runs": {"chunks": chunks, "tails": tails}, "goals": goals}
    text = chat_bench.render(report)
    assert "76 (60) 100ms" in text and "[met ]" in text and "block size 32" in text


# vLLM's three TTFT histograms as a server prints them (names from vllm/v1/metrics/loggers.py),
# two requests: queue 0.01 + 0.03 s, prefill 0.05 + 0.07 s, the API server's TTFT 0.1 + 0.14 s
STAGE_METRICS = """\
# TYPE vllm:request_queue_time_seconds histogram
vllm:request_queue_time_seconds_bucket{engine="0",le="+Inf",model_name="local"} 2.0
vllm:request_queue_time_seconds_count{engine="0",model_name="local"} 2.0
vllm:request_queue_time_seconds_sum{engine="0",model_name="local"} 0.04
# TYPE vllm:request_prefill_time_seconds histogram
vllm:request_prefill_time_seconds_bucket{engine="0",le="+Inf",model_name="local"} 2.0
vllm:request_prefill_time_seconds_count{engine="0",model_name="local"} 2.0
vllm:request_prefill_time_seconds_sum{engine="0",model_name="local"} 0.12
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="local"} 2.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="local"} 2.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="local"} 0.24
# TYPE kvpool_step_seconds counter
kvpool_step_seconds_total{engine="0",model_name="local",phase="load"} 0.008
kvpool_step_seconds_total{engine="0",model_name="local",phase="save"} 0.003
"""


def test_ttft_stages_come_from_vllms_histograms():
    from kvpool_dev.bench.fleet_bench import counters, delta

    now = counters(STAGE_METRICS)
    assert now["time:ttft_count"] == 2 and now["time:prefill_sum"] == pytest.approx(0.12)
    st = chat_bench.stages(delta(now, {}))
    assert st == pytest.approx({"queue": 20, "prefill": 60, "api": 40, "vllm": 120,
                                "kv_load": 4, "kv_save": 1.5})  # kvpool's, per request
    assert chat_bench.stages(delta(now, now)) is None  # no request in the delta


def test_the_stage_table_splits_each_arms_ttft_and_compares_the_engine_parts():
    def arm(client_s, queue, prefill, vllm):
        return {"later_ttft_mean_s": client_s,
                "later_stages_ms": {"queue": queue, "prefill": prefill,
                                    "api": vllm - queue - prefill, "vllm": vllm}}

    tails_kv = arm(0.113, 0, 56, 76)
    tails_kv["later_stages_ms"].update(kv_load=8.25, kv_save=1.5)
    lines = chat_bench.render_stages({"chunks": arm(0.184, 33, 91, 141),
                                      "tails": tails_kv,
                                      "plain": {"later_ttft_mean_s": 1.0,
                                                "later_stages_ms": None}})
    text = "\n".join(lines)
    assert "chunks         184 =  43 +  141 ( 17 +  33 +   91)" in text
    assert ("tails          113 =  37 +   76 ( 20 +   0 +   56); kvpool in the steps: "
            "load 8.2 + save 1.5") in text
    assert "chunks         184 =  43 +  141 ( 17 +  33 +   91)\n" in text + "\n"  # none there
    assert "plain" not in text  # an arm without the histograms is left out
    assert "engine (queue + prefill) 2.21x, vLLM's TTFT 1.86x, client 1.63x" in text
    assert chat_bench.render_stages({"plain": {"later_ttft_mean_s": None}}) == []


def test_drift_none_when_the_server_repeats_the_generated_ids():
    prev, generated, tail = [5, 6, 7], [8, 9], [1, 10, 11]
    exact = prev + generated + tail
    d = chat_bench.drift(list(exact), exact, history=len(prev + generated))
    assert d == {"history_tokens": 5, "common_prefix": 8, "drift_tokens": 0, "exact": True}


def test_drift_counts_the_history_past_a_merge():
    # the answer's ids 8, 9 re-tokenize as one merged id 42: everything from there on differs
    prev, generated, tail = [5, 6, 7], [8, 9], [1, 10, 11]
    exact = prev + generated + tail
    d = chat_bench.drift(prev + [42] + tail, exact, history=5)
    assert d == {"history_tokens": 5, "common_prefix": 3, "drift_tokens": 2, "exact": False}
    # a template token that differs only after the history: the whole history is reusable
    d = chat_bench.drift(prev + generated + [2, 10, 11], exact, history=5)
    assert (d["common_prefix"], d["drift_tokens"], d["exact"]) == (5, 0, False)


def test_a_real_bpe_merges_the_generated_ids_when_their_text_is_re_tokenized(tmp_path):
    """Why the drift exists: ids a model may generate ("t", "he") decode to text that the
    tokenizer encodes as other ids (one merged "the")."""
    from transformers import AutoTokenizer

    from kvpool_dev.testbed.localmodel import CHAT_TEMPLATE, _train_tokenizer

    _train_tokenizer(2048, tmp_path)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    generated = tok.encode("t", add_special_tokens=False) + tok.encode("he", add_special_tokens=False)
    assert tok.encode(tok.decode(generated), add_special_tokens=False) != generated
    first = [{"role": "user", "content": "hello"}]
    prev = tok.apply_chat_template(first, tokenize=False, add_generation_prompt=True)
    answer = tok.decode(generated)
    nxt = tok.apply_chat_template(first + [{"role": "assistant", "content": answer},
                                           {"role": "user", "content": "more"}],
                                  tokenize=False, add_generation_prompt=True)
    tail = chat_bench.template_tail(prev, answer, nxt)
    assert tail == "</s>\n<|user|>\nmore</s>\n<|assistant|>\n" and CHAT_TEMPLATE
    prev_ids = tok.encode(prev, add_special_tokens=False)
    exact = prev_ids + generated + tok.encode(tail, add_special_tokens=False)
    d = chat_bench.drift(tok.encode(nxt, add_special_tokens=False), exact,
                         history=len(prev_ids) + len(generated))
    assert d["drift_tokens"] == len(generated) and d["common_prefix"] == len(prev_ids)


def test_the_chat_part_generates_only_ids_with_text():
    # the test bed's model has 2048 logits, its tokenizer 624 tokens: ids past it and the
    # special ids come back from the chat API as no text at all
    assert chat_bench.text_ids(6, {0, 1, 2}) == [3, 4, 5]


def test_a_template_that_rewrites_earlier_turns_has_no_tail():
    with pytest.raises(ValueError, match="does not render the next turn"):
        chat_bench.template_tail("<u>hi<a>", "<think>x</think>yo", "<u>hi<a>yo</s><u>more<a>")


def _chat_row(k, history, common, computed_chat, computed_exact):
    return {"conversation": 0, "turn": k, "history_tokens": history, "common_prefix": common,
            "drift_tokens": max(0, history - common), "exact": common > history,
            "new_tokens": 60, "answer_tokens": 16, "computed_chat": computed_chat, "computed_exact": computed_exact}


def test_chat_summary_and_table():
    rows = [{"conversation": 0, "turn": 0}, {"conversation": 1, "turn": 0},
            _chat_row(1, 400, 380, 200, 90), _chat_row(1, 500, 520, 100, 80)]
    chat = chat_bench.summarize_chat(rows)
    assert chat["by_turn"] == [{"turn": 2, "requests": 2, "history_tokens": 450,
                                "common_prefix": 450, "drift_tokens": 10, "new_tokens": 60,
                                "computed_chat": 150, "computed_exact": 85,
                                "exact_prompts": 1}]
    assert chat["later_drift_tokens"] == 20 and chat["drift_share"] == 20 / 900
    assert chat["drift_within_last_answer"] == 1  # 20 > 16 answer tokens; 0 <= 16
    report = {"settings": json.loads(json.dumps(chat_bench.Settings.quick().__dict__)),
              "runs": {}, "goals": [], "chat": chat}
    text = chat_bench.render(report)
    assert "re-tokenization drift" in text and "random-weight model" in text
    assert "20 of 900 history tokens (2.2%)" in text and "answer in 1 of 2 prompts" in text
    # a run on the trained model (--model smollm2) names its drift a real client's
    report["settings"]["preset"] = "smollm2-bcc81830d10c"
    text = chat_bench.render(report)
    assert "a trained model's answers" in text and "random-weight model" not in text


def test_an_unknown_arm_is_one_line(capsys):
    assert chat_bench.main(["--arms", "plain,fast"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvpool bench chat: --arms:") and "\n" not in err


@pytest.mark.parametrize("args, field", [
    (["--conversations", "0"], "--conversations"),
    (["--turns", "-1"], "--turns"),
    (["--concurrency", "0"], "--concurrency"),
    (["--arms", "tails,tails"], "--arms"),
    (["--model", "/nonexistent"], "--model"),
    (["--json-out", "/nonexistent/dir/chat.json"], "--json-out"),
    (["--block-size", "24"], "--block-size"),   # not a multiple of 16
    (["--block-size", "512"], "--block-size"),  # more than a chunk
])
def test_a_mistake_is_one_line_before_any_server_starts(capsys, args, field):
    # no `vllm` mark: a server start here would fail the test (the test bed refuses it)
    assert chat_bench.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"kvpool bench chat: {field}:") and "\n" not in err, err


@pytest.mark.vllm
@pytest.mark.slow
def test_bench_chat_quick(repo_root, tiny_model, tmp_path):
    report_path = tmp_path / "chat.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kvpool_cli", "bench", "chat", "--quick", "--arms", "chunks,tails",
         "--json-out", str(report_path)], cwd=repo_root, capture_output=True, text=True,
        env=dev_tool_env(), timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "computed prompt tokens per request" in proc.stdout and "goals" in proc.stdout
    assert "where the TTFT of turns 2+ goes" in proc.stdout and "chunks/tails: engine" in proc.stdout
    report = json.loads(report_path.read_text())
    s = report["settings"]
    for arm in ("chunks", "tails"):
        r = report["runs"][arm]
        assert r["requests"] == s["conversations"] * s["turns"]
        assert [b["turn"] for b in r["by_turn"]] == list(range(1, s["turns"] + 1))
        st = r["later_stages_ms"]  # the servers' own histograms, turns 2+ only
        assert st["vllm"] >= st["queue"] + st["prefill"] and st["prefill"] > 0
        assert r["later_ttft_mean_s"] * 1000 >= st["prefill"]
    tails = report["runs"]["tails"]
    assert tails["later_computed_tokens"] <= tails["later_new_tokens"] + chat_bench.BLOCK_TOKENS
    assert report["goals"][0]["met"] is True
    # the chat-API drift, on the tails server: every later turn compared with its
    # token-exact prompt; the token-exact probe computes no more than tails allow
    chat = report["chat"]
    assert "re-tokenization drift" in proc.stdout
    assert chat["requests"] == s["conversations"] * s["turns"]
    assert [b["turn"] for b in chat["by_turn"]] == list(range(2, s["turns"] + 1))
    for b in chat["by_turn"]:
        assert b["history_tokens"] > b["drift_tokens"] >= 0 and b["common_prefix"] > 0
    assert chat["later_computed_exact"] <= chat["later_new_tokens"] + chat_bench.BLOCK_TOKENS


def test_the_chunks_arms_differ_from_the_defaults_only_where_they_say():
    """chunks: kvpool as issue 24 found it (no tails, no decode KV, async loads);
    chunks-sync: the same with today's sync local loads, to isolate what tails add."""
    s = chat_bench.Settings()
    keys = {arm: chat_bench.arm_config(arm, s)["kv_connector_extra_config"]
            for arm in ("chunks", "chunks-sync", "tails")}
    off = {"save_decode_tokens": False, "tail_objects": False}
    assert {k: keys["chunks"][k] for k in off} == off == {k: keys["chunks-sync"][k] for k in off}
    assert keys["chunks"]["sync_local_loads"] is False
    assert "sync_local_loads" not in keys["chunks-sync"] and "sync_local_loads" not in keys["tails"]
    assert not set(off) & set(keys["tails"])
    assert chat_bench.main(["--arms", "chunks-sync,bogus"]) == 2  # known only on request


def test_the_native_anchor_is_native_at_its_strongest():
    """native: host blocks of the engine's block size and generated tokens offloaded too
    (a hit can end at any block, as a tail's does); native-chunk: the 256-token host blocks
    and prompt-only offloading of earlier runs."""
    s = chat_bench.Settings()
    native = chat_bench.arm_config("native", s)["kv_connector_extra_config"]
    chunk = chat_bench.arm_config("native-chunk", s)["kv_connector_extra_config"]
    assert (native["block_size"], native["offload_prompt_only"]) == (s.block_size, False)
    assert chunk["block_size"] == s.chunk_tokens and "offload_prompt_only" not in chunk
    assert "native-chunk" not in chat_bench.ARMS  # on request only


def test_tokens_by_source_per_turn_from_the_counters_read_after_each_round():
    from kvpool_dev.bench import fleet_bench

    text = ("# TYPE vllm:prompt_tokens_cached_by_source counter\n"
            'vllm:prompt_tokens_cached_by_source_total{engine="0",source="device"} 900.0\n'
            'vllm:prompt_tokens_cached_by_source_total{engine="0",source="host"} 0.0\n'
            "# TYPE kvpool_hit_tokens counter\n"
            'kvpool_hit_tokens_total{engine="0",kind="prompt",tier="cpu"} 256.0\n'
            'kvpool_hit_tokens_total{engine="0",kind="decode_tail",tier="cpu"} 32.0\n')
    got = chat_bench.served(fleet_bench.counters(text))
    assert got == {"cached:device": 900.0, "served:prompt/cpu": 256.0,
                   "served:decode_tail/cpu": 32.0}  # zeros and other counters left out
    r = chat_bench.summarize("tails", [_turn(0, 1000, 0, 1000, 1.0), _turn(1, 1100, 1024, 60, 0.1),
                                       _turn(1, 1100, 1024, 60, 0.1)], {},
                             {1: {"cached:device": 1024.0, "served:prompt/cpu": 1024.0}})
    assert r["by_turn"][0]["served"] == {}
    assert r["by_turn"][1]["served"] == {"cached:device": 512.0, "served:prompt/cpu": 512.0}
    report = {"settings": json.loads(json.dumps(chat_bench.Settings.quick().__dict__)),
              "runs": {"tails": r}, "goals": []}
    assert "tails        turn 2: device 512, prompt/cpu 512" in chat_bench.render(report)


def test_a_hybrid_models_engine_cache_is_bounded_by_its_full_attention_groups():
    """vLLM's hybrid manager groups layers by type in one block pool: the test bed's hybrid
    preset (3 sliding-window + 1 full-attention layer) makes 1 + 3 groups, Gemma 3's 5:1
    pattern over 30 layers 1 + 5 (groups of 5), gpt-oss-20b's 12 + 12 one each. Every
    sliding-window group gets each conversation's window (at least one request at the
    model's length, vLLM's start check), so the full-attention group holds the settings'
    tokens, as a dense model's cache does."""
    assert chat_bench.kv_cache_groups({}) == chat_bench.KVGroups()
    assert chat_bench.kv_cache_groups({"layer_types": ["full_attention"] * 4}) == \
        chat_bench.KVGroups()
    hybrid = chat_bench.kv_cache_groups(
        {"layer_types": ["sliding_attention"] * 3 + ["full_attention"], "sliding_window": 256})
    assert hybrid == chat_bench.KVGroups(1, 3, 256)
    assert chat_bench.kv_cache_groups(
        {"layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 5,
         "sliding_window": 1024}) == chat_bench.KVGroups(1, 5, 1024)
    assert chat_bench.kv_cache_groups(
        {"layer_types": ["sliding_attention", "full_attention"] * 12,
         "sliding_window": 128}) == chat_bench.KVGroups(1, 1, 128)
    s = chat_bench.Settings()
    dense = chat_bench.engine_blocks("tails", s)
    per_request = s.max_model_len // s.block_size + 1
    windows = max((256 // s.block_size + 1) * s.conversations, per_request)
    assert chat_bench.engine_blocks("tails", s, hybrid) == dense + 3 * windows


def test_the_roomy_arms_hold_every_conversation_and_bound_the_goal():
    """roomy / tails-roomy: plain vLLM and the tails arm with an engine cache that holds every
    conversation at the model's length, so no turn needs a tier; chunks / tails-roomy is
    reported as the most the goal's ratio can be on the host, never as a goal met or missed."""
    s = chat_bench.Settings()
    per_request = s.max_model_len // s.block_size + 1
    assert chat_bench.engine_blocks("tails", s) == s.kv_cache_tokens // s.block_size
    assert chat_bench.engine_blocks("roomy", s) == s.conversations * per_request
    assert chat_bench.engine_blocks("tails-roomy", s) == s.conversations * per_request
    assert chat_bench.arm_config("roomy", s) is None
    roomy = chat_bench.arm_config("tails-roomy", s)["kv_connector_extra_config"]
    tails = chat_bench.arm_config("tails", s)["kv_connector_extra_config"]
    assert {k: v for k, v in roomy.items() if k != "namespace"} == \
        {k: v for k, v in tails.items() if k != "namespace"}
    tails_run = chat_bench.summarize("tails", [_turn(1, 1100, 1024, 60, 0.1)], {})
    chunks = chat_bench.summarize("chunks", [_turn(1, 1100, 768, 60, 0.3)], {})
    floor = chat_bench.summarize("tails-roomy", [_turn(1, 1100, 1024, 60, 0.08)], {})
    goals = chat_bench.goals({"chunks": chunks, "tails": tails_run, "tails-roomy": floor})
    bound = goals[-1]
    assert bound["met"] is None and bound["goal"].startswith("bound:")
    assert bound["value"] == "3.75x; the tails arm's TTFT p50 is 1.25x the floor's"
    assert not chat_bench.goals({"chunks": chunks, "tails": tails_run})[-1]["goal"].startswith(
        "bound")
