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

use std::sync::LazyLock;

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
        if only_null_usage(data) {
            return;
        }
        if let Some(u) = usage_from_json(data) {
            self.usage = Some(u);
        }
    }
}

/// Whether `data` can carry no usage: every `"usage"` in it is followed by `: null` (or there
/// is none). vLLM sends `"usage": null` in every chunk of a stream that asked for usage; this
/// spares those events a parse. The bytes `"usage"` only ever appear as a whole JSON string
/// (inside a string the quotes would be escaped), so an occurrence followed by `: null` is a
/// key whose value is null.
fn only_null_usage(data: &[u8]) -> bool {
    const KEY: &[u8] = b"\"usage\"";
    // Built once: making a searcher costs more than running it over one event (`find_iter`
    // with a needle builds one per call, about 400 instructions, for every `data:` line).
    static FINDER: LazyLock<memchr::memmem::Finder<'static>> =
        LazyLock::new(|| memchr::memmem::Finder::new(KEY));
    FINDER.find_iter(data).all(|at| {
        let rest = data[at + KEY.len()..].trim_ascii_start();
        rest.strip_prefix(b":")
            .is_some_and(|v| v.trim_ascii_start().starts_with(b"null"))
    })
}

/// Bytes the JSON scanner classifies at once, one bit per byte in a `u64`.
const BLOCK: usize = 64;

/// `1 << (i % 8)` at byte `i`: comparison results weighted so that the 8 bytes of each word
/// add up to that word's bit mask (see [`gather`]).
const WEIGHTS: [u8; BLOCK] = {
    let mut w = [0u8; BLOCK];
    let mut i = 0;
    while i < BLOCK {
        w[i] = 1 << (i % 8);
        i += 1;
    }
    w
};

/// The bit mask of a block from its weighted comparison results: each 8-byte word is summed
/// by one multiplication (distinct powers of two, so no sum carries out of its byte).
fn gather(weighted: &[u8; BLOCK]) -> u64 {
    let mut mask = 0;
    for word in weighted.chunks_exact(8).rev() {
        let mut w = [0; 8];
        w.copy_from_slice(word);
        mask = (mask << 8) | (u64::from_le_bytes(w).wrapping_mul(0x0101_0101_0101_0101) >> 56);
    }
    mask
}

/// Bit `i` set when byte `i` of the block is one the JSON scanner looks at: a quote, a
/// backslash, a bracket (`{}[]`), or `|`, which costs a look.
fn events(block: &[u8; BLOCK]) -> u64 {
    // Plain code over fixed-size arrays, which LLVM turns into vector comparisons.
    let weighted = std::array::from_fn(|i| {
        let b = block[i];
        // Setting bit 5 folds `[\]` onto `{|}`, three adjacent bytes.
        let hit = ((b | 0x20).wrapping_sub(b'{') <= 2) | (b == b'"');
        WEIGHTS[i] & 0u8.wrapping_sub(u8::from(hit))
    });
    gather(&weighted)
}

fn is_blank(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | b'\r')
}

/// A key is `usage` when these bytes follow its opening quote.
const USAGE_KEY: &[u8; 6] = b"usage\"";

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

/// What follows a `usage` key at depth 1.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum AfterKey {
    #[default]
    Nothing,
    /// Blanks, then `:`.
    Colon,
    /// Blanks, then the value.
    Value,
}

