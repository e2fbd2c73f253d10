//! The readings as they travel: newline-delimited JSON, one line per interval.
//!
//! Worker → server (`POST /v2/worker-load`, the body streamed) and server → gateway
//! (`GET /v2/worker-load?watch=true`) carry the same line:
//!
//! ```json
//! {"readings":[{"id":12,"waiting":3,"running":8,"kv_usage":0.41,"block_size":16,"num_blocks":4096,"epoch":1733,"age_ms":7}]}
//! ```
//!
//! Each reading carries its age when the line was written, not a time: the receiver sets
//! `taken` on its own clock (now − age), so no two clocks need to agree. Members not known here
//! are ignored, so that a newer sender can add some.

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use super::{EngineLoad, MAX_AGE, Reading};

/// Longest line read; longer ones end the stream. One reading takes about 120 bytes.
pub const MAX_LINE_BYTES: usize = 256 * 1024;

/// One instance's reading on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct WireReading {
    /// The model instance.
    pub id: i64,
    pub waiting: u32,
    pub running: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_usage: Option<f32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_size: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_blocks: Option<u64>,
    #[serde(default)]
    pub epoch: u64,
    /// Milliseconds since the engine was read, when the line was written.
    pub age_ms: u64,
}

impl WireReading {
    /// `reading` of instance `id`, aged as of `now`.
    pub fn new(id: i64, reading: &Reading, now: Instant) -> Self {
        let age = now.saturating_duration_since(reading.taken);
        let load = reading.load;
        Self {
            id,
            waiting: load.waiting,
            running: load.running,
            kv_usage: load.kv_usage,
            block_size: load.block_size,
            num_blocks: load.num_blocks,
            epoch: load.epoch,
            age_ms: u64::try_from(age.as_millis()).unwrap_or(u64::MAX),
        }
    }

    /// The reading on this process's clock; `None` when it is too old to route by (or its age
    /// is beyond this clock's past). A usage outside 0..1 is dropped.
    pub fn reading(&self, now: Instant) -> Option<Reading> {
        let age = Duration::from_millis(self.age_ms);
        if age > MAX_AGE {
            return None;
        }
        Some(Reading {
            load: EngineLoad {
                waiting: self.waiting,
                running: self.running,
                kv_usage: self
                    .kv_usage
                    .filter(|u| u.is_finite() && (0.0..=1.0).contains(u)),
                block_size: self.block_size.filter(|b| *b > 0),
                num_blocks: self.num_blocks,
                epoch: self.epoch,
            },
            taken: now.checked_sub(age)?,
        })
    }
}

/// One line of either stream.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LoadLine {
    #[serde(default)]
    pub readings: Vec<WireReading>,
}

impl LoadLine {
    /// The line as sent, `\n` included.
    pub fn to_bytes(&self) -> Bytes {
        // Serialising plain numbers cannot fail.
        let mut out = serde_json::to_vec(self).unwrap_or_else(|_| b"{}".to_vec());
        out.push(b'\n');
        Bytes::from(out)
    }

    /// Reads one line (without its `\n`).
    pub fn parse(line: &[u8]) -> Result<Self, serde_json::Error> {
        serde_json::from_slice(line)
    }
}

/// A line longer than the limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("a line longer than {limit} bytes")]
pub struct LineTooLong {
    pub limit: usize,
}

/// Splits a byte stream into lines of at most `limit` bytes (line end left out), holding at
/// most that much (and a `\r`) of an unfinished one.
#[derive(Debug)]
pub struct Lines {
    buf: BytesMut,
    limit: usize,
    /// Bytes of `buf` already searched for a `\n`.
    scanned: usize,
}

impl Lines {
    pub fn new(limit: usize) -> Self {
        Self {
            buf: BytesMut::new(),
            limit,
            scanned: 0,
        }
    }

    /// Appends received bytes. Take every line with [`Lines::next_line`] before pushing again.
    pub fn push(&mut self, data: &[u8]) -> Result<(), LineTooLong> {
        self.buf.extend_from_slice(data);
        self.check()
    }

    fn check(&mut self) -> Result<(), LineTooLong> {
        let unfinished = match memchr::memchr(b'\n', &self.buf[self.scanned..]) {
            Some(_) => 0,
            None => self.buf.len(),
        };
        // One more byte may be the `\r` of a line end.
        if unfinished > self.limit + 1 {
            return Err(LineTooLong { limit: self.limit });
        }
        Ok(())
    }

    /// The next whole line, without its `\n` (and a `\r` before it); blank lines are skipped.
    pub fn next_line(&mut self) -> Result<Option<Bytes>, LineTooLong> {
        loop {
            let Some(at) = memchr::memchr(b'\n', &self.buf[self.scanned..]) else {
                self.scanned = self.buf.len();
                self.check()?;
                return Ok(None);
            };
            let end = self.scanned + at;
            let mut line = self.buf.split_to(end + 1).freeze();
            self.scanned = 0;
            line.truncate(end);
            if line.last() == Some(&b'\r') {
                line.truncate(end - 1);
            }
            if line.len() > self.limit {
                return Err(LineTooLong { limit: self.limit });
            }
            if !line.trim_ascii().is_empty() {
                return Ok(Some(line));
            }
        }
    }

