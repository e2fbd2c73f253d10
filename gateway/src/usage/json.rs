//! The top-level `usage` of a non-streamed JSON body, found without parsing the body.

use super::value::usage_value;
use super::{MAX_USAGE_VALUE, Usage, is_blank};

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
    pub(super) value: Vec<u8>,
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
