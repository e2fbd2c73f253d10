"""vLLM's load as faden carries it: each worker reads vLLM's `/metrics` every 100 ms and
streams the reading to the server (`POST /v2/worker-load`); the server's table
(`GET /v2/worker-load`) and the `faden_engine_*` gauges of its gateway and of the standalone
gateway (which follows the server's stream) show vLLM's own figures.

The three workers of the site (direct, worker and tunnel mode) all serve the one vLLM, so each
of their instances reads the same engine.
"""

import threading

import openai

import engine
import faden_harness
from conftest import MODES


def table(site) -> dict[int, dict]:
    return {r["id"]: r for r in site.server.api("GET", "/v2/worker-load")["readings"]}


def instance_ids(site) -> dict[str, int]:
    items = site.server.api("GET", "/v2/model-instances?page=-1")["items"]
    return {i["model_name"]: i["id"] for i in items}


def gauges(url: str, name: str) -> dict[int, float]:
    status, text = faden_harness.http_json("GET", f"{url}/metrics")
    assert status == 200, text
    out = {}
    for line in text.splitlines():
        if line.startswith(name + '{instance="'):
            labels, value = line.rsplit(" ", 1)
            out[int(labels.split('"')[1])] = float(value)
    return out


def test_vllm_load_reaches_the_server_and_the_gateways(site, vllm):
    ids = faden_harness.wait_for(
        lambda: (found := instance_ids(site)) and all(f"tiny-{m}" in found for m in MODES) and found,
        20, "every worker's instance reported", 0.1)
    mine = [ids[f"tiny-{m}"] for m in MODES]
    readings = faden_harness.wait_for(
        lambda: (t := table(site)) and all(i in t for i in mine) and t,
        20, "a reading of every worker's vLLM at the server", 0.1)
    for i in mine:
        r = readings[i]
        # vLLM's cache_config_info: its block size and its block count (engine.py's override).
        assert r["block_size"] == engine.BLOCK_SIZE, r
        assert r["num_blocks"] == 64, r
        assert 0 <= r["age_ms"] <= 2000, r
        assert 0 <= r["kv_usage"] <= 1, r

    # Long requests run back to back: every reading shows one running at least once, at the
    # server and on both gateways. Each reading is sampled on its own schedule (a worker reads
    # vLLM every 100 ms, and a busy vLLM answers its page late), so each is waited for alone.
    stop = threading.Event()
    client = openai.OpenAI(base_url=f"{vllm.url}/v1", api_key="unused", max_retries=0, timeout=60)

    def load() -> None:
        while not stop.is_set():
            stream = client.completions.create(model="tiny", prompt=engine.fresh_ids(600), max_tokens=3000,
                                               stream=True, extra_body={"ignore_eos": True})
            with stream:
                for _ in stream:
                    if stop.is_set():
                        break

    runner = threading.Thread(target=load, daemon=True)
    runner.start()
    try:
        pending = {("server", i) for i in mine} | {(url, i) for url in (site.server.gateway_url, site.gateway.url)
                                                   for i in mine}

        def every_reading_saw_it() -> bool:
            t = table(site)
            pending.difference_update(("server", i) for i in mine
                                      if i in t and t[i]["running"] >= 1 and t[i]["kv_usage"] > 0)
            for url in (site.server.gateway_url, site.gateway.url):
                g = gauges(url, "faden_engine_requests_running")
                pending.difference_update((url, i) for i in mine if g.get(i, 0) >= 1)
            return not pending

        faden_harness.wait_for(every_reading_saw_it, 90, "a running request in every reading", 0.05)
    finally:
        stop.set()
        runner.join(60)
    assert not runner.is_alive(), "the load's request did not end"
    faden_harness.wait_for(lambda: all(r["running"] == 0 for i, r in table(site).items() if i in mine),
                           30, "the request gone from the readings", 0.1)