    /// Bytes held of an unfinished line.
    pub fn pending(&self) -> usize {
        self.buf.len()
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn all(lines: &mut Lines) -> Vec<Bytes> {
        let mut out = Vec::new();
        while let Some(line) = lines.next_line().unwrap() {
            out.push(line);
        }
        out
    }

    #[test]
    fn lines_are_split_whatever_the_chunks() {
        let mut lines = Lines::new(16);
        lines.push(b"ab").unwrap();
        assert!(all(&mut lines).is_empty());
        lines.push(b"c\r\n\n  \nd").unwrap();
        assert_eq!(all(&mut lines), [Bytes::from_static(b"abc")]);
        assert_eq!(lines.pending(), 1);
        lines.push(b"\n").unwrap();
        assert_eq!(all(&mut lines), [Bytes::from_static(b"d")]);
        assert_eq!(lines.pending(), 0);
    }

    #[test]
    fn a_long_line_is_refused_at_the_limit() {
        let mut lines = Lines::new(4);
        lines.push(b"1234\r").unwrap();
        assert_eq!(lines.push(b"5"), Err(LineTooLong { limit: 4 }));
        // Several whole lines in one push are fine, however long the push.
        let mut lines = Lines::new(4);
        lines.push(b"1234\n1234\n1234\n").unwrap();
        assert_eq!(all(&mut lines).len(), 3);
        // A long line inside a push is refused when it is reached.
        let mut lines = Lines::new(4);
        lines.push(b"1\n123456\n").unwrap();
        assert_eq!(
            lines.next_line().unwrap().unwrap(),
            Bytes::from_static(b"1")
        );
        assert!(lines.next_line().is_err());
    }

    proptest! {
        #[test]
        fn chunking_does_not_change_the_lines(
            text in proptest::collection::vec(prop_oneof![Just(b'\n'), Just(b'\r'), Just(b' '), Just(b'x')], 0..200),
            cuts in proptest::collection::vec(0usize..200, 0..10),
        ) {
            let limit = 8;
            let expected: Result<Vec<Bytes>, ()> = {
                let mut out = Vec::new();
                let mut failed = false;
                let mut rest = &text[..];
                while let Some(at) = rest.iter().position(|b| *b == b'\n') {
                    let mut line = &rest[..at];
                    if line.last() == Some(&b'\r') {
                        line = &line[..line.len() - 1];
                    }
                    if line.len() > limit {
                        failed = true;
                        break;
                    }
                    if !line.trim_ascii().is_empty() {
                        out.push(Bytes::copy_from_slice(line));
                    }
                    rest = &rest[at + 1..];
                }
                if failed || rest.len() > limit + 1 { Err(()) } else { Ok(out) }
            };
            let mut cuts: Vec<usize> = cuts.into_iter().filter(|c| *c <= text.len()).collect();
            cuts.push(0);
            cuts.push(text.len());
            cuts.sort_unstable();
            let mut lines = Lines::new(limit);
            let mut got = Vec::new();
            let mut result = Ok(());
            'chunks: for pair in cuts.windows(2) {
                if let Err(e) = lines.push(&text[pair[0]..pair[1]]) {
                    result = Err(e);
                    break;
                }
                loop {
                    match lines.next_line() {
                        Ok(Some(line)) => got.push(line),
                        Ok(None) => break,
                        Err(e) => { result = Err(e); break 'chunks; }
                    }
                }
            }
            match expected {
                Ok(lines) => {
                    prop_assert!(result.is_ok());
                    prop_assert_eq!(got, lines);
                }
                Err(()) => prop_assert!(result.is_err()),
            }
        }
    }

    #[tokio::test(start_paused = true)]
    async fn readings_travel_with_their_age() {
        let t0 = Instant::now();
        tokio::time::advance(Duration::from_secs(10)).await;
        let reading = Reading {
            load: EngineLoad {
                waiting: 2,
                running: 3,
                kv_usage: Some(0.5),
                block_size: Some(16),
                num_blocks: Some(100),
                epoch: 7,
            },
            taken: Instant::now(),
        };
        tokio::time::advance(Duration::from_millis(40)).await;
        let line = LoadLine {
            readings: vec![WireReading::new(5, &reading, Instant::now())],
        };
        let bytes = line.to_bytes();
        assert!(bytes.ends_with(b"}\n"));
        let back = LoadLine::parse(&bytes[..bytes.len() - 1]).unwrap();
        assert_eq!(back, line);
        assert_eq!(back.readings[0].age_ms, 40);
        let now = Instant::now();
        assert_eq!(back.readings[0].reading(now), Some(reading));
        assert!(t0 < now);
        // Too old, or a usage that cannot be: dropped.
        let old = WireReading {
            age_ms: 2_001,
            ..back.readings[0]
        };
        assert_eq!(old.reading(now), None);
        let odd = WireReading {
            kv_usage: Some(f32::NAN),
            ..back.readings[0]
        };
        assert_eq!(odd.reading(now).unwrap().load.kv_usage, None);
        // Unknown members are ignored; missing optional ones are none.
        let newer = LoadLine::parse(
            br#"{"readings":[{"id":1,"waiting":0,"running":1,"age_ms":0,"queue_tokens":5}],"x":1}"#,
        )
        .unwrap();
        assert_eq!(newer.readings[0].kv_usage, None);
    }
}
