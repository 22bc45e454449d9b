"""`kvpool demo --quick` through the module entry point `make demo` uses: two real vLLM
OpenAI-compatible servers, the openai client, kvpool cpu + disk tiers, a PNG chart."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.e2e.conftest import dev_tool_env


@pytest.mark.vllm
@pytest.mark.slow
def test_demo_quick(repo_root, tiny_model, tmp_path):
    png, report = tmp_path / "demo.png", tmp_path / "demo.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kvpool_cli", "demo", "--quick",
         "--out", str(png), "--json", str(report)],
        cwd=repo_root, capture_output=True, text=True, env=dev_tool_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]

    out = proc.stdout
    for line in ("TTFT p50", "TTFT p95", "TTFT p50, turn 1", "nothing cached yet", "throughput",
                 "kvpool (external)", "kvpool cpu tier", "kvpool disk tier", f"chart: {png}",
                 "took turns round by round", "tiny model (random weights; 2 layers, hidden 128)",
                 "conversation 1 (answers stop at 8 tokens)", "  turn 3  TTFT", "    Q: ", "    A: ",
                 "same answer with and without kvpool: "):
        assert line in out, line
    assert "turn 3/3 with kvpool" in proc.stderr  # the progress bar names round and arm
    assert "engine dtype:" in proc.stderr and "prefill tokens/s" in proc.stderr

    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000

    data = json.loads(report.read_text())
    assert data["tiers"] == ["cpu", "disk"]
    s = data["settings"]
    n = s["conversations"] * s["turns"]
    for run in ("without", "with"):
        r = data[run]
        assert r["requests"] == n
        assert 0 < r["ttft_p50_s"] <= r["ttft_p95_s"]
        assert r["requests_per_s"] > 0 and r["output_tokens_per_s"] > 0
        assert len(r["ttft_by_turn_s"]) == s["turns"]
    # The engine's own KV cache is too small for every conversation: without kvpool later
    # turns recompute their history; with kvpool it comes back from the pool's cpu tier.
    without, with_ = data["without"], data["with"]
    assert without["metrics"]["external_hit_rate"] is None
    assert with_["metrics"]["external_hit_rate"] > 0.3
    assert with_["cached_token_share"] > without["cached_token_share"]
    # every configured tier serves something: the cpu tier holds about 1.5 conversations,
    # the disk tier the rest
    assert with_["metrics"]["tiers"]["cpu"]["hit_chunks"] > 0
    assert with_["metrics"]["tiers"]["disk"]["hit_chunks"] > 0
    assert data["dtype"] in ("float32", "bfloat16") and data["dtype"] in data["machine"]
    # every turn's answer is kept, per conversation, in both arms
    assert [len(c) for c in with_["answers"]] == [s["turns"]] * s["conversations"]
    assert len(without["answers"]) == s["conversations"]
    # the server's /metrics: tokens from kvpool, split by vLLM's hit sources, and the
    # connector's own counters
    m = with_["metrics"]
    assert m["external_hit_tokens"] > 0 and with_["cached_tokens"] > 0
    # vLLM's split of kvpool's tokens: a hit whose first chunks the cpu tier holds counts as
    # host, the rest as disk (which of them depends on what LRU kept: the engines' dtype
    # changes how many chunks fit), never elsewhere
    by_source = m["cached_tokens_by_source"]
    assert by_source.get("host", 0) + by_source.get("disk", 0) == m["external_hit_tokens"]
    c = m["connector"]
    assert c["saved_chunks"] > 0 and c["loaded_chunks"] > 0 and c["lookups"] >= n
    assert c["load_error_chunks"] == 0


# -- the pure parts (no engine) --------------------------------------------------------------

METRICS_TEXT = """\
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="local"} 1000.0
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="local"} 250.0
# TYPE vllm:external_prefix_cache_queries counter
vllm:external_prefix_cache_queries_total{engine="0",model_name="local"} 750.0
# TYPE vllm:external_prefix_cache_hits counter
vllm:external_prefix_cache_hits_total{engine="0",model_name="local"} 600.0
# TYPE vllm:prompt_tokens_cached_by_source counter
vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="local",source="host"} 512.0
vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="local",source="disk"} 88.0
# TYPE kvpool_loaded_chunks counter
kvpool_loaded_chunks_total{engine="0",model_name="local"} 10.0
# TYPE kvpool_tier_hit_chunks counter
kvpool_tier_hit_chunks_total{engine="0",model_name="local",tier="cpu"} 9.0
kvpool_tier_hit_chunks_total{engine="0",model_name="local",tier="disk"} 1.0
# TYPE kvpool_tier_miss_chunks counter
kvpool_tier_miss_chunks_total{engine="0",model_name="local",tier="cpu"} 1.0
"""


def test_parse_metrics_hit_rates_per_tier():
    from kvpool_dev.demo_report import parse_metrics

    m = parse_metrics(METRICS_TEXT)
    assert m["local_hit_rate"] == 0.25 and m["external_hit_rate"] == 0.8
    assert m["tiers"]["cpu"] == {"hit_chunks": 9.0, "miss_chunks": 1.0, "hit_rate": 0.9}
    assert m["tiers"]["disk"]["hit_rate"] == 1.0
    assert m["external_hit_tokens"] == 600.0
    assert m["cached_tokens_by_source"] == {"host": 512.0, "disk": 88.0}
    assert m["connector"] == {"saved_chunks": 0.0, "loaded_chunks": 10.0,
                              "load_error_chunks": 0.0, "lookups": 0.0}
    assert parse_metrics("")["external_hit_rate"] is None


def test_percentile_and_workload_are_deterministic():
    from kvpool_dev.demo import Settings, build_workload
    from kvpool_dev.demo_corpus import DOCS_DIR, QUESTIONS, SYSTEM_PROMPT, load_corpus
    from kvpool_dev.demo_report import percentile

    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5 and percentile([1.0], 95) == 1.0
    s = Settings()
    count = lambda text: len(text.split())  # noqa: E731
    corpus = load_corpus(DOCS_DIR)
    a, b = build_workload(s, count, corpus), build_workload(s, count, corpus)
    assert a == b and len(a) == s.conversations
    assert all(c["questions"] == list(QUESTIONS[:s.turns]) for c in a)
    prompt = count(SYSTEM_PROMPT)
    assert all(s.doc_tokens - 40 < count(c["system"]) - prompt <= s.doc_tokens for c in a)
    assert len({c["system"] for c in a}) == s.conversations  # every user has its own document
    # the documents are kvpool's docs, spread over its files: real sentences, not code
    assert sum(p in c["system"] for c in a for p in corpus[:3]) >= 1
    assert not any("```" in c["system"] or "\n|" in c["system"] for c in a)


def test_prose_paragraphs_keep_sentences_and_drop_code_tables_headings():
    from kvpool_dev.demo_corpus import prose_paragraphs

    md = ("# Title\n\nFirst line of a paragraph\nand its second line.\n\n```bash\n"
          "make demo\n\nstill code\n```\n| a | b |\n|---|---|\n\n- a list item\n\n## Next\nLast.\n")
    assert prose_paragraphs(md) == ["First line of a paragraph and its second line.",
                                    "- a list item", "Last."]


def test_documents_fit_their_size_wrap_a_short_corpus_and_refuse_an_empty_one(tmp_path):
    import pytest

    from kvpool_dev.demo_corpus import documents, load_corpus

    count = lambda text: len(text.split())  # noqa: E731
    docs = documents(["one two", "three four", "five six"], 3, 5, count)
    assert docs == ["one two\n\nthree four\n\nfive", "three four\n\nfive six\n\none",
                    "five six\n\none two\n\nthree"]
    # a paragraph longer than a document is cut at a word
    assert documents(["a b c d e f g", "h"], 1, 3, count) == ["a b c"]
    with pytest.raises(ValueError, match="cannot start 4 documents"):
        documents(["a", "b", "c"], 4, 1, count)
    with pytest.raises(ValueError, match="shorter than 100 tokens"):
        documents(["a b", "c d"], 1, 100, count)
    (tmp_path / "only.md").write_text("```\ncode\n```\n# heading\n")
    with pytest.raises(ValueError, match="no Markdown prose"):
        load_corpus(tmp_path)


def test_answers_report_names_each_turn_and_counts_identical_answers():
    from kvpool_dev.demo_report import identical_answers, render_answers

    workload = [{"system": "doc", "questions": ["What is it?", "Why?"]},
                {"system": "doc 2", "questions": ["What is it?", "Why?"]}]
    base = {"answers": [["A cache.", "Speed."], ["Two.", "Because."]],
            "ttft_by_conversation_s": [[0.5, 0.6], [0.5, 0.7]]}
    pool = {"answers": [["A cache.", "Speed,\n really."], ["Two.", "Because."]],
            "ttft_by_conversation_s": [[0.5, 0.1], [0.5, 0.1]]}
    assert identical_answers(base, pool) == (3, 4)
    # after a conversation's answers differ, its later turns ask about other histories
    diverged = {"answers": [["x", "Speed."], ["Two.", "Because."]]}
    assert identical_answers(base, diverged) == (2, 3)
    text = render_answers(base, pool, workload, max_tokens=40)
    assert text.startswith("conversation 1 (answers stop at 40 tokens):\n")
    assert "turn 2  TTFT 0.600 s without, 0.100 s with kvpool" in text
    assert "    Q: Why?\n    A: Speed, really.\n    A without kvpool: Speed." in text
    assert "A without kvpool: A cache." not in text  # shown only where the answers differ
    assert text.endswith("same answer with and without kvpool: 3 of the 4 turns whose history "
                         "was the same in both arms")


def test_redis_url_password_moves_to_the_environment():
    from kvpool_dev.demo import REDIS_PASSWORD_ENV, redis_from_env

    tier, env = redis_from_env("redis://:s3cret@cache.local:6380/2")
    assert tier == {"type": "redis", "url": "redis://cache.local:6380/2",
                    "password_env": REDIS_PASSWORD_ENV}
    assert env == {REDIS_PASSWORD_ENV: "s3cret"}
    assert redis_from_env(None) is None


def test_the_workload_shrinks_only_on_a_slow_machine():
    from kvpool_dev.demo import (
        MIN_CONVERSATIONS,
        MIN_TURNS,
        Settings,
        estimate_seconds,
        fit_workload,
    )

    s = Settings()
    fast = fit_workload(s, prefill_tps=5000, decode_s=0.005, budget_s=200)
    assert fast == s
    est = estimate_seconds(s, 500, 0.02)
    assert est["with"] < est["without"]  # kvpool's turns after the first compute less
    slow = fit_workload(s, prefill_tps=500, decode_s=0.02, budget_s=120)
    assert (MIN_CONVERSATIONS, MIN_TURNS) <= (slow.conversations, slow.turns) < (8, 4)
    assert sum(estimate_seconds(slow, 500, 0.02).values()) <= 120
    hopeless = fit_workload(s, prefill_tps=5, decode_s=1, budget_s=10)
    assert (hopeless.conversations, hopeless.turns) == (MIN_CONVERSATIONS, MIN_TURNS)


def test_rounds_alternate_arms_and_direction():
    from kvpool_dev.demo import arm_order, visit_order

    assert [arm_order(k) for k in range(4)] == [(0, 1), (1, 0), (0, 1), (1, 0)]
    assert visit_order(4, 0) == [0, 1, 2, 3] and visit_order(4, 1) == [3, 2, 1, 0]


def test_cpu_tier_is_sized_below_the_working_set():
    from kvpool_dev.demo import Settings, cpu_tier_bytes
    from kvpool_dev.testbed.localmodel import kv_bytes_per_token

    bench = {"num_attention_heads": 16, "hidden_size": 1024, "num_key_value_heads": 4,
             "num_hidden_layers": 8}
    assert kv_bytes_per_token(bench, "float32") == 2 * 8 * 4 * 64 * 4
    assert kv_bytes_per_token(bench, "bfloat16") == 2 * 8 * 4 * 64 * 2
    s = Settings()
    per_conversation = -(-s.conversation_tokens() // 256) * 256 * 16384
    size = cpu_tier_bytes(s, 16384)
    assert 3 * per_conversation < size < 4 * per_conversation < s.conversations * per_conversation


def test_model_line_says_trained_or_random(tmp_path):
    from kvpool_dev.demo import model_line
    from kvpool_dev.testbed.trained import MARKER, TRAINED

    config = '{"num_hidden_layers": 30, "hidden_size": 576}'
    trained, generated, other = (tmp_path / n for n in ("smollm2-bcc8", "tiny-h128", "mine"))
    for d in (trained, generated, other):
        d.mkdir()
        (d / "config.json").write_text(config)
    (trained / MARKER).write_text('{"name": "smollm2", "wheel_sha256": "x"}')
    (generated / "kvpool-preset.json").write_text("{}")
    assert TRAINED["smollm2"].title == "SmolLM2-135M-Instruct"
    assert model_line(trained) == "SmolLM2-135M-Instruct (trained; 30 layers, hidden 576)"
    assert model_line(generated) == "tiny model (random weights; 30 layers, hidden 576)"
    assert model_line(other) == "mine (30 layers, hidden 576)"
