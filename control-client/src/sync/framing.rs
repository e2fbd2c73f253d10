//! Splits a watch body into events.
//!
//! GPUStack serves its watch streams as `text/event-stream` but without SSE's `data:` prefix:
//! every event is one JSON object followed by a blank line, and the heartbeat is an empty event
//! (just blank lines). Body frames arrive at arbitrary boundaries (a frame may hold half an event
//! or several), so [`EventFramer`] buffers bytes until a blank line closes an event.
//!
//! The framer also reads standard SSE (`data:` lines, `:` comments), so the client keeps working
//! if a server adopts proper SSE framing; a block is JSON when it starts with `{`.

use std::borrow::Cow;

use bytes::{Bytes, BytesMut};

/// Largest event the framer buffers (16 MiB). A server that never closes an event cannot make the
/// client grow its buffer beyond this; it gets a [`FrameError`] and a reconnect instead.
pub(crate) const MAX_EVENT_BYTES: usize = 16 * 1024 * 1024;

/// The buffered, incomplete event outgrew the limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("watch event larger than {limit} bytes")]
pub struct FrameError {
    pub limit: usize,
}

/// Incremental splitter of a watch body into event blocks.
///
/// Feed body frames with [`push`](Self::push), then take every complete block with
/// [`next_block`](Self::next_block). Blank lines end a block; `\r\n` line ends are accepted
/// anywhere. Blocks made only of whitespace (heartbeats) are dropped here.
#[derive(Debug)]
pub(crate) struct EventFramer {
    buf: BytesMut,
    limit: usize,
    /// Start of the line being scanned, relative to `buf`.
    line_start: usize,
    /// Bytes of `buf` already searched for a newline, so that a slow event is scanned once.
    scanned: usize,
}

impl EventFramer {
    /// A framer that refuses to buffer more than `limit` bytes of an unfinished event.
    pub(crate) fn new(limit: usize) -> Self {
        Self {
            buf: BytesMut::new(),
            limit,
            line_start: 0,
            scanned: 0,
        }
    }

    /// Appends one body frame. Call [`next_block`](Self::next_block) until it returns `None`
    /// before pushing again, so that only an unfinished event stays buffered.
    pub(crate) fn push(&mut self, data: &[u8]) -> Result<(), FrameError> {
        if self.buf.len().saturating_add(data.len()) > self.limit {
            return Err(FrameError { limit: self.limit });
        }
        self.buf.extend_from_slice(data);
        Ok(())
    }

    /// Bytes buffered for an event that has not ended yet.
    pub(crate) fn pending(&self) -> usize {
        self.buf.len()
    }

    /// The next complete, non-blank event block (without its terminating blank line).
    pub(crate) fn next_block(&mut self) -> Option<Bytes> {
        loop {
            let Some(offset) = self.buf[self.scanned..].iter().position(|&b| b == b'\n') else {
                self.scanned = self.buf.len();
                return None;
            };
            let newline = self.scanned + offset;
            let line = &self.buf[self.line_start..newline];
            if !line.is_empty() && line != b"\r" {
                self.line_start = newline + 1;
                self.scanned = newline + 1;
                continue;
            }
            // A blank line: the lines before it, without the last line end, are one block.
            let content = &self.buf[..self.line_start];
            let content = content.strip_suffix(b"\n").unwrap_or(content);
            let block_len = content.strip_suffix(b"\r").unwrap_or(content).len();
            let mut block = self.buf.split_to(newline + 1);
            block.truncate(block_len);
            self.line_start = 0;
            self.scanned = 0;
            if !block.iter().all(u8::is_ascii_whitespace) {
                return Some(block.freeze());
            }
        }
    }
}

/// The JSON text of an event block, or `None` for a block without data (an SSE comment used as
/// a heartbeat, or an SSE event without `data:` lines).
///
/// A block that starts with `{` is GPUStack's bare JSON and is returned as is (borrowed). Any
/// other block is read as SSE fields: `data:` lines are joined with `\n`, comments (`:`) and
/// other fields (`event:`, `id:`, `retry:`) are ignored. A block that is neither stays as is so
/// that the JSON parser reports it as malformed instead of it vanishing silently.
pub(crate) fn payload(block: &[u8]) -> Option<Cow<'_, [u8]>> {
    let text = block.trim_ascii();
    if text.is_empty() {
        return None;
    }
    if text.starts_with(b"{") || !starts_with_sse_field(text) {
        return Some(Cow::Borrowed(text));
    }
    let mut data: Option<Vec<u8>> = None;
    for line in text.split(|&b| b == b'\n') {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if let Some(value) = line.strip_prefix(b"data:") {
            let value = value.strip_prefix(b" ").unwrap_or(value);
            let joined = data.get_or_insert_with(Vec::new);
            if !joined.is_empty() {
                joined.push(b'\n');
            }
            joined.extend_from_slice(value);
        }
    }
    data.map(Cow::Owned)
}

