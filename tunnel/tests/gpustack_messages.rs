//! faden's decoder of GPUStack's tunnel messages against vectors made by GPUStack's own code
//! (`fixtures/gpustack_messages.json`; `tests/gpustack/test_tunnel_messages.py` rebuilds them
//! with the installed GPUStack and fails when this file's corpus is not what GPUStack does).
//! Every message GPUStack reads, faden reads the same and writes back byte for byte; every
//! message GPUStack refuses, faden refuses; the deliberate differences are listed.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use bytes::Bytes;
use serde_json::Value;
use tunnel::gpustack_message::{Message, MessageError};

/// Read by GPUStack, refused by faden, and why.
const STRICTER: &[(&str, MessageError)] = &[
    ("connect response flag 2", MessageError::Flag(2)),
    ("gzip data", MessageError::Compressed(1)),
    ("list clients", MessageError::Unsupported(6)),
    ("heartbeat with trailing bytes", MessageError::Trailing(1)),
    ("data with trailing bytes", MessageError::Trailing(2)),
];

fn session(text: &str) -> [u8; 16] {
    hex::decode(text.replace('-', ""))
        .unwrap()
        .try_into()
        .unwrap()
}

fn expected(v: &Value) -> Message {
    let s = || session(v["session"].as_str().unwrap());
    let text = |k: &str| v[k].as_str().map(str::to_owned);
    match v["type"].as_str().unwrap() {
        "connect_request" => Message::ConnectRequest {
            session: s(),
            target: text("target").unwrap(),
        },
        "connect_response" => Message::ConnectResponse {
            session: s(),
            success: v["success"].as_bool().unwrap(),
            error: text("error"),
        },
        "data" => Message::Data {
            session: s(),
            data: Bytes::from(hex::decode(v["data"].as_str().unwrap()).unwrap()),
        },
        "disconnect" => Message::Disconnect {
            session: s(),
            error: text("error"),
        },
        "heartbeat" => Message::Heartbeat {
            timestamp: v["timestamp"].as_u64().unwrap(),
        },
        other => panic!("no such message in faden: {other}"),
    }
}

#[test]
fn reads_and_writes_what_gpustack_does() {
    let vectors: Vec<Value> =
        serde_json::from_str(include_str!("fixtures/gpustack_messages.json")).unwrap();
    assert!(vectors.len() >= 20);
    let mut stricter_seen = 0;
    for v in &vectors {
        let name = v["name"].as_str().unwrap();
        let raw = Bytes::from(hex::decode(v["hex"].as_str().unwrap()).unwrap());
        let theirs = &v["gpustack"];
        // GPUStack's verdict: a message (with its `type`) or the exception it raised.
        let refused = theirs.get("type").is_none();
        let ours = Message::decode(&raw);
        if let Some((_, why)) = STRICTER.iter().find(|(n, _)| *n == name) {
            assert!(!refused, "{name}: GPUStack refuses it too");
            assert_eq!(ours.as_ref(), Err(why), "{name}");
            stricter_seen += 1;
        } else if refused {
            assert!(
                ours.is_err(),
                "{name}: GPUStack refuses it, faden read {ours:?}"
            );
        } else {
            let msg = ours.unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(msg, expected(theirs), "{name}");
            // GPUStack's sender writes the optional error byte; so does faden.
            if name != "disconnect without error byte" {
                assert_eq!(msg.encode().unwrap(), raw, "{name}: written back");
            }
        }
    }
    assert_eq!(
        stricter_seen,
        STRICTER.len(),
        "a listed difference has no vector"
    );
}
