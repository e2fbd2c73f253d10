//! The bytes of an answer: its SSE events, or its whole JSON body.

use std::sync::Arc;

use bytes::Bytes;

/// What a generation endpoint streams.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StreamKind {
    /// `/v1/chat/completions`
    Chat,
    /// `/v1/completions`
    Completion,
}

pub(crate) fn response_id(kind: StreamKind, seq: u64) -> String {
    match kind {
        StreamKind::Chat => format!("chatcmpl-mock-{seq}"),
        StreamKind::Completion => format!("cmpl-mock-{seq}"),
    }
}

pub(crate) fn prompt_tokens(body: &[u8]) -> usize {
    (body.len() / 4).max(1)
}

/// Renders the chunks of one answer; public through [`expected_stream`].
#[derive(Debug)]
pub(crate) struct Render {
    pub(crate) kind: StreamKind,
    pub(crate) id: Arc<str>,
    pub(crate) model_json: Arc<str>,
    pub(crate) created: u64,
    pub(crate) tokens: usize,
    pub(crate) prompt_tokens: usize,
    /// `usage.prompt_tokens_details.cached_tokens` (`None`: no details, as without the model).
    pub(crate) cached_tokens: Option<usize>,
    /// Bytes per token text (0: natural).
    pub(crate) pad: usize,
}

impl Render {
    /// Appends the text of token `i`: `tok{i} `, padded with `x` before the space to `pad` bytes.
    fn push_token(&self, i: usize, out: &mut String) {
        let start = out.len();
        out.push_str("tok");
        out.push_str(&i.to_string());
        let len = out.len() - start + 1;
        for _ in len..self.pad {
            out.push('x');
        }
        out.push(' ');
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.kind, chunk) {
            (StreamKind::Chat, true) => "chat.completion.chunk",
            (StreamKind::Chat, false) => "chat.completion",
            (StreamKind::Completion, _) => "text_completion",
        }
    }

    fn usage(&self) -> String {
        let (p, t, c) = (
            self.prompt_tokens,
            self.prompt_tokens + self.tokens,
            self.tokens,
        );
        match self.cached_tokens {
            None => {
                format!(r#"{{"prompt_tokens":{p},"total_tokens":{t},"completion_tokens":{c}}}"#)
            }
            Some(cached) => format!(
                r#"{{"prompt_tokens":{p},"total_tokens":{t},"completion_tokens":{c},"prompt_tokens_details":{{"cached_tokens":{cached}}}}}"#
            ),
        }
    }

    /// The SSE event of token `i`.
    pub(crate) fn token_event(&self, i: usize) -> Bytes {
        let finish = if i + 1 == self.tokens {
            r#""length""#
        } else {
            "null"
        };
        let mut text = String::with_capacity(self.pad.max(8));
        self.push_token(i, &mut text);
        let choice = match self.kind {
            StreamKind::Chat if i == 0 => format!(
                r#"{{"index":0,"delta":{{"role":"assistant","content":"{text}"}},"logprobs":null,"finish_reason":{finish}}}"#
            ),
            StreamKind::Chat => format!(
                r#"{{"index":0,"delta":{{"content":"{text}"}},"logprobs":null,"finish_reason":{finish}}}"#
            ),
            StreamKind::Completion => {
                format!(r#"{{"index":0,"text":"{text}","logprobs":null,"finish_reason":{finish}}}"#)
            }
        };
        Bytes::from(format!(
            "data: {{\"id\":\"{id}\",\"object\":\"{o}\",\"created\":{c},\"model\":{m},\"choices\":[{choice}]}}\n\n",
            id = self.id,
            o = self.object(true),
            c = self.created,
            m = self.model_json,
        ))
    }

    pub(crate) fn usage_event(&self) -> Bytes {
        Bytes::from(format!(
            "data: {{\"id\":\"{id}\",\"object\":\"{o}\",\"created\":{c},\"model\":{m},\"choices\":[],\"usage\":{u}}}\n\n",
            id = self.id,
            o = self.object(true),
            c = self.created,
            m = self.model_json,
            u = self.usage(),
        ))
    }

    pub(crate) fn full(&self) -> String {
        let mut text = String::with_capacity(self.tokens * self.pad.max(6));
        for i in 0..self.tokens {
            self.push_token(i, &mut text);
        }
        let choice = match self.kind {
            StreamKind::Chat => format!(
                r#"{{"index":0,"message":{{"role":"assistant","content":"{text}"}},"logprobs":null,"finish_reason":"length"}}"#
            ),
            StreamKind::Completion => {
                format!(r#"{{"index":0,"text":"{text}","logprobs":null,"finish_reason":"length"}}"#)
            }
        };
        format!(
            r#"{{"id":"{id}","object":"{o}","created":{c},"model":{m},"choices":[{choice}],"usage":{u}}}"#,
            id = self.id,
            o = self.object(false),
            c = self.created,
            m = self.model_json,
            u = self.usage(),
        )
    }
}

/// The final SSE event.
pub const SSE_DONE: &[u8] = b"data: [DONE]\n\n";

/// The exact bytes the engine streams for a request, given the `x-mock-request-seq` it answered
/// with: one element per SSE event, in order. `model` is the configured model name.
pub fn expected_stream(
    kind: StreamKind,
    model: &str,
    created: u64,
    seq: u64,
    tokens: usize,
    prompt_bytes: usize,
    include_usage: bool,
) -> Vec<Bytes> {
    let render = Render {
        kind,
        id: response_id(kind, seq).into(),
        model_json: serde_json::to_string(model).unwrap_or_default().into(),
        created,
        tokens,
        prompt_tokens: prompt_tokens(&vec![0; prompt_bytes]),
        cached_tokens: None,
        pad: 0,
    };
    let mut out: Vec<Bytes> = (0..tokens).map(|i| render.token_event(i)).collect();
    if include_usage {
        out.push(render.usage_event());
    }
    out.push(Bytes::from_static(SSE_DONE));
    out
}
