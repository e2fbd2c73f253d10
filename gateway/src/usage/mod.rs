//! Token usage of inference answers, read as they stream past, for `faden_tokens_total`.
//!
//! OpenAI-compatible engines report `"usage": {"prompt_tokens", "completion_tokens",
//! "total_tokens"}` at the top level of a non-streamed answer, and in the last `data:` event of
//! a stream when the request set `stream_options.include_usage` (vLLM with continuous usage
//! stats repeats it in every chunk, cumulatively: the last one wins).
//!
//! Both scanners are fed the body chunks exactly as they are forwarded, split anywhere (mid-line,
//! mid-UTF-8), and never buffer the answer:
//!
//! - [`SseUsageScanner`] keeps at most one partial line ([`MAX_LINE`] bytes); a longer line is
//!   skipped to its end without growing memory. Lines end at `\n` or `\r`; a line is looked at
//!   only once terminated (an unterminated last line is an incomplete event, ignored as the SSE
//!   specification says).
//! - [`JsonUsageScanner`] tracks the strings and nesting of a non-streamed body 64 bytes at a
//!   time (a bit mask of the quotes, backslashes and brackets, then only those bytes), and
//!   reads the value of the top-level `usage` key in place, by hand in its usual shape; only a
//!   value split across chunks is copied (at most [`MAX_USAGE_VALUE`] bytes).
//!
//! Neither changes a byte of the answer. [`add_include_usage`] is the one request rewrite
//! (behind the gateway's `count_tokens` setting).
//!
//! The pieces: [`Usage`] and the whole-object reader (here); `sse` the event-stream scanner;
//! `json` the non-streamed body scanner; `value` the reader of one `usage` value; `request` the
//! request rewrite.

mod json;
mod request;
mod sse;
#[cfg(test)]
mod tests;
mod value;

use serde::Deserialize;

pub use json::JsonUsageScanner;
pub use request::add_include_usage;
pub use sse::SseUsageScanner;

/// Longest SSE line the scanner looks at (its partial-line carry never grows beyond it).
pub const MAX_LINE: usize = 8 * 1024;

/// Longest `usage` value the JSON scanner copies.
pub const MAX_USAGE_VALUE: usize = 4 * 1024;

/// Token counts of one answer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u64,
    /// 0 when the answer has none (embeddings).
    pub completion_tokens: u64,
    /// As reported; `prompt_tokens + completion_tokens` when absent.
    pub total_tokens: u64,
}

#[derive(Deserialize)]
struct UsageProbe {
    prompt_tokens: u64,
    #[serde(default)]
    completion_tokens: Option<u64>,
    #[serde(default)]
    total_tokens: Option<u64>,
}

impl From<UsageProbe> for Usage {
    fn from(p: UsageProbe) -> Self {
        let completion_tokens = p.completion_tokens.unwrap_or(0);
        Usage {
            prompt_tokens: p.prompt_tokens,
            completion_tokens,
            total_tokens: p
                .total_tokens
                .unwrap_or(p.prompt_tokens.saturating_add(completion_tokens)),
        }
    }
}

/// The top-level `usage` of a JSON object; every other field is skipped without being built.
#[derive(Deserialize)]
struct EnvelopeProbe {
    #[serde(default)]
    usage: Option<UsageProbe>,
}

/// The top-level `usage` of a complete JSON object (a non-streamed answer, or one SSE `data:`
/// payload). `None` for anything else: not JSON, no usage, `"usage": null`, a malformed usage.
pub fn usage_from_json(body: &[u8]) -> Option<Usage> {
    serde_json::from_slice::<EnvelopeProbe>(body)
        .ok()?
        .usage
        .map(Usage::from)
}

/// JSON's whitespace.
fn is_blank(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | b'\r')
}
