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

#[path = "../benches/usage_inputs/mod.rs"]
mod usage_inputs;

use usage_inputs::{
    chat_answer, chat_stream, scan_json, scan_sse, serde_json_sse, serde_json_whole,
};

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
