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
//! - [`JsonUsageScanner`] tracks the JSON nesting of a non-streamed body byte by byte and only
//!   copies the value of the top-level `usage` key (at most [`MAX_USAGE_VALUE`] bytes).
//!
//! Neither changes a byte of the answer. [`with_include_usage`] is the one request rewrite
//! (behind the gateway's `count_tokens` setting).

use serde::Deserialize;

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

/// Finds the last usage of an event stream, fed chunk by chunk.
#[derive(Debug, Default)]
pub struct SseUsageScanner {
    /// The current line so far, when it did not end in the chunk that started it.
    carry: Vec<u8>,
    /// The current line is longer than [`MAX_LINE`]: skipped up to its end.
    skipping: bool,
    usage: Option<Usage>,
}

impl SseUsageScanner {
    pub fn new() -> Self {
        Self::default()
    }

    /// Scans the next chunk of the stream.
    pub fn feed(&mut self, chunk: &[u8]) {
        let mut rest = chunk;
        while let Some(end) = memchr::memchr2(b'\n', b'\r', rest) {
            let (head, tail) = (&rest[..end], &rest[end + 1..]);
            rest = tail;
            if self.skipping {
                self.skipping = false;
                continue;
            }
            if self.carry.is_empty() {
                self.line(head);
                continue;
            }
            if self.carry.len() + head.len() <= MAX_LINE {
                let mut line = std::mem::take(&mut self.carry);
                line.extend_from_slice(head);
                self.line(&line);
                // Keep the allocation for the next partial line.
                line.clear();
                self.carry = line;
            } else {
                self.carry.clear();
            }
        }
        if self.skipping {
            return;
        }
        if self.carry.len() + rest.len() <= MAX_LINE {
            self.carry.extend_from_slice(rest);
        } else {
            self.carry.clear();
            self.skipping = true;
        }
    }

    /// The last usage seen so far.
    pub fn usage(&self) -> Option<Usage> {
        self.usage
    }

    /// Bytes held for the current partial line (at most [`MAX_LINE`]).
    pub fn carried(&self) -> usize {
        self.carry.len()
    }

    fn line(&mut self, line: &[u8]) {
        if line.len() > MAX_LINE {
            return;
        }
        let Some(data) = line.strip_prefix(b"data:") else {
            return;
        };
        let data = data.strip_prefix(b" ").unwrap_or(data);
        if memchr::memmem::find(data, b"\"usage\"").is_none() {
            return;
        }
        if let Some(u) = usage_from_json(data) {
            self.usage = Some(u);
        }
    }
}

/// The bytes that matter to the JSON scanner outside strings.
const STRUCTURAL: [bool; 256] = {
    let mut t = [false; 256];
    let mut i = 0;
    let bytes = b"\"{}[],:";
    while i < bytes.len() {
        t[bytes[i] as usize] = true;
        i += 1;
    }
    t
};

/// Where the JSON scanner is in the top-level object.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum Phase {
    /// Before the first non-blank byte.
    #[default]
    Start,
    /// Inside the top-level object.
    Object,
    /// The body is not a JSON object, or the object ended: nothing more to read.
    Done,
}

/// Finds the top-level `usage` of a non-streamed JSON answer, fed chunk by chunk.
///
/// It follows strings and nesting without validating the document: a malformed body can at
/// worst yield no usage, or one whose value object itself parsed as a usage.
#[derive(Debug, Default)]
pub struct JsonUsageScanner {
    phase: Phase,
    depth: u32,
    in_string: bool,
    escaped: bool,
    /// At depth 1, the next string is a key.
    expect_key: bool,
    /// The key being read at depth 1 (`None` once it cannot be `usage`).
    key: Option<KeyBuf>,
    /// The last key at depth 1 was `usage`; its `:` not yet seen.
    usage_key: bool,
    /// After `"usage":`, waiting for the value's first byte.
    await_value: bool,
    /// The `usage` object being copied (`None` when not copying or too long).
    value: Option<Vec<u8>>,
    copying: bool,
    usage: Option<Usage>,
}

#[derive(Clone, Copy, Debug, Default)]
struct KeyBuf {
    bytes: [u8; 5],
    len: usize,
}

impl KeyBuf {
    /// False once the key is longer than `usage`.
    fn push(&mut self, b: u8) -> bool {
        if self.len == self.bytes.len() {
            return false;
        }
        self.bytes[self.len] = b;
        self.len += 1;
        true
    }

    fn is_usage(&self) -> bool {
        &self.bytes[..self.len] == b"usage"
    }
}

impl JsonUsageScanner {
    pub fn new() -> Self {
        Self::default()
    }

