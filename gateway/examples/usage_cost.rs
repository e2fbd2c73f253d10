//! Instructions per answer of the usage scanners against serde_json doing the same job, for
//! callgrind: `usage_cost scanner|serde json|json4k|sse N` reads the usage of the same answer N
//! times (the answers of `benches/hot_paths.rs`: a 287-byte chat answer in one chunk, a 4 KiB
//! answer in 1 KiB chunks, an 8-token SSE stream with a final usage event). Two runs with
//! different N, subtracted, give the instructions per answer without the start-up:
//!
//! ```text
//! cargo build --profile bench -p gateway --example usage_cost
//! for n in 1000 11000; do valgrind --tool=callgrind --callgrind-out-file=/tmp/u.$n \
//!   target/release/examples/usage_cost serde sse $n; done
//! ```
//!
//! The figure the scanners are kept for: docs/performance.md.

// A measurement tool: it fails loudly.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::hint::black_box;

use gateway::usage::{self, JsonUsageScanner, SseUsageScanner, Usage};

/// A non-streamed chat answer whose content is `tokens` short words (some escaped), usage last.
fn chat_answer(tokens: usize) -> Vec<u8> {
    let mut content = String::new();
    for i in 0..tokens {
        if i > 0 {
            content.push(' ');
        }
        match i % 16 {
            11 => content.push_str(&format!("\\\"tok{i}\\\"")),
            15 => content.push_str(&format!("tok{i}\\n")),
            _ => content.push_str(&format!("tok{i}")),
        }
    }
    format!(
        r#"{{"id":"chatcmpl-1","object":"chat.completion","created":1700000000,"model":"demo-direct","choices":[{{"index":0,"message":{{"role":"assistant","content":"{content}"}},"finish_reason":"stop"}}],"usage":{{"prompt_tokens":5,"completion_tokens":{tokens},"total_tokens":{}}}}}"#,
        tokens + 5
    )
    .into_bytes()
}

/// The same answer streamed: one `data:` event per token, then the usage-only event.
fn chat_stream(tokens: usize) -> Vec<Vec<u8>> {
    let mut events: Vec<Vec<u8>> = (0..tokens)
        .map(|i| {
            format!(
                "data: {{\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1700000000,\"model\":\"demo-direct\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"tok{i} \"}},\"finish_reason\":null}}],\"usage\":null}}\n\n"
            )
            .into_bytes()
        })
        .collect();
    events.push(format!(
        "data: {{\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1700000000,\"model\":\"demo-direct\",\"choices\":[],\"usage\":{{\"prompt_tokens\":5,\"completion_tokens\":{tokens},\"total_tokens\":{}}}}}\n\ndata: [DONE]\n\n",
        tokens + 5
    ).into_bytes());
    events
}

fn scan_json(chunks: &[&[u8]]) -> Usage {
    let mut s = JsonUsageScanner::new();
    for chunk in chunks {
        s.feed(black_box(chunk));
    }
    s.usage().unwrap()
}

fn serde_json_whole(chunks: &[&[u8]]) -> Usage {
    let mut body = Vec::new();
    for chunk in chunks {
        body.extend_from_slice(black_box(chunk));
    }
    usage::usage_from_json(&body).unwrap()
}

fn scan_sse(events: &[Vec<u8>]) -> Usage {
    let mut s = SseUsageScanner::new();
    for event in events {
        s.feed(black_box(event));
    }
    s.usage().unwrap()
}

/// Each line cut out, every `data:` payload but `[DONE]` parsed by serde_json, the last usage
/// kept.
fn serde_json_sse(events: &[Vec<u8>]) -> Usage {
    let mut carry: Vec<u8> = Vec::new();
    let mut last = None;
    for event in events {
        carry.extend_from_slice(black_box(event));
        let mut start = 0;
        while let Some(end) = memchr::memchr(b'\n', &carry[start..]) {
            let line = &carry[start..start + end];
            start += end + 1;
            if let Some(data) = line.strip_prefix(b"data:") {
                let data = data.strip_prefix(b" ").unwrap_or(data);
                if data != b"[DONE]"
                    && let Some(u) = usage::usage_from_json(data)
                {
                    last = Some(u);
                }
            }
        }
        carry.drain(..start);
    }
    last.unwrap()
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [how, what, n] = args.as_slice() else {
        panic!("usage: usage_cost scanner|serde json|json4k|sse N");
    };
    let n: usize = n.parse().unwrap();
    let small = chat_answer(8);
    let mut tokens = 8;
    while chat_answer(tokens + 1).len() <= 4096 {
        tokens += 1;
    }
    let large = chat_answer(tokens);
    let large_chunks: Vec<&[u8]> = large.chunks(1024).collect();
    let stream = chat_stream(8);
    let mut total = 0u64;
    for _ in 0..n {
        let usage = match (how.as_str(), what.as_str()) {
            ("scanner", "json") => scan_json(&[&small]),
            ("serde", "json") => serde_json_whole(&[&small]),
            ("scanner", "json4k") => scan_json(&large_chunks),
            ("serde", "json4k") => serde_json_whole(&large_chunks),
            ("scanner", "sse") => scan_sse(&stream),
            ("serde", "sse") => serde_json_sse(&stream),
            _ => panic!("usage: usage_cost scanner|serde json|json4k|sse N"),
        };
        total += black_box(usage).total_tokens;
    }
    assert!(total > 0);
}