fn starts_with_sse_field(text: &[u8]) -> bool {
    [&b":"[..], b"data:", b"event:", b"id:", b"retry:"]
        .iter()
        .any(|field| text.starts_with(field))
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn blocks_of(chunks: &[&[u8]]) -> Vec<Bytes> {
        let mut framer = EventFramer::new(MAX_EVENT_BYTES);
        let mut out = Vec::new();
        for chunk in chunks {
            framer.push(chunk).unwrap();
            while let Some(block) = framer.next_block() {
                out.push(block);
            }
        }
        out
    }

    #[test]
    fn splits_events_on_blank_lines() {
        let out = blocks_of(&[b"{\"a\":1}\n\n{\"b\":2}\n\n"]);
        assert_eq!(
            out,
            vec![Bytes::from("{\"a\":1}"), Bytes::from("{\"b\":2}")]
        );
    }

    #[test]
    fn holds_an_unfinished_event() {
        let mut framer = EventFramer::new(MAX_EVENT_BYTES);
        framer.push(b"{\"a\":").unwrap();
        assert_eq!(framer.next_block(), None);
        framer.push(b"1}\n").unwrap();
        assert_eq!(framer.next_block(), None);
        framer.push(b"\n{\"b\"").unwrap();
        assert_eq!(framer.next_block(), Some(Bytes::from("{\"a\":1}")));
        assert_eq!(framer.next_block(), None);
        assert_eq!(framer.pending(), 4);
    }

    #[test]
    fn drops_heartbeats_and_accepts_crlf() {
        let out = blocks_of(&[b"\n\n\r\n\r\n{\"a\":1}\r\n\r\n\n\n  \n\n{\"b\":2}\n\r\n"]);
        assert_eq!(
            out,
            vec![Bytes::from("{\"a\":1}"), Bytes::from("{\"b\":2}")]
        );
    }

    #[test]
    fn keeps_multi_line_json_together() {
        let out = blocks_of(&[b"{\n  \"a\": 1\n}\n\n"]);
        assert_eq!(out, vec![Bytes::from("{\n  \"a\": 1\n}")]);
    }

    #[test]
    fn refuses_to_buffer_beyond_the_limit() {
        let mut framer = EventFramer::new(8);
        framer.push(b"{\"a\":").unwrap();
        assert_eq!(framer.push(b"1234"), Err(FrameError { limit: 8 }));
        // Complete events are taken out, so a long stream of small events never trips the limit.
        let mut framer = EventFramer::new(8);
        for _ in 0..100 {
            framer.push(b"{}\n\n").unwrap();
            assert_eq!(framer.next_block(), Some(Bytes::from("{}")));
        }
    }

    #[test]
    fn payload_of_bare_json_is_borrowed() {
        let p = payload(b"  {\"type\":1}\r\n").unwrap();
        assert!(matches!(p, Cow::Borrowed(_)));
        assert_eq!(&*p, b"{\"type\":1}");
    }

    #[test]
    fn payload_reads_sse_fields() {
        assert_eq!(
            payload(b"event: update\r\ndata: {\"type\":\ndata: 1}\nid: 7").as_deref(),
            Some(&b"{\"type\":\n1}"[..])
        );
        assert_eq!(payload(b": keep-alive"), None);
        assert_eq!(payload(b"event: ping"), None);
    }

    #[test]
    fn payload_keeps_garbage_for_the_parser_to_reject() {
        assert_eq!(payload(b"<html>").as_deref(), Some(&b"<html>"[..]));
    }

    /// Serialises events as GPUStack does, with heartbeats and line-end styles mixed in.
    fn stream_strategy() -> impl Strategy<Value = (Vec<String>, Vec<u8>)> {
        let event =
            (0u8..4, "[a-z0-9 ]{0,40}").prop_map(|(t, s)| format!(r#"{{"type":{t},"s":"{s}"}}"#));
        let item = (event, 0usize..3, any::<bool>());
        proptest::collection::vec(item, 0..12).prop_map(|items| {
            let mut wire = Vec::new();
            let mut events = Vec::new();
            for (event, heartbeats, crlf) in items {
                let end: &[u8] = if crlf { b"\r\n\r\n" } else { b"\n\n" };
                for _ in 0..heartbeats {
                    wire.extend_from_slice(end);
                }
                wire.extend_from_slice(event.as_bytes());
                wire.extend_from_slice(end);
                events.push(event);
            }
            (events, wire)
        })
    }

    proptest! {
        #[test]
        fn any_chunking_yields_the_same_events(
            (events, wire) in stream_strategy(),
            cuts in proptest::collection::vec(any::<prop::sample::Index>(), 0..20),
        ) {
            let mut cuts: Vec<usize> = cuts.iter().map(|i| i.index(wire.len() + 1)).collect();
            cuts.sort_unstable();
            let mut chunks: Vec<&[u8]> = Vec::new();
            let mut start = 0;
            for cut in cuts.into_iter().chain(std::iter::once(wire.len())) {
                chunks.push(&wire[start..cut]);
                start = cut;
            }
            let got: Vec<String> = blocks_of(&chunks)
                .iter()
                .map(|b| String::from_utf8(b.to_vec()).unwrap())
                .collect();
            prop_assert_eq!(got, events);
        }
    }
}
