"""vLLM itself, as faden's routing reads it: its prefix cache in `/metrics` and in answers, its
KV-cache events (ZMQ, msgpack) and their replay. Straight to vLLM, no faden in between.

Prompts are token ids (the completions API takes them), so that blocks are known exactly: a
block is 128 tokens; a prompt of n tokens stores its first (n - 1) // 128 blocks (the last token
is always computed) and finds at most that many in the cache. Each test draws fresh ids, so no
other request has cached them.
"""

import openai

import engine
import faden_harness

B = engine.BLOCK_SIZE
fresh_ids = engine.fresh_ids


def kinds(messages, kind: str) -> list[dict]:
    return [e for m in messages for e in m.events if e["type"] == kind]


def stored_of(messages, prompt: list[int], blocks: int) -> list[dict]:
    """The BlockStored events of `messages` that store blocks of `prompt`, once they hold
    `blocks` blocks (else []). Events of other requests (a decode still storing blocks of an
    earlier test's request, say) are left out."""
    starts = {tuple(prompt[i:i + B]) for i in range(0, len(prompt) - B + 1, B)}
    events = [e for e in kinds(messages, "BlockStored") if tuple(e["token_ids"][:B]) in starts]
    return events if sum(len(e["block_hashes"]) for e in events) >= blocks else []


def test_cache_config_info(vllm):
    labels = next(dict(ls) for (name, ls), _ in engine.metric_samples(vllm.metrics_text()).items()
                  if name == "vllm:cache_config_info")
    assert labels["block_size"] == str(B)
    assert labels["num_gpu_blocks"] == "64"
    assert labels["enable_prefix_caching"] == "True"


def test_prefix_cache_hits_in_metrics_and_answers(vllm):
    """The same 445-token prompt twice: the second finds 3 blocks (384 tokens) in the cache; the
    metrics count tokens (queries: every prompt token of both; hits: the cached ones)."""
    names = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_cached_total")
    before = [vllm.metric(n) for n in names]
    prompt = fresh_ids(445)
    first, second = vllm.complete(prompt), vllm.complete(prompt)
    after = [vllm.metric(n) for n in names]
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["prompt_tokens_details"]["cached_tokens"] == 3 * B
    assert [a - b for a, b in zip(after, before)] == [2 * 445, 3 * B, 3 * B]


def test_running_request_and_kv_cache_usage(vllm):
    """While a request runs: `num_requests_running` 1 and `kv_cache_usage_perc` a fraction of
    the blocks in use; both back to 0 when it is gone (its blocks stay cached, unused)."""
    client = openai.OpenAI(base_url=f"{vllm.url}/v1", api_key="unused", max_retries=0, timeout=60)
    stream = client.completions.create(model="tiny", prompt=fresh_ids(600), max_tokens=2000, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks)
    text = vllm.metrics_text()
    assert engine.metric(text, "vllm:num_requests_running") == 1
    usage = engine.metric(text, "vllm:kv_cache_usage_perc")
    assert 4 / 64 <= usage <= 1  # the prompt holds 5 of the 64 blocks (4 full, 1 partial)
    stream.close()
    faden_harness.wait_for(lambda: vllm.metric("vllm:num_requests_running") == 0, 30, "the request gone", 0.1)
    assert vllm.metric("vllm:kv_cache_usage_perc") == 0


def test_kv_events_block_stored_with_chained_hashes(vllm):
    """A prompt P+X then P+Y (P two blocks, X and Y one each): the first stores three blocks
    (no parent), the second only Y's, whose parent is P's last block; each event carries the
    blocks' token ids."""
    kv, start = vllm.kv, len(vllm.kv.seen)
    p, x, y = fresh_ids(2 * B), fresh_ids(B), fresh_ids(B)
    vllm.complete(p + x + [7])
    first = kv.wait(lambda seen: stored_of(seen[start:], p + x, 3), 10, "BlockStored for P+X")
    assert [t for e in first for t in e["token_ids"]] == p + x
    hashes = [h for e in first for h in e["block_hashes"]]
    assert len(hashes) == 3 and len(set(hashes)) == 3
    assert first[0]["parent_block_hash"] is None
    assert all(e["block_size"] == B for e in first)

    mark = len(kv.seen)
    assert vllm.complete(p + y + [7])["prompt_tokens_details"]["cached_tokens"] == 2 * B
    second = kv.wait(lambda seen: stored_of(seen[mark:], p + y, 1), 10, "BlockStored for P+Y")
    assert [t for e in second for t in e["token_ids"]] == y
    assert second[0]["parent_block_hash"] == hashes[1]
    assert second[0]["block_hashes"][0] not in hashes
    # Every batch since the engine's start arrived live, except what priming fetched from the
    # replay socket (engine.py): sequence numbers from 0, no gap.
    assert kv.filled == vllm.filled_in_priming
    assert [m.seq for m in kv.seen] == list(range(len(kv.seen)))
    assert all(m.frames[0] == engine.TOPIC.encode() and len(m.frames) == 3 for m in kv.seen)


def test_kv_events_evictions(vllm):
    """Prompts of 80 new blocks through a cache of 64: vLLM evicts the least recently used
    blocks, each in a BlockRemoved of hashes it stored before."""
    kv, start = vllm.kv, len(vllm.kv.seen)
    for _ in range(4):
        vllm.complete(fresh_ids(20 * B + 1))
    def removed(seen):
        hashes = [h for e in kinds(seen[start:], "BlockRemoved") for h in e["block_hashes"]]
        return hashes if len(hashes) >= 16 else None

    gone = kv.wait(removed, 10, "16 blocks removed")
    assert set(gone) <= {h for e in kinds(kv.seen, "BlockStored") for h in e["block_hashes"]}


def test_kv_replay_matches_what_was_published(vllm):
    """The replay socket sends the kept batches from a sequence number on: the same frames as
    the live ones."""
    kv, start = vllm.kv, len(vllm.kv.seen)
    vllm.complete(fresh_ids(B + 1))
    live = kv.wait(lambda seen: seen[start:], 10, "a batch")
    replayed = kv.replay(vllm.replay_endpoint, live[0].seq)
    assert [m.frames for m in replayed[: len(live)]] == [m.frames for m in live]


def test_kv_events_all_blocks_cleared(vllm):
    """`POST /reset_prefix_cache` (VLLM_SERVER_DEV_MODE) empties the cache: an AllBlocksCleared
    event (published with the next batch), and a cached prompt is computed again."""
    kv = vllm.kv
    prompt = fresh_ids(2 * B + 1)
    vllm.complete(prompt)
    assert vllm.complete(prompt)["prompt_tokens_details"]["cached_tokens"] == 2 * B
    start = len(kv.seen)
    status, answer = faden_harness.http_json("POST", f"{vllm.url}/reset_prefix_cache")
    assert status == 200, answer
    assert vllm.complete(prompt)["prompt_tokens_details"]["cached_tokens"] == 0
    kv.wait(lambda seen: kinds(seen[start:], "AllBlocksCleared"), 10, "AllBlocksCleared")
