//! One `usage` value read: by hand in its usual shape, by serde otherwise.

use super::{Usage, UsageProbe, is_blank};

/// A usage value: read by hand in its usual shape, by serde otherwise.
pub(super) fn usage_value(v: &[u8]) -> Option<Usage> {
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
