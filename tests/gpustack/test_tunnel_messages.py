"""GPUStack's tunnel messages, made and read by GPUStack's own code
(`gpustack.websocket_proxy.message`), against the vectors faden's decoder is tested with
(`tunnel/tests/fixtures/gpustack_messages.json`, read by `tunnel/tests/gpustack_messages.rs`).

Each vector is bytes and what GPUStack's `parse_message` makes of them: a message, or an error.
This test builds the vectors again with the installed GPUStack and fails when they differ from
the committed file, so the Rust test's corpus is GPUStack's behaviour, not a transcription.
`FADEN_WRITE_FIXTURES=1` rewrites the file.
"""

import gzip
import json
import os
import uuid
from pathlib import Path

FIXTURE = Path(__file__).resolve().parents[2] / "tunnel" / "tests" / "fixtures" / "gpustack_messages.json"
S = uuid.UUID("0f1e2d3c-4b5a-4978-8695-a4b3c2d1e0f0")
GZ = gzip.compress(b"hello", mtime=0)


def described(msg) -> dict:
    from gpustack.websocket_proxy import message as m

    if isinstance(msg, m.ConnectRequestMessage):
        return {"type": "connect_request", "session": str(msg.session_id), "target": msg.target_url}
    if isinstance(msg, m.ConnectResponseMessage):
        return {"type": "connect_response", "session": str(msg.session_id), "success": msg.success,
                "error": msg.error}
    if isinstance(msg, m.DataMessage):
        return {"type": "data", "session": str(msg.session_id), "data": msg.data.hex(),
                "compression": msg.compression}
    if isinstance(msg, m.DisconnectMessage):
        return {"type": "disconnect", "session": str(msg.session_id), "error": msg.error}
    if isinstance(msg, m.HeartbeatMessage):
        return {"type": "heartbeat", "timestamp": msg.timestamp}
    return {"type": msg.get_type()}


def vectors() -> list[dict]:
    from gpustack.websocket_proxy import message as m

    made = [
        ("connect request", m.ConnectRequestMessage(session_id=S, target_url="tcp://127.0.0.1:40000")),
        ("connect request, ipv6 and unicode", m.ConnectRequestMessage(session_id=S, target_url="tcp://[::1]:1/ü")),
        ("connect response ok", m.ConnectResponseMessage(session_id=S, success=True)),
        ("connect response error", m.ConnectResponseMessage(session_id=S, success=False, error="Connection refused")),
        ("data", m.DataMessage(session_id=S, data=b"POST /v1/chat/completions HTTP/1.1\r\n\r\n")),
        ("data empty", m.DataMessage(session_id=S, data=b"")),
        ("data 64 KiB", m.DataMessage(session_id=S, data=bytes(range(256)) * 256)),
        ("disconnect", m.DisconnectMessage(session_id=S)),
        ("disconnect error", m.DisconnectMessage(session_id=S, error="reset by peer")),
        ("heartbeat", m.HeartbeatMessage(timestamp=1_796_328_500_123)),
        ("heartbeat max", m.HeartbeatMessage(timestamp=2**64 - 1)),
        ("list clients", m.ListClientsMessage()),
    ]
    out = []
    for name, msg in made:
        out.append((name, msg.pack()))
    ok = dict(out)
    # Bytes GPUStack's own sender never makes.
    out += [
        ("empty", b""),
        ("version only", b"\x01"),
        ("version 2", b"\x02\x05" + bytes(8)),
        ("unknown type", b"\x01\x09"),
        ("short session", b"\x01\x04" + bytes(15)),
        ("data length past the end", b"\x01\x03" + S.bytes + b"\x00\x00\x00\x00\x09abc"),
        ("connect request url past the end", b"\x01\x01" + S.bytes + b"\x00\x10tcp://x"),
        ("error text not utf-8", b"\x01\x04" + S.bytes + b"\x01\xff"),
        ("disconnect without error byte", b"\x01\x04" + S.bytes),
        ("heartbeat with trailing bytes", ok["heartbeat"] + b"\x00"),
        ("data with trailing bytes", ok["data"] + b"zz"),
        # GPUStack's own gzip writes the time into the header: the same data, compressed with
        # a fixed time, so that the vector does not change between runs.
        ("gzip data", b"\x01\x03" + S.bytes + b"\x01" + len(GZ).to_bytes(4, "big") + GZ),
        ("connect response flag 2", b"\x01\x02" + S.bytes + b"\x02\x00"),
    ]
    vecs = []
    for name, raw in out:
        try:
            result = described(m.parse_message(raw))
        except Exception as e:  # noqa: BLE001: what GPUStack raises is the fact recorded
            result = {"error": type(e).__name__}
        vecs.append({"name": name, "hex": raw.hex(), "gpustack": result})
    return vecs


def test_the_committed_vectors_are_gpustacks():
    fresh = vectors()
    if os.environ.get("FADEN_WRITE_FIXTURES") == "1":
        FIXTURE.write_text(json.dumps(fresh, indent=1) + "\n")
    committed = json.loads(FIXTURE.read_text())
    assert committed == fresh