/// Finds the top-level `usage` of a non-streamed JSON answer, fed chunk by chunk.
///
/// It follows strings and nesting without validating the document: a malformed body can at
/// worst yield no usage, or one whose value object itself parsed as a usage.
///
/// Each chunk is read in blocks of 64 bytes: a bit mask of the bytes that matter (quotes,
/// backslashes, brackets) is built with vector comparisons, and only its set bits are visited.
/// A string at depth 1 is the `usage` key when its bytes spell it and the byte before it
/// (blanks aside) is `{` or `,`; blanks, `:` and `{` must then follow. A value that ends in the
/// chunk it began in is parsed from the chunk; one split across chunks is copied (at most
/// [`MAX_USAGE_VALUE`] bytes). Across chunks the scanner carries the depth, whether it is
/// inside a string or right after an escaping backslash, the last byte that was not blank, and
/// how far a split key or what follows it was matched.
#[derive(Debug, Default)]
pub struct JsonUsageScanner {
    phase: Phase,
    /// Nesting depth, 1 in the top-level object (it counts bytes: it cannot overflow).
    depth: usize,
    /// The last chunk ended inside a string...
    in_string: bool,
    /// ...right after a backslash that escapes the next byte.
    escape_next: bool,
    /// The last byte of the earlier chunks that was not blank.
    last: u8,
    /// A `usage` key being matched across chunks: how many bytes of `usage"` matched so far.
    partial_key: Option<usize>,
    after_key: AfterKey,
    /// The next `{` begins the usage value.
    value_next: bool,
    /// Inside the usage value.
    copying: bool,
    /// Where the usage value's bytes begin in the chunk being scanned.
    copy_from: usize,
    /// The usage value's bytes from earlier chunks.
    value: Vec<u8>,
    /// The usage value is longer than [`MAX_USAGE_VALUE`]: ignored.
    too_long: bool,
    usage: Option<Usage>,
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
    pub fn feed(&mut self, mut chunk: &[u8]) {
        if self.phase == Phase::Start {
            let Some(start) = chunk.iter().position(|&b| !is_blank(b)) else {
                return;
            };
            if chunk[start] != b'{' {
                self.phase = Phase::Done;
                return;
            }
            self.phase = Phase::Object;
            self.depth = 1;
            self.last = b'{';
            chunk = &chunk[start + 1..];
        }
        if self.phase == Phase::Done || chunk.is_empty() {
            return;
        }
        if let Some(matched) = self.partial_key.take() {
            self.match_key(matched, chunk);
        } else if self.after_key != AfterKey::Nothing {
            self.follow_key(chunk);
        }
        // A chunk shorter than a block is scanned as the end of one, after blanks that are
        // never looked at; in a longer one, the last block is its last 64 bytes, the first of
        // which were scanned already.
        let mut padded = [b' '; BLOCK];
        let (chunk, mut next) = if chunk.len() >= BLOCK {
            (chunk, 0)
        } else {
            padded[BLOCK - chunk.len()..].copy_from_slice(chunk);
            (&padded[..], BLOCK - chunk.len())
        };
        self.copy_from = next;
        while next < chunk.len() {
            let start = next.min(chunk.len() - BLOCK);
            let Some(bytes) = chunk[start..].first_chunk() else {
                break;
            };
            if !self.block(chunk, start, bytes, next - start) {
                return;
            }
            next = start + BLOCK;
        }
        if self.copying {
            self.keep(&chunk[self.copy_from..]);
        }
        if let Some(&b) = chunk.iter().rev().find(|&&b| !is_blank(b)) {
            self.last = b;
        }
    }

    /// Scans a block, `chunk[base..base + BLOCK]`, from its byte `first` on; false once the
    /// top-level object ended.
    fn block(&mut self, chunk: &[u8], base: usize, bytes: &[u8; BLOCK], first: usize) -> bool {
        let mut todo = events(bytes) & (u64::MAX << first);
        if self.escape_next {
            self.escape_next = false;
            todo &= !(1 << first);
        }
        if self.in_string {
            if !self.end_string(bytes, &mut todo) {
                return true;
            }
            self.in_string = false;
        }
        let mut depth = self.depth;
        while todo != 0 {
            let i = todo.trailing_zeros() as usize;
            todo &= todo - 1;
            let b = bytes[i];
            if b == b'"' {
                // Most keys do not begin with `u`: a cheap test first.
                if depth == 1 && bytes.get(i + 1).is_none_or(|&next| next == b'u') {
                    self.key(chunk, base + i);
                }
                if !self.end_string(bytes, &mut todo) {
                    self.in_string = true;
                    break;
                }
            } else if b | 0x20 == b'{' {
                if self.value_next {
                    self.value_next = false;
                    self.copying = true;
                    self.copy_from = base + i;
                }
                depth += 1;
            } else if b | 0x20 == b'}' {
                depth -= 1;
                if depth == 1 && self.copying {
                    self.copying = false;
                    self.end_value(&chunk[self.copy_from..=base + i]);
                } else if depth == 0 {
                    self.phase = Phase::Done;
                    return false;
                }
            }
            // Else a backslash outside strings, or `|`.
        }
        self.depth = depth;
        true
    }

