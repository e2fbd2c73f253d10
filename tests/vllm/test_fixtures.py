"""The recorded fixtures (record_fixtures.py) that faden's Rust tests read: still what this vLLM
publishes (the same metric families and labels, the same event fields), and self-consistent
(each raw frame decodes to its decoded view)."""

import base64
import json
from pathlib import Path

import msgpack
from prometheus_client.parser import text_string_to_metric_families

import engine

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def families(text: str) -> dict[str, tuple[str, frozenset]]:
    """{family: (type, label names of its samples)}"""
    return {f.name: (f.type, frozenset(k for s in f.samples for k in s.labels)) for f in text_string_to_metric_families(text)}


def test_metrics_fixture_matches_the_live_engine(vllm):
    recorded = (FIXTURES / "vllm-metrics.txt").read_text()
    assert families(recorded) == families(vllm.metrics_text())
    # Taken with one request running and one waiting, after prefix-cache hits.
    assert engine.metric(recorded, "vllm:num_requests_running") == 1
    assert engine.metric(recorded, "vllm:num_requests_waiting") == 1
    assert 0 < engine.metric(recorded, "vllm:kv_cache_usage_perc") <= 1
    assert engine.metric(recorded, "vllm:prefix_cache_hits_total") > 0


def test_kv_events_fixture_decodes_to_its_view():
    capture = json.loads((FIXTURES / "kv-events.json").read_text())
    messages = capture["messages"]
    assert [m["seq"] for m in messages] == list(range(len(messages)))
    for m in messages:
        topic, seq, payload = (base64.b64decode(f) for f in m["frames_base64"])
        assert topic == capture["engine"]["topic"].encode()
        assert int.from_bytes(seq, "big") == m["seq"]
        assert engine.jsonable(msgpack.unpackb(payload, raw=False, strict_map_key=False)) == m["decoded"]
    kinds = {e["type"] for m in messages for e in m["decoded"][1]}
    assert kinds == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}


def test_kv_event_fields_match_the_live_engine(vllm):
    capture = json.loads((FIXTURES / "kv-events.json").read_text())
    recorded = {e["type"]: set(e) for m in capture["messages"] for e in m["decoded"][1]}
    start = len(vllm.kv.seen)
    vllm.complete(engine.fresh_ids(engine.BLOCK_SIZE + 1))
    live = vllm.kv.wait(lambda seen: [e for m in seen[start:] for e in m.events if e["type"] == "BlockStored"],
                        10, "a BlockStored")
    assert set(live[0]) == recorded["BlockStored"]
    assert len(vllm.kv.seen[start].batch) == len(capture["messages"][0]["decoded"])
