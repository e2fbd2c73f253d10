//! An incremental Server-Sent Events reader for OpenAI-style streams.
//!
//! It follows the SSE line rules (`data:` lines joined, `event:` names, `:` comments, `\n` or
//! `\r\n` line ends, an event dispatched on a blank line) and classifies each event for the
//! measurements: a chunk with content (a token), a finish reason, the usage, the final
//! `[DONE]`, or an error (an `event: error`, a JSON `error` object, or data that is not JSON).

use std::borrow::Cow;

use serde::Deserialize;

/// What one SSE event means for the measurements.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SseEvent {
    /// A choice carried text (`delta.content`, `delta.reasoning_content` or `text`).
    pub content: bool,
    /// A choice carried a `finish_reason`: the answer is complete (some engines, such as
    /// `transformers serve`, then end the stream without `[DONE]`).
    pub finish: bool,
    /// `usage.completion_tokens`, when the chunk carries usage.
    pub completion_tokens: Option<u64>,
    /// `usage.prompt_tokens`, when the chunk carries usage.
    pub prompt_tokens: Option<u64>,
    /// `usage.prompt_tokens_details.cached_tokens`: prompt tokens the engine found in its
    /// prefix cache, when it says.
    pub cached_tokens: Option<u64>,
    /// `data: [DONE]`.
    pub done: bool,
    /// The server reported an error in the stream, or sent something unreadable.
    pub error: bool,
}

/// Splits a byte stream into events.
#[derive(Debug, Default)]
pub struct SseReader {
    /// Bytes not yet ending a line.
    buf: Vec<u8>,
    /// The `data` of the event being read.
    data: Vec<u8>,
    has_data: bool,
    error_event: bool,
}

impl SseReader {
    /// A reader at the start of a stream.
    pub fn new() -> Self {
        Self::default()
    }

    /// Clears the state for a new stream (keeps the buffers' memory).
    pub fn reset(&mut self) {
        self.buf.clear();
        self.data.clear();
        self.has_data = false;
        self.error_event = false;
    }

    /// Feeds bytes; calls `on_event` for each event they complete.
    pub fn feed(&mut self, bytes: &[u8], mut on_event: impl FnMut(SseEvent)) {
        let Self {
            buf,
            data,
            has_data,
            error_event,
        } = self;
        // Lines wholly inside `bytes` are read in place; a partial line waits in `buf`.
        let mut rest = bytes;
        while let Some(i) = memchr::memchr(b'\n', rest) {
            let (line, tail) = (&rest[..i], &rest[i + 1..]);
            rest = tail;
            if buf.is_empty() {
                handle_line(line, data, has_data, error_event, &mut on_event);
            } else {
                buf.extend_from_slice(line);
                let line = std::mem::take(buf);
                handle_line(&line, data, has_data, error_event, &mut on_event);
                *buf = line;
                buf.clear();
            }
        }
        buf.extend_from_slice(rest);
    }
}

fn handle_line(
    line: &[u8],
    data: &mut Vec<u8>,
    has_data: &mut bool,
    error_event: &mut bool,
    on_event: &mut impl FnMut(SseEvent),
) {
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    if line.is_empty() {
        if *has_data || *error_event {
            on_event(classify(data, *error_event));
        }
        data.clear();
        *has_data = false;
        *error_event = false;
        return;
    }
    if line.starts_with(b":") {
        return; // a comment (keep-alive)
    }
    let (field, value) = match memchr::memchr(b':', line) {
        Some(i) => {
            let v = &line[i + 1..];
            (&line[..i], v.strip_prefix(b" ").unwrap_or(v))
        }
        None => (line, &b""[..]),
    };
    match field {
        b"data" => {
            if *has_data {
                data.push(b'\n');
            }
            data.extend_from_slice(value);
            *has_data = true;
        }
        b"event" => *error_event = value == b"error",
        _ => {}
    }
}

#[derive(Deserialize)]
struct Chunk<'a> {
    #[serde(default, borrow)]
    choices: Vec<Choice<'a>>,
    #[serde(default)]
    usage: Option<Usage>,
    #[serde(default)]
    error: Option<serde::de::IgnoredAny>,
}

#[derive(Deserialize)]
struct Choice<'a> {
    #[serde(default, borrow)]
    delta: Option<Delta<'a>>,
    #[serde(default, borrow)]
    text: Option<Cow<'a, str>>,
    #[serde(default)]
    finish_reason: Option<serde::de::IgnoredAny>,
}

#[derive(Deserialize)]
struct Delta<'a> {
    #[serde(default, borrow)]
    content: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    reasoning_content: Option<Cow<'a, str>>,
}

/// `usage` of an answer or chunk.
#[derive(Deserialize)]
pub(crate) struct Usage {
    #[serde(default)]
    pub(crate) completion_tokens: Option<u64>,
    #[serde(default)]
    pub(crate) prompt_tokens: Option<u64>,
    #[serde(default)]
    prompt_tokens_details: Option<PromptTokensDetails>,
}