    /// Drops the events of a string up to its closing quote (included); false when the block
    /// ends first.
    fn end_string(&mut self, bytes: &[u8; BLOCK], todo: &mut u64) -> bool {
        while *todo != 0 {
            let i = todo.trailing_zeros() as usize;
            *todo &= *todo - 1;
            let b = bytes[i];
            if b == b'"' {
                return true;
            }
            // The byte a backslash escapes is not looked at.
            if b == b'\\' {
                if i == BLOCK - 1 {
                    self.escape_next = true;
                } else {
                    *todo &= !(2 << i);
                }
            }
        }
        false
    }

    /// A string begins at `chunk[at]`, at depth 1: the `usage` key, when its bytes spell it
    /// and the byte before it (blanks aside) is `{` or `,` (not `:`, which makes it a value).
    fn key(&mut self, chunk: &[u8], at: usize) {
        let rest = &chunk[at + 1..];
        // Most strings are not `usage`: the cheap test first.
        let whole = rest.first_chunk();
        if whole.is_some_and(|key| key != USAGE_KEY) || !self.after_open(&chunk[..at]) {
            return;
        }
        if whole.is_some() {
            self.after_key = AfterKey::Colon;
            self.follow_key(&rest[USAGE_KEY.len()..]);
        } else {
            self.match_key(0, rest);
        }
    }

    /// Whether the bytes before a string, blanks aside, end with `{` or `,`.
    fn after_open(&self, before: &[u8]) -> bool {
        let last = before.iter().rev().find(|&&b| !is_blank(b));
        matches!(last.unwrap_or(&self.last), b'{' | b',')
    }

    /// Matches the bytes of a key split across chunks, after its first `matched` ones, against
    /// `usage"`.
    fn match_key(&mut self, matched: usize, bytes: &[u8]) {
        let want = &USAGE_KEY[matched..];
        let n = want.len().min(bytes.len());
        if bytes[..n] != want[..n] {
            return;
        }
        if n < want.len() {
            self.partial_key = Some(matched + n);
            return;
        }
        self.after_key = AfterKey::Colon;
        self.follow_key(&bytes[n..]);
    }

    /// Follows a `usage` key through its `:` to the value, which is copied when it is an
    /// object.
    fn follow_key(&mut self, bytes: &[u8]) {
        for &b in bytes {
            match (self.after_key, b) {
                (_, b' ' | b'\t' | b'\n' | b'\r') => {}
                (AfterKey::Colon, b':') => self.after_key = AfterKey::Value,
                (AfterKey::Value, b'{') => {
                    self.after_key = AfterKey::Nothing;
                    self.value_next = true;
                    return;
                }
                _ => {
                    self.after_key = AfterKey::Nothing;
                    return;
                }
            }
        }
    }

    /// Keeps the usage value's bytes of this chunk for the next (dropped once too long).
    fn keep(&mut self, bytes: &[u8]) {
        if self.too_long || self.value.len() + bytes.len() > MAX_USAGE_VALUE {
            self.too_long = true;
            self.value = Vec::new();
        } else {
            self.value.extend_from_slice(bytes);
        }
    }

    /// The usage value's last bytes (all of it when it began in this chunk).
    fn end_value(&mut self, bytes: &[u8]) {
        let usage = if self.value.is_empty() && !self.too_long {
            (bytes.len() <= MAX_USAGE_VALUE)
                .then(|| usage_value(bytes))
                .flatten()
        } else {
            self.keep(bytes);
            if self.too_long {
                None
            } else {
                usage_value(&self.value)
            }
        };
        self.value = Vec::new();
        self.too_long = false;
        if usage.is_some() {
            self.usage = usage;
        }
    }
}

