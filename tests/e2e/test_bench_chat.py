"""`kvpool bench chat`: its pure parts, and `--quick` on real servers (the kvpool arms).
Asserts what the arms must do by construction (token-exact history: the tails arm computes
each later turn's new tokens plus at most one block), never timings."""

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
    assert [g["met"] for g in goals] == [True, True]  # 76 <= 60 + 128; 0.4 / 0.1 = 4x
    report = {"settings": json.loads(json.dumps(chat_bench.Settings.quick().__dict__)),
              "runs": {"chunks": chunks, "tails": tails}, "goals": goals}
    text = chat_bench.render(report)
    assert "76 (60) 100ms" in text and "[met ]" in text


def test_an_unknown_arm_is_one_line(capsys):
    assert chat_bench.main(["--arms", "plain,fast"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvpool bench chat: --arms:") and "\n" not in err


@pytest.mark.vllm
@pytest.mark.slow
def test_bench_chat_quick(repo_root, tiny_model, tmp_path):
    report_path = tmp_path / "chat.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kvpool_cli", "bench", "chat", "--quick", "--arms", "chunks,tails",
         "--json", str(report_path)], cwd=repo_root, capture_output=True, text=True, env=dev_tool_env(), timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "computed prompt tokens per request" in proc.stdout and "goals" in proc.stdout
    report = json.loads(report_path.read_text())
    s = report["settings"]
    for arm in ("chunks", "tails"):
        r = report["runs"][arm]
        assert r["requests"] == s["conversations"] * s["turns"]
        assert [b["turn"] for b in r["by_turn"]] == list(range(1, s["turns"] + 1))
    tails = report["runs"]["tails"]
    assert tails["later_computed_tokens"] <= tails["later_new_tokens"] + chat_bench.BLOCK_TOKENS
    assert report["goals"][0]["met"] is True