    /// The top-level usage, once its value object ended.
    pub fn usage(&self) -> Option<Usage> {
        self.usage
    }

    /// Scans the next chunk of the body.
    pub fn feed(&mut self, chunk: &[u8]) {
        let mut i = 0;
        while i < chunk.len() {
            if self.phase == Phase::Done {
                return;
            }
            // Jump over bytes that cannot change the state: string content (up to a quote or
            // a backslash) unless it is a depth-1 key being read, and, outside strings, anything
            // but the structural bytes. The state machine below sees only the rest.
            let rest = &chunk[i..];
            let skip = if self.in_string {
                if self.escaped || self.key.is_some() {
                    0
                } else {
                    memchr::memchr2(b'"', b'\\', rest).unwrap_or(rest.len())
                }
            } else if self.phase == Phase::Object && !self.await_value {
                rest.iter()
                    .position(|&b| STRUCTURAL[usize::from(b)])
                    .unwrap_or(rest.len())
            } else {
                0
            };
            if skip > 0 {
                if self.copying {
                    self.copy(&rest[..skip]);
                }
                i += skip;
                continue;
            }
            self.byte(chunk[i]);
            i += 1;
        }
    }

    /// Appends to the `usage` value being copied (dropped once it would be too long).
    fn copy(&mut self, bytes: &[u8]) {
        if let Some(v) = &mut self.value {
            if v.len() + bytes.len() <= MAX_USAGE_VALUE {
                v.extend_from_slice(bytes);
            } else {
                self.value = None;
            }
        }
    }

    fn byte(&mut self, b: u8) {
        if self.phase == Phase::Start {
            match b {
                b' ' | b'\t' | b'\r' | b'\n' => {}
                b'{' => {
                    self.phase = Phase::Object;
                    self.depth = 1;
                    self.expect_key = true;
                }
                _ => self.phase = Phase::Done,
            }
            return;
        }
        if self.copying {
            self.copy(&[b]);
        }
        if self.in_string {
            if self.escaped {
                self.escaped = false;
                self.key = None;
            } else if b == b'\\' {
                self.escaped = true;
                self.key = None;
            } else if b == b'"' {
                self.in_string = false;
                if let Some(key) = self.key.take() {
                    self.usage_key = key.is_usage();
                }
            } else if let Some(key) = &mut self.key {
                if !key.push(b) {
                    self.key = None;
                }
            }
            return;
        }
        if self.await_value && !matches!(b, b' ' | b'\t' | b'\r' | b'\n') {
            self.await_value = false;
            if b == b'{' {
                self.copying = true;
                self.value = Some(vec![b'{']);
            }
        }
        match b {
            b'"' => {
                self.in_string = true;
                if self.depth == 1 && self.expect_key {
                    self.expect_key = false;
                    self.usage_key = false;
                    self.key = Some(KeyBuf::default());
                }
            }
            b'{' | b'[' => self.depth = self.depth.saturating_add(1),
            b'}' | b']' => {
                self.depth = self.depth.saturating_sub(1);
                if self.depth == 1 && self.copying {
                    self.copying = false;
                    if let Some(u) = self.value.take().as_deref().and_then(usage_value) {
                        self.usage = Some(u);
                    }
                }
                if self.depth == 0 {
                    self.phase = Phase::Done;
                }
            }
            b',' if self.depth == 1 => {
                self.expect_key = true;
                self.usage_key = false;
            }
            b':' if self.depth == 1 && self.usage_key => {
                self.usage_key = false;
                self.await_value = true;
            }
            _ => {}
        }
    }
}

fn usage_value(v: &[u8]) -> Option<Usage> {
    serde_json::from_slice::<UsageProbe>(v)
        .ok()
        .map(Usage::from)
}

/// `true` once the field is in the document, whatever its value (`null` included).
#[derive(Default)]
struct Present(bool);

impl<'de> Deserialize<'de> for Present {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        serde::de::IgnoredAny::deserialize(d).map(|_| Present(true))
    }
}

#[derive(Deserialize)]
struct StreamProbe {
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    stream_options: Present,
}

const INCLUDE_USAGE: &[u8] = br#""stream_options":{"include_usage":true},"#;

