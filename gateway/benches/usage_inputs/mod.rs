//! The answers the usage measurements read (`benches/hot_paths.rs`, `examples/usage_cost.rs`),
//! and the four readers: the scanners, and serde_json doing the same jobs (the body collected
//! and parsed whole; each SSE line cut out and every `data:` payload parsed).

use std::hint::black_box;

use gateway::usage::{self, JsonUsageScanner, SseUsageScanner, Usage};

/// A non-streamed chat answer whose content is `tokens` short words (some escaped), usage last.
pub fn chat_answer(tokens: usize) -> Vec<u8> {
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
pub fn chat_stream(tokens: usize) -> Vec<Vec<u8>> {
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

pub fn scan_json(chunks: &[&[u8]]) -> Usage {
    let mut s = JsonUsageScanner::new();
    for chunk in chunks {
        s.feed(black_box(chunk));
    }
    s.usage().unwrap()
}

pub fn serde_json_whole(chunks: &[&[u8]]) -> Usage {
    let mut body = Vec::new();
    for chunk in chunks {
        body.extend_from_slice(black_box(chunk));
    }
    usage::usage_from_json(&body).unwrap()
}

pub fn scan_sse(events: &[Vec<u8>]) -> Usage {
    let mut s = SseUsageScanner::new();
    for event in events {
        s.feed(black_box(event));
    }
    s.usage().unwrap()
}

/// Each line cut out, every `data:` payload but `[DONE]` parsed by serde_json, the last usage
/// kept.
pub fn serde_json_sse(events: &[Vec<u8>]) -> Usage {
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