#[derive(Deserialize)]
struct PromptTokensDetails {
    #[serde(default)]
    cached_tokens: Option<u64>,
}

impl Usage {
    /// `prompt_tokens_details.cached_tokens`.
    pub(crate) fn cached_tokens(&self) -> Option<u64> {
        self.prompt_tokens_details
            .as_ref()
            .and_then(|d| d.cached_tokens)
    }
}

fn classify(data: &[u8], error_event: bool) -> SseEvent {
    let mut event = SseEvent {
        error: error_event,
        ..SseEvent::default()
    };
    if data == b"[DONE]" {
        event.done = true;
        return event;
    }
    match serde_json::from_slice::<Chunk<'_>>(data) {
        Ok(chunk) => {
            event.error |= chunk.error.is_some();
            if let Some(u) = &chunk.usage {
                event.completion_tokens = u.completion_tokens;
                event.prompt_tokens = u.prompt_tokens;
                event.cached_tokens = u.cached_tokens();
            }
            event.finish = chunk.choices.iter().any(|c| c.finish_reason.is_some());
            event.content = chunk.choices.iter().any(|c| {
                let non_empty =
                    |s: &Option<Cow<'_, str>>| s.as_deref().is_some_and(|s| !s.is_empty());
                non_empty(&c.text)
                    || c.delta
                        .as_ref()
                        .is_some_and(|d| non_empty(&d.content) || non_empty(&d.reasoning_content))
            });
        }
        Err(_) => event.error = true,
    }
    event
}

#[cfg(test)]
mod tests {
    use super::*;

    fn events(chunks: &[&[u8]]) -> Vec<SseEvent> {
        let mut r = SseReader::new();
        let mut out = Vec::new();
        for c in chunks {
            r.feed(c, |e| out.push(e));
        }
        out
    }

    #[test]
    fn splits_events_across_reads_and_line_ends() {
        let stream: &[u8] = b"data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\n: ping\n\ndata: {\"choices\":[{\"delta\":{\"role\":\"assistant\"}}]}\r\n\r\ndata: {\"choices\":[],\"usage\":{\"completion_tokens\":7}}\n\ndata: [DONE]\n\n";
        let whole = events(&[stream]);
        for cut in 0..stream.len() {
            assert_eq!(
                events(&[&stream[..cut], &stream[cut..]]),
                whole,
                "cut at {cut}"
            );
        }
        let bytewise: Vec<&[u8]> = stream.chunks(1).collect();
        assert_eq!(events(&bytewise), whole);
        assert_eq!(whole.len(), 4);
        assert!(whole[0].content);
        assert!(!whole[1].content);
        assert_eq!(whole[2].completion_tokens, Some(7));
        assert!(whole[3].done);
        assert!(whole.iter().all(|e| !e.error));
    }

    #[test]
    fn reads_finish_reasons_and_prompt_usage() {
        let got = events(&[
            b"data: {\"choices\":[{\"delta\":{\"content\":\"a\"},\"finish_reason\":null}]}\n\n",
            b"data: {\"choices\":[{\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n",
            b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":90,\"completion_tokens\":1,\"prompt_tokens_details\":{\"cached_tokens\":64}}}\n\n",
            b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"prompt_tokens_details\":null}}\n\n",
        ]);
        assert_eq!(
            got.iter().map(|e| e.finish).collect::<Vec<_>>(),
            [false, true, false, false]
        );
        assert_eq!(
            (got[2].prompt_tokens, got[2].cached_tokens),
            (Some(90), Some(64))
        );
        assert_eq!(
            (got[3].prompt_tokens, got[3].cached_tokens),
            (Some(5), None)
        );
        assert!(got.iter().all(|e| !e.error));
    }

    #[test]
    fn recognises_errors() {
        let got = events(&[
            b"event: error\ndata: {\"message\":\"boom\"}\n\n",
            b"data: {\"error\":{\"message\":\"x\"}}\n\n",
            b"data: not json\n\n",
            b"data: {\"choices\":[{\"text\":\"a\"}]}\n\n",
        ]);
        assert_eq!(
            got.iter().map(|e| e.error).collect::<Vec<_>>(),
            [true, true, true, false]
        );
        assert!(got[3].content);
    }

    /// A recorded stream of `transformers serve`: no `[DONE]`, a finish reason, then usage.
    #[test]
    fn a_finish_reason_ends_a_stream_without_done() {
        let stream = include_bytes!("../../tests/fixtures/transformers-serve-stream.sse");
        let got = events(&[stream]);
        assert!(got.iter().all(|e| !e.done && !e.error));
        let finished = got.iter().position(|e| e.finish).unwrap();
        assert_eq!(finished, got.len() - 2, "the usage chunk follows");
        assert_eq!(got.last().unwrap().completion_tokens, Some(128));
        let null: &[u8] =
            b"data: {\"choices\":[{\"delta\":{\"content\":\"a\"},\"finish_reason\":null}]}\n\n";
        assert!(!events(&[null])[0].finish);
    }
}