/// A streamed request body with `"stream_options":{"include_usage":true}` added, when it is a
/// JSON object with `"stream": true` and no `stream_options` at all (not even `null`). `None`
/// leaves the request as it is: not streamed, not a JSON object, or the client already chose
/// its `stream_options`. The added member goes right after the opening `{`; every other byte
/// is kept.
pub fn with_include_usage(body: &[u8]) -> Option<Vec<u8>> {
    let probe: StreamProbe = serde_json::from_slice(body).ok()?;
    if probe.stream != Some(true) || probe.stream_options.0 {
        return None;
    }
    // An object (serde also reads a struct from an array); `stream` is in it, so a member
    // follows the one added.
    let open = body.iter().position(|b| !b.is_ascii_whitespace())?;
    if body[open] != b'{' {
        return None;
    }
    let mut out = Vec::with_capacity(body.len() + INCLUDE_USAGE.len());
    out.extend_from_slice(&body[..=open]);
    out.extend_from_slice(INCLUDE_USAGE);
    out.extend_from_slice(&body[open + 1..]);
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A vLLM-shaped stream with a usage chunk, CRLF and LF mixed, non-ASCII text.
    const STREAM: &str = concat!(
        ": keep-alive\r\n\r\n",
        "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}],\"usage\":null}\n\n",
        "data: {\"id\":\"c1\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Grüße \\\"usage\\\": 🚀\"}}]}\n\n",
        "data: {\"id\":\"c1\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"x\"},\"finish_reason\":\"stop\"}]}\r\n\r\n",
        "data: {\"id\":\"c1\",\"choices\":[],\"usage\":{\"prompt_tokens\":12,\"completion_tokens\":7,\"total_tokens\":19}}\n\n",
        "data: [DONE]\n\n",
    );

    const EXPECTED: Usage = Usage {
        prompt_tokens: 12,
        completion_tokens: 7,
        total_tokens: 19,
    };

    fn scan_sse(chunks: &[&[u8]]) -> Option<Usage> {
        let mut s = SseUsageScanner::new();
        for c in chunks {
            s.feed(c);
        }
        s.usage()
    }

    #[test]
    fn sse_usage_at_every_split() {
        let b = STREAM.as_bytes();
        assert_eq!(scan_sse(&[b]), Some(EXPECTED));
        for i in 0..=b.len() {
            assert_eq!(
                scan_sse(&[&b[..i], &b[i..]]),
                Some(EXPECTED),
                "split at {i}"
            );
        }
        // Byte by byte, and in three pieces around every pair of offsets in a window.
        let singles: Vec<&[u8]> = b.chunks(1).collect();
        assert_eq!(scan_sse(&singles), Some(EXPECTED));
        let n = b.len();
        for i in (0..n).step_by(7) {
            for j in (i..n).step_by(13) {
                assert_eq!(scan_sse(&[&b[..i], &b[i..j], &b[j..]]), Some(EXPECTED));
            }
        }
    }

    #[test]
    fn sse_last_usage_wins_and_null_is_ignored() {
        let s = "data: {\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":1}}\n\
                 data: {\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":5}}\n\
                 data: {\"usage\":null}\n\
                 data:{\"usage\":{\"prompt_tokens\":\"x\"}}\n";
        assert_eq!(
            scan_sse(&[s.as_bytes()]),
            Some(Usage {
                prompt_tokens: 1,
                completion_tokens: 5,
                total_tokens: 6
            })
        );
    }

    #[test]
    fn sse_without_usage() {
        let s = "data: {\"choices\":[{\"delta\":{\"content\":\"\\\"usage\\\":{}\"}}]}\n\ndata: [DONE]\n\n";
        assert_eq!(scan_sse(&[s.as_bytes()]), None);
        assert_eq!(scan_sse(&[b"event: usage\nid: 1\n\n"]), None);
        // Not `data:`, or not terminated.
        let u = r#"{"usage":{"prompt_tokens":1,"completion_tokens":1}}"#;
        assert_eq!(scan_sse(&[format!("datum: {u}\n").as_bytes()]), None);
        assert_eq!(scan_sse(&[format!("data: {u}").as_bytes()]), None);
        assert!(scan_sse(&[format!("data: {u}\r").as_bytes()]).is_some());
    }

    #[test]
    fn sse_oversize_lines_are_skipped_in_bounded_memory() {
        let usage = r#"data: {"usage":{"prompt_tokens":3,"completion_tokens":4,"total_tokens":7}}"#;
        // A usage line padded past the limit is skipped, whatever the chunking.
        let pad = " ".repeat(MAX_LINE);
        let long = format!("data: {{\"pad\":\"{pad}\",\"usage\":{{\"prompt_tokens\":9}}}}\n");
        let stream = format!("{usage}\n{long}data: [DONE]\n");
        let b = stream.as_bytes();
        let want = Some(Usage {
            prompt_tokens: 3,
            completion_tokens: 4,
            total_tokens: 7,
        });
        assert_eq!(scan_sse(&[b]), want);
        let mut s = SseUsageScanner::new();
        for c in b.chunks(1000) {
            s.feed(c);
            assert!(s.carried() <= MAX_LINE);
        }
        assert_eq!(s.usage(), want);
        // A line of exactly MAX_LINE bytes is still read.
        let frame = |pad: usize| {
            format!(
                "data: {{\"usage\":{{\"prompt_tokens\":2}},\"p\":\"{}\"}}",
                "x".repeat(pad)
            )
        };
        let exact = frame(MAX_LINE - frame(0).len());
        assert_eq!(exact.len(), MAX_LINE);
        let exact = format!("{exact}\n");
        for chunk in [MAX_LINE + 1, 100, 1] {
            let mut s = SseUsageScanner::new();
            for c in exact.as_bytes().chunks(chunk) {
                s.feed(c);
            }
            assert_eq!(s.usage().map(|u| u.prompt_tokens), Some(2));
        }
        // An endless line never grows the carry.
        let mut s = SseUsageScanner::new();
        for _ in 0..100 {
            s.feed(&[b'a'; 4096]);
            assert!(s.carried() <= MAX_LINE);
        }
        s.feed(b"\n");
        s.feed(usage.as_bytes());
        s.feed(b"\n");
        assert_eq!(s.usage(), want);
    }

    const BODY: &str = r#"{"id":"x","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"a \"usage\": {\"prompt_tokens\": 99} }"},"usage":{"prompt_tokens":1}}],"usage":{"prompt_tokens":10,"completion_tokens":20,"total_tokens":30,"prompt_tokens_details":{"cached_tokens":0}},"x":[{}]}"#;

    fn scan_json(chunks: &[&[u8]]) -> Option<Usage> {
        let mut s = JsonUsageScanner::new();
        for c in chunks {
            s.feed(c);
        }
        s.usage()
    }

    #[test]
    fn json_usage_at_every_split() {
        let want = Some(Usage {
            prompt_tokens: 10,
            completion_tokens: 20,
            total_tokens: 30,
        });
        let b = BODY.as_bytes();
        assert_eq!(usage_from_json(b), want);
        for i in 0..=b.len() {
            assert_eq!(scan_json(&[&b[..i], &b[i..]]), want, "split at {i}");
        }
        let pretty =
            serde_json::to_vec_pretty(&serde_json::from_slice::<serde_json::Value>(b).unwrap())
                .unwrap();
        assert_eq!(scan_json(&[&pretty]), want);
        assert_eq!(usage_from_json(&pretty), want);
    }

    #[test]
    fn json_without_usage() {
        for body in [
            &br#"{"usage":null}"#[..],
            br#"{"data":[{"usage":{"prompt_tokens":1}}]}"#,
            br#"{"\"usage":{"prompt_tokens":1}}"#,
            br#"{"usages":{"prompt_tokens":1}}"#,
            br#"[{"usage":{"prompt_tokens":1}}]"#,
            br#"{"usage":{"prompt_tokens":-1}}"#,
            b"",
            b"not json",
        ] {
            assert_eq!(
                scan_json(&[body]),
                None,
                "{}",
                String::from_utf8_lossy(body)
            );
            assert_eq!(usage_from_json(body), None);
        }
        // A usage value too long to copy.
        let long = format!(
            r#"{{"usage":{{"prompt_tokens":1,"pad":"{}"}}}}"#,
            "x".repeat(MAX_USAGE_VALUE)
        );
        assert_eq!(scan_json(&[long.as_bytes()]), None);
        // Embeddings: no completion tokens.
        assert_eq!(
            scan_json(&[br#" {"data":[],"usage":{"prompt_tokens":4,"total_tokens":4}}"#]),
            Some(Usage {
                prompt_tokens: 4,
                completion_tokens: 0,
                total_tokens: 4
            })
        );
    }

    #[test]
    fn include_usage_is_added_only_when_absent() {
        let body = br#" {"model":"m","stream":true,"messages":[]}"#;
        let out = with_include_usage(body).unwrap();
        assert_eq!(
            out,
            br#" {"stream_options":{"include_usage":true},"model":"m","stream":true,"messages":[]}"#
        );
        let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["stream_options"]["include_usage"], true);
        for unchanged in [
            &br#"{"model":"m"}"#[..],
            br#"{"model":"m","stream":false}"#,
            br#"{"model":"m","stream":true,"stream_options":null}"#,
            br#"{"model":"m","stream":true,"stream_options":{}}"#,
            br#"{"model":"m","stream":true,"stream_options":{"include_usage":false}}"#,
            br#"{"model":"m","stream":"yes"}"#,
            b"[]",
            b"[true]",
            b"{",
        ] {
            assert_eq!(with_include_usage(unchanged), None);
        }
    }
}
