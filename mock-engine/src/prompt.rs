//! The prompt as an engine without a tokenizer sees it: a canonical byte rendering, one token per
//! [`BYTES_PER_TOKEN`] bytes, and chained hashes of whole blocks of tokens.
//!
//! - **Rendering** ([`render_prompt`]). Chat (`/v1/chat/completions`): for each message, its
//!   `role`, `"\n"`, its content text, `"\n"`; the content is a string, or a list of parts whose
//!   `type` is `"text"` (their `text` concatenated; images and other parts add nothing). Text
//!   completion (`/v1/completions`): the `prompt` string, or the strings of a `prompt` list
//!   concatenated (token-id lists add nothing). Anything else renders to nothing.
//! - **Tokens** ([`token_count`]): `ceil(bytes / 4)`, about what a BPE tokenizer gives on English.
//! - **Blocks** ([`block_hashes`]): the rendering cut into blocks of `block_tokens × 4` bytes;
//!   only whole blocks count. Block `i`'s hash is the hash of block `i - 1`'s hash and block
//!   `i`'s bytes, so it names the whole prefix up to and including block `i`: two prompts share
//!   block hashes exactly as far as their renderings share whole blocks.
//!
//! What the approximation costs: a real tokenizer's tokens are not 4 bytes each, and its block
//! boundaries fall elsewhere, so the cached share of a real engine differs by up to a block per
//! prompt; a chat template adds its own bytes around each message.

use std::hash::BuildHasher as _;

use serde_json::Value;

use crate::StreamKind;

/// Bytes of the rendering per token.
pub const BYTES_PER_TOKEN: usize = 4;

/// Seed of the block hashes (foldhash's quality hasher with a fixed seed: the same hashes for the
/// same bytes within one build).
const HASH_SEED: u64 = 0x6661_6465_6e6b_7663;

/// The canonical rendering of a request body (see the module docs). A body that is not JSON is
/// an error.
pub fn render_prompt(kind: StreamKind, body: &[u8]) -> Result<Vec<u8>, serde_json::Error> {
    if body.is_empty() {
        return Ok(Vec::new());
    }
    let request: Value = serde_json::from_slice(body)?;
    Ok(render_request(kind, &request))
}

/// The canonical rendering of a parsed request (see the module docs).
pub fn render_request(kind: StreamKind, request: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    match kind {
        StreamKind::Chat => {
            for message in request["messages"].as_array().into_iter().flatten() {
                out.extend_from_slice(message["role"].as_str().unwrap_or_default().as_bytes());
                out.push(b'\n');
                match &message["content"] {
                    Value::String(text) => out.extend_from_slice(text.as_bytes()),
                    Value::Array(parts) => {
                        for part in parts.iter().filter(|p| p["type"] == "text") {
                            if let Some(text) = part["text"].as_str() {
                                out.extend_from_slice(text.as_bytes());
                            }
                        }
                    }
                    _ => {}
                }
                out.push(b'\n');
            }
        }
        StreamKind::Completion => match &request["prompt"] {
            Value::String(text) => out.extend_from_slice(text.as_bytes()),
            Value::Array(items) => {
                for text in items.iter().filter_map(Value::as_str) {
                    out.extend_from_slice(text.as_bytes());
                }
            }
            _ => {}
        },
    }
    out
}

/// Tokens of a rendering of `rendered_len` bytes: `ceil(rendered_len / 4)`.
pub fn token_count(rendered_len: usize) -> usize {
    rendered_len.div_ceil(BYTES_PER_TOKEN)
}

/// The chained hashes of the whole blocks of `block_tokens` tokens in `rendered` (a trailing
/// partial block has none).
pub fn block_hashes(rendered: &[u8], block_tokens: usize) -> Vec<u64> {
    let block_bytes = block_tokens.max(1) * BYTES_PER_TOKEN;
    let hasher = foldhash::quality::FixedState::with_seed(HASH_SEED);
    let mut previous = 0u64;
    rendered
        .chunks_exact(block_bytes)
        .map(|block| {
            previous = hasher.hash_one((previous, block));
            previous
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_chat_messages_and_text_parts() {
        let body = br#"{"messages":[
            {"role":"system","content":"be brief"},
            {"role":"user","content":[{"type":"text","text":"a"},{"type":"image_url","image_url":{}},{"type":"text","text":"b"}]},
            {"role":"assistant","content":null}
        ]}"#;
        let rendered = render_prompt(StreamKind::Chat, body).unwrap_or_default();
        assert_eq!(rendered, b"system\nbe brief\nuser\nab\nassistant\n\n");
        assert_eq!(token_count(rendered.len()), 9);
    }

    #[test]
    fn renders_completion_prompts() {
        let one = render_prompt(StreamKind::Completion, br#"{"prompt":"hello"}"#);
        assert_eq!(one.unwrap_or_default(), b"hello");
        let list = render_prompt(StreamKind::Completion, br#"{"prompt":["ab","cd",[1,2]]}"#);
        assert_eq!(list.unwrap_or_default(), b"abcd");
        assert!(render_prompt(StreamKind::Completion, b"not json").is_err());
        assert_eq!(token_count(0), 0);
        assert_eq!(token_count(5), 2);
    }

    #[test]
    fn blocks_chain_over_the_prefix() {
        let a = vec![b'a'; 64 * 3 + 10];
        let mut b = a[..64 * 2].to_vec();
        b.extend_from_slice(&[b'b'; 64]);
        let (ha, hb) = (block_hashes(&a, 16), block_hashes(&b, 16));
        assert_eq!(ha.len(), 3);
        assert_eq!(ha[..2], hb[..2]);
        assert_ne!(ha[2], hb[2]);
        // The same bytes after a different prefix are a different block.
        let mut c = vec![b'c'; 64];
        c.extend_from_slice(&a[64..128]);
        assert_ne!(block_hashes(&c, 16)[1], ha[1]);
    }
}