/// A usage value: read by hand in its usual shape, by serde otherwise.
fn usage_value(v: &[u8]) -> Option<Usage> {
    Reader { bytes: v, pos: 0 }.usage().or_else(|| {
        serde_json::from_slice::<UsageProbe>(v)
            .ok()
            .map(Usage::from)
    })
}

/// A strict reader of the usual usage objects: integer token counts, other members made of
/// plain ASCII strings, integers, literals, objects and arrays (little nesting). `None` for
/// anything else, valid or not, which [`usage_value`] then leaves to serde: what it accepts,
/// serde reads the same.
struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

/// The keys [`Reader::usage`] reads, in the order of [`UsageProbe`]'s fields.
const COUNTS: [&[u8]; 3] = [
    b"\"prompt_tokens\"",
    b"\"completion_tokens\"",
    b"\"total_tokens\"",
];

impl Reader<'_> {
    /// How deep [`Reader::skip`] follows nested members.
    const MAX_DEPTH: u32 = 8;

    fn usage(mut self) -> Option<Usage> {
        if self.peek()? != b'{' {
            return None;
        }
        let mut counts: [Option<u64>; 3] = [None; 3];
        self.members(b'}', |r| {
            let rest = &r.bytes[r.pos..];
            let Some(slot) = COUNTS.iter().position(|name| rest.starts_with(name)) else {
                r.string()?;
                return r.member_value(0);
            };
            r.pos += COUNTS[slot].len();
            r.colon()?;
            // serde refuses a duplicate field.
            if counts[slot].is_some() {
                return None;
            }
            counts[slot] = Some(r.integer()?);
            Some(())
        })?;
        if self.pos != self.bytes.len() {
            return None;
        }
        let [prompt_tokens, completion_tokens, total_tokens] = counts;
        Some(Usage::from(UsageProbe {
            prompt_tokens: prompt_tokens?,
            completion_tokens,
            total_tokens,
        }))
    }

    fn peek(&self) -> Option<u8> {
        self.bytes.get(self.pos).copied()
    }

    fn blanks(&mut self) {
        while self.peek().is_some_and(is_blank) {
            self.pos += 1;
        }
    }

    /// Skips blanks, then `b`.
    fn eat(&mut self, b: u8) -> Option<()> {
        self.blanks();
        (self.peek()? == b).then(|| self.pos += 1)
    }

    fn colon(&mut self) -> Option<()> {
        // Usually no blanks.
        if self.peek() == Some(b':') {
            self.pos += 1;
        } else {
            self.eat(b':')?;
        }
        self.blanks();
        Some(())
    }

    /// The members of an object (`close` = `}`: `each` reads from the key on) or the values
    /// of an array (`]`), from its opening byte to its closing one.
    fn members(&mut self, close: u8, mut each: impl FnMut(&mut Self) -> Option<()>) -> Option<()> {
        self.pos += 1;
        if self.eat(close).is_some() {
            return Some(());
        }
        loop {
            self.blanks();
            each(self)?;
            self.blanks();
            match self.peek()? {
                b',' => self.pos += 1,
                b if b == close => {
                    self.pos += 1;
                    return Some(());
                }
                _ => return None,
            }
        }
    }

    /// A string without escapes, control characters or non-ASCII bytes.
    fn string(&mut self) -> Option<&[u8]> {
        if self.peek()? != b'"' {
            return None;
        }
        let start = self.pos + 1;
        let mut end = start;
        loop {
            match *self.bytes.get(end)? {
                b'"' => break,
                b'\\' | ..=0x1f | 0x7f.. => return None,
                _ => end += 1,
            }
        }
        self.pos = end + 1;
        Some(&self.bytes[start..end])
    }

    /// A non-negative integer as JSON writes it (no leading zero, fraction or exponent) that
    /// fits in a `u64`.
    fn integer(&mut self) -> Option<u64> {
        let start = self.pos;
        let mut n = 0u64;
        while let Some(d @ b'0'..=b'9') = self.peek() {
            n = n.wrapping_mul(10).wrapping_add(u64::from(d - b'0'));
            self.pos += 1;
        }
        let digits = &self.bytes[start..self.pos];
        if digits.is_empty()
            || (digits.len() > 1 && digits[0] == b'0')
            || matches!(self.peek(), Some(b'.' | b'e' | b'E'))
        {
            return None;
        }
        // 19 digits never overflow a `u64`.
        if digits.len() <= 19 {
            return Some(n);
        }
        digits.iter().try_fold(0u64, |n, &d| {
            n.checked_mul(10)?.checked_add(u64::from(d - b'0'))
        })
    }

    /// From the key on: the rest of a member whose value is ignored.
    fn member_value(&mut self, depth: u32) -> Option<()> {
        self.colon()?;
        self.skip(depth)
    }

    /// Skips a value.
    fn skip(&mut self, depth: u32) -> Option<()> {
        match self.peek()? {
            b'"' => self.string().map(drop),
            b'{' if depth < Self::MAX_DEPTH => self.members(b'}', |r| {
                r.string()?;
                r.member_value(depth + 1)
            }),
            b'[' if depth < Self::MAX_DEPTH => self.members(b']', |r| r.skip(depth + 1)),
            b'-' => {
                self.pos += 1;
                self.integer().map(drop)
            }
            b'0'..=b'9' => self.integer().map(drop),
            _ => [&b"null"[..], b"true", b"false"].iter().find_map(|word| {
                self.bytes[self.pos..].starts_with(word).then(|| {
                    self.pos += word.len();
                })
            }),
        }
    }
}

