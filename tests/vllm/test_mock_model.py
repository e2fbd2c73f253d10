"""The mock engine's prefix-cache model (`faden mock-engine --kv-blocks`), which the routing
benchmark stands on, checked against vLLM itself: the same workload of shared-prefix prompts,
sent one at a time to each, scores the same hit rate within a few points.

The two count tokens differently (vLLM with its tokenizer, the mock at 4 bytes a token), so the
mock is given vLLM's cache in bytes: its blocks hold as many bytes of prompt as one of vLLM's
(128 tokens at the bytes per token vLLM counted on this workload), and as many of them (64).
"""

import random

import engine
import faden_harness

B = engine.BLOCK_SIZE
# Within this many points of vLLM's hit rate.
TOLERANCE = 0.05
# Tenants' system prompts (bytes) and request count: together they exceed the 64-block cache,
# so that eviction, not only lookup, is compared.
TENANTS, SYSTEM_BYTES, REQUESTS = 10, 3500, 150


def words(rng: random.Random, n_bytes: int) -> str:
    """Made-up words in the style of the tiny model's tokenizer corpus (make_model.py)."""
    out = []
    while sum(len(w) + 1 for w in out) < n_bytes:
        out.append("".join(rng.choice("bcdfghjklmnprstvwz") + rng.choice("aeiou") for _ in range(rng.randint(2, 4))))
    return " ".join(out)


def workload(seed: int) -> list[str]:
    """REQUESTS prompts: a tenant's system prompt (Zipf-like popularity) and a question of its
    own, so that only the tenant's prefix can be cached."""
    rng = random.Random(seed)
    systems = [f"tenant {t} {rng.random()}: " + words(rng, SYSTEM_BYTES) for t in range(TENANTS)]
    weights = [1 / (t + 1) for t in range(TENANTS)]
    return [rng.choices(systems, weights)[0] + "\nquestion: " + words(rng, rng.randint(100, 400))
            for _ in range(REQUESTS)]


def hit_rate(usages: list[dict]) -> float:
    return sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages) / sum(u["prompt_tokens"] for u in usages)


def test_mock_hit_rate_matches_vllm_on_the_same_workload(vllm):
    prompts = workload(seed=7)
    # A fresh start for vLLM too: other tests' blocks would otherwise sit in its cache.
    faden_harness.http_json("POST", f"{vllm.url}/reset_prefix_cache")
    real = [vllm.complete(p) for p in prompts]
    bytes_per_token = sum(len(p.encode()) for p in prompts) / sum(u["prompt_tokens"] for u in real)
    block_tokens = max(1, round(B * bytes_per_token / 4))
    mock = faden_harness.Process(
        [faden_harness.faden_bin(), "mock-engine", "--port", "0", "--model", "tiny",
         "--kv-blocks", str(vllm.num_blocks), "--block-tokens", str(block_tokens)],
        vllm.dir / "mock.log")
    try:
        line = mock.wait_line("mock engine listening", 30, "the mock engine")
        url = f"http://{faden_harness.log_field(line, 'addr')}"
        modelled = []
        for p in prompts:
            status, answer = faden_harness.http_json(
                "POST", f"{url}/v1/completions", {"model": "tiny", "prompt": p, "max_tokens": 1})
            assert status == 200, answer
            modelled.append(answer["usage"])
    finally:
        mock.stop()
    real_rate, mock_rate = hit_rate(real), hit_rate(modelled)
    print(f"hit rate on {REQUESTS} requests: vLLM {real_rate:.3f}, mock {mock_rate:.3f} "
          f"({bytes_per_token:.2f} bytes per vLLM token, mock blocks of {block_tokens} tokens)")
    # The workload must exercise both lookup and eviction, or the comparison says nothing.
    assert 0.2 < real_rate < 0.9, real_rate
    assert abs(real_rate - mock_rate) <= TOLERANCE, (real_rate, mock_rate)
