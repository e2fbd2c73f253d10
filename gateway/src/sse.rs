//! Server-sent events: recognising an event stream and ending one with an error event.
//!
//! The gateway never re-frames SSE: upstream chunks go to the client byte for byte (GPUStack's
//! line-by-line re-framing corrupted streams, #6155). The only bytes it writes itself are one
//! error event when the upstream fails mid-stream, right before aborting the response so that
//! the client sees an abnormal end and never a clean `[DONE]`.

use bytes::Bytes;
use http::HeaderValue;

use crate::error::{GatewayError, error_body};

/// Whether a response with this `Content-Type` (if any) is an event stream.
pub fn is_event_stream_type(content_type: Option<&HeaderValue>) -> bool {
    // On the bytes: the media type before any parameters, ASCII whitespace trimmed (a value
    // that is not ASCII cannot match).
    content_type.is_some_and(|v| {
        let v = v.as_bytes();
        let media_type = v.split(|&b| b == b';').next().unwrap_or(v);
        media_type
            .trim_ascii()
            .eq_ignore_ascii_case(b"text/event-stream")
    })
}

/// `data: {"error": {...}}\n\n`, preceded by a blank line in case the upstream stopped in the
/// middle of an event (an extra blank line is harmless between complete events).
pub fn error_event(error: &GatewayError) -> Bytes {
    let body = error_body(&error.message, error.kind.error_type(), error.kind.code());
    let mut out = Vec::with_capacity(body.len() + 10);
    out.extend_from_slice(b"\n\ndata: ");
    out.extend_from_slice(&body);
    out.extend_from_slice(b"\n\n");
    Bytes::from(out)
}

#[cfg(test)]
mod tests {
    use http::{HeaderMap, HeaderValue, header};

    use super::*;
    use crate::error::ErrorKind;

    #[test]
    fn recognises_event_streams() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONTENT_TYPE,
            "Text/Event-Stream; charset=utf-8".parse().unwrap(),
        );
        assert!(is_event_stream_type(h.get(header::CONTENT_TYPE)));
        h.insert(header::CONTENT_TYPE, "application/json".parse().unwrap());
        assert!(!is_event_stream_type(h.get(header::CONTENT_TYPE)));
        h.insert(header::CONTENT_TYPE, " text/event-stream ".parse().unwrap());
        assert!(is_event_stream_type(h.get(header::CONTENT_TYPE)));
        h.insert(header::CONTENT_TYPE, "text/event-streams".parse().unwrap());
        assert!(!is_event_stream_type(h.get(header::CONTENT_TYPE)));
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_bytes(b"text/event-stream\xe9").unwrap(),
        );
        assert!(!is_event_stream_type(h.get(header::CONTENT_TYPE)));
        h.remove(header::CONTENT_TYPE);
        assert!(!is_event_stream_type(h.get(header::CONTENT_TYPE)));
    }

    #[test]
    fn error_event_is_one_data_line() {
        let e = error_event(&GatewayError::new(ErrorKind::UpstreamProtocol, "boom"));
        let text = std::str::from_utf8(&e).unwrap();
        let data = text.trim().strip_prefix("data: ").unwrap();
        let v: serde_json::Value = serde_json::from_str(data).unwrap();
        assert_eq!(v["error"]["code"], "upstream_protocol");
        assert!(text.ends_with("\n\n"));
    }
}
