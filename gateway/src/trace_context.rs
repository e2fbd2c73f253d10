//! W3C trace context (`traceparent`, `tracestate`) through the gateway: the client's context
//! when it sent a valid one, a new trace otherwise, and the gateway's own span as the parent of
//! the engine's, on every path (the worker proxy and the tunnel pass the headers on unchanged).
//!
//! Parsing and writing are the `opentelemetry` crates' ([`TraceContextPropagator`]); this
//! module only decides which context goes upstream.

use http::HeaderMap;
use opentelemetry::propagation::TextMapPropagator as _;
use opentelemetry::trace::{
    SpanContext, SpanId, TraceContextExt as _, TraceFlags, TraceId, TraceState,
};
use opentelemetry_http::{HeaderExtractor, HeaderInjector};
use opentelemetry_sdk::propagation::TraceContextPropagator;

/// The `traceparent` header.
pub const TRACEPARENT: &str = "traceparent";
/// The `tracestate` header.
pub const TRACESTATE: &str = "tracestate";

/// The client's span context, when its `traceparent` is valid (with its `tracestate`, which is
/// ignored when the `traceparent` is not). No work beyond a header lookup when there is none.
pub fn extract(headers: &HeaderMap) -> Option<SpanContext> {
    if !headers.contains_key(TRACEPARENT) {
        return None;
    }
    let cx = TraceContextPropagator::new().extract(&HeaderExtractor(headers));
    let span = cx.span();
    let context = span.span_context();
    context.is_valid().then(|| context.clone())
}

/// The gateway's span under `parent` (the client's, from [`extract`]): the parent's trace,
/// flags and state with a new span id; without a parent, a new trace, sampled.
pub fn child_of(parent: Option<SpanContext>) -> SpanContext {
    match parent {
        Some(parent) => SpanContext::new(
            parent.trace_id(),
            new_span_id(),
            parent.trace_flags(),
            false,
            parent.trace_state().clone(),
        ),
        None => SpanContext::new(
            new_trace_id(),
            new_span_id(),
            TraceFlags::SAMPLED,
            false,
            TraceState::NONE,
        ),
    }
}

/// Writes `context` as the request's `traceparent` (and `tracestate` when it has one),
/// replacing whatever the client sent.
pub fn inject(headers: &mut HeaderMap, context: &SpanContext) {
    headers.remove(TRACEPARENT);
    headers.remove(TRACESTATE);
    let cx = opentelemetry::Context::new().with_remote_span_context(context.clone());
    TraceContextPropagator::new().inject_context(&cx, &mut HeaderInjector(headers));
    // The propagator writes an empty `tracestate` for a context without one.
    if headers.get(TRACESTATE).is_some_and(|v| v.is_empty()) {
        headers.remove(TRACESTATE);
    }
}

/// A random trace id, never the invalid all-zero one.
fn new_trace_id() -> TraceId {
    TraceId::from(rand::random::<u128>().max(1))
}

/// A random span id, never the invalid all-zero one.
fn new_span_id() -> SpanId {
    SpanId::from(rand::random::<u64>().max(1))
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    const PARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, HeaderValue::from_static(v));
        }
        h
    }

    #[test]
    fn keeps_the_clients_trace_with_a_new_span() {
        let h = headers(&[(TRACEPARENT, PARENT), (TRACESTATE, "vendor=abc,other=1")]);
        let parent = extract(&h).unwrap();
        assert!(parent.is_remote());
        let ours = child_of(Some(parent.clone()));
        assert_eq!(ours.trace_id(), parent.trace_id());
        assert_ne!(ours.span_id(), parent.span_id());
        assert!(ours.is_sampled());
        let mut out = h.clone();
        inject(&mut out, &ours);
        let sent = out[TRACEPARENT].to_str().unwrap();
        assert_eq!(
            sent,
            format!("00-4bf92f3577b34da6a3ce929d0e0e4736-{}-01", ours.span_id())
        );
        assert_eq!(out[TRACESTATE], "vendor=abc,other=1");
        assert_eq!(out.get_all(TRACEPARENT).iter().count(), 1);
    }

    #[test]
    fn the_unsampled_flag_is_passed_on() {
        let h = headers(&[(
            TRACEPARENT,
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00",
        )]);
        let ours = child_of(extract(&h));
        let mut out = HeaderMap::new();
        inject(&mut out, &ours);
        assert!(out[TRACEPARENT].to_str().unwrap().ends_with("-00"));
        assert!(!out.contains_key(TRACESTATE));
    }

    #[test]
    fn a_missing_or_malformed_parent_starts_a_trace() {
        for bad in [
            "",
            "garbage",
            // All-zero trace id, all-zero span id, upper case, version ff, short.
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-01",
        ] {
            let h = headers(&[(TRACEPARENT, bad), (TRACESTATE, "vendor=abc")]);
            assert!(extract(&h).is_none(), "{bad:?}");
            let mut out = h.clone();
            let ours = child_of(extract(&h));
            inject(&mut out, &ours);
            let sent = out[TRACEPARENT].to_str().unwrap().to_owned();
            assert_eq!(sent.len(), 55, "{sent}");
            assert!(sent.starts_with("00-") && sent.ends_with("-01"), "{sent}");
            assert!(!sent.contains("4bf92f3577b34da6a3ce929d0e0e4736"));
            // The state of an invalid parent is dropped with it.
            assert!(!out.contains_key(TRACESTATE));
        }
        assert!(extract(&HeaderMap::new()).is_none());
        let a = child_of(None);
        let b = child_of(None);
        assert_ne!(a.trace_id(), b.trace_id());
    }
}
