//! The usage of an event stream: the last `data:` event that carries one.

use std::sync::LazyLock;

use super::{MAX_LINE, Usage, usage_from_json};

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
pub(super) fn only_null_usage(data: &[u8]) -> bool {
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