const INCLUDE_USAGE: &[u8] = br#""stream_options":{"include_usage":true},"#;

/// A streamed request body with `"stream_options":{"include_usage":true}` added right after
/// its opening `{`; every other byte is kept. Only for a body that
/// [`crate::route::read_json_request`] found to ask for a stream without `stream_options`
/// (`streamed_without_options`): a JSON object with a `stream` member, so a member follows the
/// one added. `None` when the body does not begin with `{`.
pub fn add_include_usage(body: &[u8]) -> Option<Vec<u8>> {
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
    fn null_usage_events_are_skipped_without_changing_the_result() {
        assert!(only_null_usage(br#"{"choices":[],"usage":null}"#));
        assert!(only_null_usage(br#"{"choices":[], "usage" :  null }"#));
        assert!(only_null_usage(br#"{"choices":[]}"#));
        assert!(!only_null_usage(
            br#"{"usage":null,"x":{"usage":{"prompt_tokens":1}}}"#
        ));
        assert!(!only_null_usage(br#"{"usage":{"prompt_tokens":1}}"#));
        assert!(!only_null_usage(br#"{"note":"usage","usage":nul"#));
        let mut s = SseUsageScanner::new();
        s.feed(b"data: {\"usage\":{\"prompt_tokens\":2,\"completion_tokens\":3}}\n\n");
        s.feed(b"data: {\"choices\":[],\"usage\":null}\n\n");
        assert_eq!(s.usage().map(|u| u.total_tokens), Some(5));
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

    /// xorshift64*: a small deterministic generator for the property tests.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            let mut x = self.0;
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            self.0 = x;
            x.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }

        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }

        fn pick<'a>(&mut self, items: &[&'a str]) -> &'a str {
            items[self.below(items.len())]
        }
    }

    /// Pieces of string contents, already escaped for JSON.
    const TEXT: &[&str] = &[
        "usage",
        "tok",
        " ",
        r#"\"usage\":{\"prompt_tokens\":7}"#,
        r#"\""#,
        r"\\",
        r#"\\\""#,
        r"\n",
        r"\/",
        r"\u0075sage",
        r"\u00e9",
        "é",
        "Grüße",
        "🚀",
        "{",
        "}",
        "[",
        "]",
        ":",
        ",",
        "|",
    ];

    /// Keys of the top-level object besides `usage` (none of them `usage` once unescaped).
    const KEYS: &[&str] = &[
        "id",
        "model",
        "choices",
        "usages",
        "Usage",
        "usag",
        "u",
        "usage_",
        r#"\"usage"#,
        r"usage\\",
        r"\\usage",
        "data",
        "x",
    ];

    /// Random JSON, with blanks, strings of `TEXT` (some longer than a block) and nested
    /// `usage` members.
    struct Gen {
        rng: Rng,
        out: String,
    }

    impl Gen {
        fn blank(&mut self) {
            let blank = self.rng.pick(&["", "", "", " ", "\n  ", "\t", "\r\n"]);
            self.out.push_str(blank);
        }

        fn string(&mut self) {
            self.out.push('"');
            if self.rng.below(8) == 0 {
                let long = "y".repeat(60 + self.rng.below(150));
                self.out.push_str(&long);
            }
            for _ in 0..self.rng.below(6) {
                let piece = self.rng.pick(TEXT);
                self.out.push_str(piece);
            }
            self.out.push('"');
        }

        fn value(&mut self, depth: usize) {
            match self.rng.below(if depth < 3 { 8 } else { 4 }) {
                0 => self.string(),
                1 => {
                    let n =
                        self.rng
                            .pick(&["0", "1", "-2", "3.5", "1e3", "12345678901234567890123"]);
                    self.out.push_str(n);
                }
                2 => {
                    let literal = self.rng.pick(&["true", "false", "null"]);
                    self.out.push_str(literal);
                }
                3 => self.string(),
                4 | 5 => self.object(depth + 1, None),
                _ => {
                    self.out.push('[');
                    for i in 0..self.rng.below(4) {
                        if i > 0 {
                            self.out.push(',');
                        }
                        self.blank();
                        self.value(depth + 1);
                        self.blank();
                    }
                    self.out.push(']');
                }
            }
        }

        /// What `write` writes, apart.
        fn apart(&mut self, write: impl FnOnce(&mut Self)) -> String {
            let outer = std::mem::take(&mut self.out);
            write(self);
            std::mem::replace(&mut self.out, outer)
        }

        fn member(&mut self, key: &str, value: impl FnOnce(&mut Self)) {
            self.blank();
            self.out.push('"');
            self.out.push_str(key);
            self.out.push('"');
            self.blank();
            self.out.push(':');
            self.blank();
            value(self);
            self.blank();
        }

        /// An object; `usage` (the value's text) is its member at a random place.
        fn object(&mut self, depth: usize, usage: Option<&str>) {
            let mut members = Vec::new();
            for _ in 0..self.rng.below(5) {
                // Below the top, `usage` is an ordinary key.
                let key = if depth > 0 && self.rng.below(3) == 0 {
                    "usage"
                } else {
                    self.rng.pick(KEYS)
                };
                let nested = depth > 0 && self.rng.below(4) == 0;
                members.push(self.apart(|g| {
                    g.member(key, |g| {
                        if nested {
                            let v = g.usage_value();
                            g.out.push_str(&v);
                        } else {
                            g.value(depth);
                        }
                    })
                }));
            }
            if let Some(usage) = usage {
                let at = self.rng.below(members.len() + 1);
                let member = self.apart(|g| g.member("usage", |g| g.out.push_str(usage)));
                members.insert(at, member);
            }
            self.out.push('{');
            if members.is_empty() {
                self.blank();
            }
            self.out.push_str(&members.join(","));
            self.out.push('}');
        }

        /// A `usage` value: mostly the usual shape, members in any order, sometimes extra
        /// members, odd numbers, duplicates, escaped keys, `null`, or no object at all.
        fn usage_value(&mut self) -> String {
            let mut members: Vec<String> = Vec::new();
            let count = |rng: &mut Rng| {
                rng.pick(&[
                    "0",
                    "5",
                    "13",
                    "4096",
                    "18446744073709551615",
                    "18446744073709551616",
                    "1.0",
                    "-1",
                    "1e2",
                    "null",
                    r#""7""#,
                ])
                .to_owned()
            };
            let usual = self.rng.below(3) != 0;
            for name in ["prompt_tokens", "completion_tokens", "total_tokens"] {
                if usual || self.rng.below(4) != 0 {
                    let n = if usual {
                        (self.rng.below(5000)).to_string()
                    } else {
                        count(&mut self.rng)
                    };
                    members.push(format!(r#""{name}":{n}"#));
                }
            }
            for _ in 0..self.rng.below(3) {
                let extra = self.rng.pick(&[
                    r#""prompt_tokens_details":{"cached_tokens":0}"#,
                    r#""prompt_tokens_details":null"#,
                    r#""completion_tokens_details":{"reasoning_tokens":12,"x":[1,-2,{"a":"b"}]}"#,
                    r#""note":"a \"usage\" note""#,
                    r#""f":1.5"#,
                    r#""big":123456789012345678901234567890"#,
                    r#""t":true"#,
                    r#""prompt\u005ftokens":3"#,
                    r#""prompt_tokens":2"#,
                    r#""é":"ü""#,
                    r#""deep":[[[[[[[[[[1]]]]]]]]]]"#,
                ]);
                members.push(extra.to_owned());
            }
            // Shuffled.
            for i in (1..members.len()).rev() {
                members.swap(i, self.rng.below(i + 1));
            }
            let sep = self.rng.pick(&[",", ", ", " ,\n  "]);
            match self.rng.below(12) {
                0 => "null".to_owned(),
                1 => r#"[{"prompt_tokens":1}]"#.to_owned(),
                2 => r#""usage""#.to_owned(),
                _ => format!("{{{}}}", members.join(sep)),
            }
        }
    }

    /// A valid JSON document and the usage the scanner must find in it: `usage_from_json`'s,
    /// or none when the usage value is too long to be read.
    fn document(seed: u64) -> (String, Option<Usage>) {
        let mut g = Gen {
            rng: Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1),
            out: String::new(),
        };
        let mut usage = (g.rng.below(5) != 0).then(|| g.usage_value());
        // Sometimes around the longest value read: padded to that length exactly, one byte
        // shorter or one longer.
        if usage.is_some() && g.rng.below(12) == 0 {
            let shape = format!(r#"{{"pad":"","prompt_tokens":{}}}"#, g.rng.below(100));
            let len = MAX_USAGE_VALUE + 1 - g.rng.below(3);
            let pad = "p".repeat(len - shape.len());
            let padded = shape.replacen(r#""pad":"""#, &format!(r#""pad":"{pad}""#), 1);
            assert_eq!(padded.len(), len);
            usage = Some(padded);
        }
        g.blank();
        g.object(0, usage.as_deref());
        g.blank();
        let doc = g.out;
        serde_json::from_str::<serde_json::Value>(&doc).expect("the generator writes JSON");
        let too_long = usage.is_some_and(|u| u.len() > MAX_USAGE_VALUE);
        let want = if too_long {
            None
        } else {
            usage_from_json(doc.as_bytes())
        };
        (doc, want)
    }

    /// The scanner's usage for every split in two, a few random splits in more pieces, and
    /// byte by byte.
    fn check_splits(doc: &[u8], want: Option<Usage>, rng: &mut Rng) {
        let show = || String::from_utf8_lossy(doc).into_owned();
        assert_eq!(scan_json(&[doc]), want, "{}", show());
        for i in 0..=doc.len() {
            assert_eq!(
                scan_json(&[&doc[..i], &doc[i..]]),
                want,
                "split at {i}: {}",
                show()
            );
        }
        for _ in 0..4 {
            let mut cuts: Vec<usize> = (0..1 + rng.below(8))
                .map(|_| rng.below(doc.len() + 1))
                .collect();
            cuts.sort_unstable();
            let mut pieces = Vec::new();
            let mut from = 0;
            for cut in cuts {
                pieces.push(&doc[from..cut]);
                from = cut;
            }
            pieces.push(&doc[from..]);
            assert_eq!(scan_json(&pieces), want, "pieces {pieces:?}");
        }
        let bytes: Vec<&[u8]> = doc.chunks(1).collect();
        assert_eq!(scan_json(&bytes), want, "byte by byte: {}", show());
    }

    #[test]
    fn json_scanner_agrees_with_serde_at_every_split() {
        let mut rng = Rng(7);
        let mut found = 0;
        for seed in 0..300 {
            let (doc, want) = document(seed);
            found += usize::from(want.is_some());
            check_splits(doc.as_bytes(), want, &mut rng);
        }
        // The generator is not degenerate.
        assert!(found > 100, "{found}");
        let usage = r#"{"prompt_tokens":5,"completion_tokens":8,"total_tokens":13}"#;
        let content = "tok \\\"usage\\\" \\\\".repeat(40);
        for doc in [
            BODY.to_owned(),
            format!(r#"{{"usage":{usage}}}"#),
            format!(r#"  {{ "usage" : {usage} , "x" : 1 }}  "#),
            format!(r#"{{"a":"{content}","b":["usage",{{"usage":{usage}}}],"usage":{usage}}}"#),
            format!(r#"{{"usage":{usage},"a":"{content}","c":{{"usage":{{"prompt_tokens":1}}}}}}"#),
            r#"{"a":"usage","b":"\"usage\"","usage":null}"#.to_owned(),
            format!(r#"{{"a":{{"b":"}}]\"\\"}},"usage":{usage}}}"#),
            format!(r#"{{"🚀":"é","usage":{{"prompt_tokens":1,"x":"{content}"}}}}"#),
        ] {
            let want = usage_from_json(doc.as_bytes());
            check_splits(doc.as_bytes(), want, &mut rng);
        }
    }

    #[test]
    fn usage_values_read_by_hand_as_serde_reads_them() {
        let mut g = Gen {
            rng: Rng(11),
            out: String::new(),
        };
        for _ in 0..3000 {
            let mut v = g.usage_value().into_bytes();
            // Some broken: a byte changed or dropped.
            if g.rng.below(3) == 0 && !v.is_empty() {
                let at = g.rng.below(v.len());
                if g.rng.below(2) == 0 {
                    v.remove(at);
                } else {
                    v[at] = b"{}[]\":,0-. e\\x"[g.rng.below(14)];
                }
            }
            let serde = serde_json::from_slice::<UsageProbe>(&v)
                .ok()
                .map(Usage::from);
            assert_eq!(usage_value(&v), serde, "{}", String::from_utf8_lossy(&v));
        }
    }

    #[test]
    fn json_split_usage_value_is_bounded() {
        let long = format!(
            r#"{{"usage":{{"prompt_tokens":1,"pad":"{}"}},"x":1}}"#,
            "x".repeat(3 * MAX_USAGE_VALUE)
        );
        for size in [1, 7, 100, 1000] {
            let mut s = JsonUsageScanner::new();
            for c in long.as_bytes().chunks(size) {
                s.feed(c);
                assert!(s.value.capacity() <= 2 * MAX_USAGE_VALUE);
            }
            assert_eq!(s.usage(), None);
        }
        // The scanner reads the last top-level usage it can (serde refuses duplicate keys).
        let doc = format!(
            r#"{{"usage":{{"prompt_tokens":1,"pad":"{}"}},"x":1,"usage":{{"prompt_tokens":2}}}}"#,
            "x".repeat(3 * MAX_USAGE_VALUE)
        );
        let mut s = JsonUsageScanner::new();
        for c in doc.as_bytes().chunks(100) {
            s.feed(c);
        }
        assert_eq!(s.usage().map(|u| u.prompt_tokens), Some(2));
    }

    #[test]
    fn include_usage_is_added_after_the_opening_brace() {
        let body = br#" {"model":"m","stream":true,"messages":[]}"#;
        assert!(
            crate::route::read_json_request(body)
                .unwrap()
                .streamed_without_options
        );
        let out = add_include_usage(body).unwrap();
        assert_eq!(
            out,
            br#" {"stream_options":{"include_usage":true},"model":"m","stream":true,"messages":[]}"#
        );
        let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["stream_options"]["include_usage"], true);
        assert_eq!(add_include_usage(b"[]"), None);
        assert_eq!(add_include_usage(b"  "), None);
    }
}
