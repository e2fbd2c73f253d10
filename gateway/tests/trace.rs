//! W3C trace context from the client through the gateway to the engine, on the direct and the
//! worker path (the tunnel path: `faden/tests/tunnel_e2e.rs`); spans exported over OTLP to a receiver in
//! the test (the `opentelemetry-proto` decoder); the GenAI metric names on `/metrics`.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::disallowed_methods
)]

mod common;

use common::*;
use gateway::GatewayConfig;
use gateway::telemetry::{Telemetry, TelemetryConfig};
use http::Request;
use http_body_util::{BodyExt as _, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use mock_engine::{MockEngine, MockEngineConfig};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::{AnyValue, any_value};
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message as _;
use tokio::net::TcpListener;
use tokio::sync::mpsc;

const CLIENT_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CLIENT_SPAN: &str = "00f067aa0ba902b7";

/// `req` with `traceparent` (and `tracestate`) headers.
fn with_trace(
    mut req: Request<Full<bytes::Bytes>>,
    parent: &str,
    state: Option<&str>,
) -> Request<Full<bytes::Bytes>> {
    req.headers_mut()
        .insert("traceparent", parent.parse().unwrap());
    if let Some(state) = state {
        req.headers_mut()
            .insert("tracestate", state.parse().unwrap());
    }
    req
}

/// The `traceparent` the engine last saw, split: version, trace id, parent span id, flags.
fn seen_parent(engine: &mock_engine::MockEngineHandle) -> (Vec<String>, Option<String>) {
    let seen = engine.stats.last_request().unwrap();
    let all: Vec<_> = seen.headers.get_all("traceparent").iter().collect();
    assert_eq!(all.len(), 1, "{:?}", seen.headers);
    let parts = all[0]
        .to_str()
        .unwrap()
        .split('-')
        .map(str::to_owned)
        .collect::<Vec<_>>();
    assert_eq!(parts.len(), 4, "{parts:?}");
    assert_eq!(parts[0], "00");
    assert_eq!(parts[1].len(), 32);
    assert_eq!(parts[2].len(), 16);
    let state = seen
        .headers
        .get("tracestate")
        .map(|v| v.to_str().unwrap().to_owned());
    (parts, state)
}

/// The three cases on one gateway: the client's trace kept (with a new parent span and the
/// client's state and flags), a new sampled trace without one, and a new trace for a
/// malformed one.
async fn check_propagation(h: &Harness, engine: &mock_engine::MockEngineHandle) {
    let parent = format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-01");
    for stream in [true, false] {
        let req = with_trace(h.chat(stream), &parent, Some("vendor=v1,faden=x"));
        let resp = send(h.addr, req).await;
        assert_eq!(resp.status(), 200);
        body_bytes(resp).await;
        let (parts, state) = seen_parent(engine);
        assert_eq!(parts[1], CLIENT_TRACE);
        assert_ne!(
            parts[2], CLIENT_SPAN,
            "the gateway's span is the engine's parent"
        );
        assert_eq!(parts[3], "01");
        assert_eq!(state.as_deref(), Some("vendor=v1,faden=x"));
    }

    // Not sampled by the client: passed on as such.
    let req = with_trace(
        h.chat(true),
        &format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-00"),
        None,
    );
    body_bytes(send(h.addr, req).await).await;
    let (parts, state) = seen_parent(engine);
    assert_eq!((parts[1].as_str(), parts[3].as_str()), (CLIENT_TRACE, "00"));
    assert_eq!(state, None);

    // None: a new trace, sampled, a new one per request.
    body_bytes(send(h.addr, h.chat(true)).await).await;
    let (first, _) = seen_parent(engine);
    body_bytes(send(h.addr, h.chat(true)).await).await;
    let (second, _) = seen_parent(engine);
    assert_eq!(first[3], "01");
    assert_ne!(first[1], second[1]);
    assert_ne!(first[1], "0".repeat(32));

    // Malformed (upper case): a new trace, the client's state dropped with it.
    let req = with_trace(
        h.chat(true),
        &format!("00-{}-{CLIENT_SPAN}-01", CLIENT_TRACE.to_uppercase()),
        Some("vendor=v1"),
    );
    body_bytes(send(h.addr, req).await).await;
    let (parts, state) = seen_parent(engine);
    assert_ne!(parts[1], CLIENT_TRACE);
    assert_ne!(parts[1].to_uppercase(), CLIENT_TRACE.to_uppercase());
    assert_eq!(state, None);
}

#[tokio::test]
async fn trace_context_reaches_the_engine_direct() {
    let engine = MockEngine::start(MockEngineConfig::default())
        .await
        .unwrap();
    let h = Harness::start(GatewayConfig::default(), &[Inst::direct(1, engine.port())]).await;
    check_propagation(&h, &engine).await;
    h.stop().await;
}

/// On the worker path the engine stands in for the worker proxy (which passes the headers on
/// unchanged: `worker/tests/proxy.rs`); the whole path runs in `faden/tests/worker_path.rs`.
#[tokio::test]
async fn trace_context_goes_out_on_the_worker_path() {
    let engine = MockEngine::start(MockEngineConfig::default())
        .await
        .unwrap();
    let config = GatewayConfig {
        worker_credential: Some("worker-secret".into()),
        ..Default::default()
    };
    let h = Harness::start(config, &[Inst::worker(1, engine.port(), engine.port())]).await;
    check_propagation(&h, &engine).await;
    let seen = engine.stats.last_request().unwrap();
    assert_eq!(
        seen.headers["x-gpustack-model-instance"],
        "model-1-1.static"
    );
    h.stop().await;
}

// ---- Spans over OTLP, to a receiver in the test ----

/// What the receiver got: the spans with their resource's `service.name`.
struct Received {
    service: String,
    span: Span,
}

/// An OTLP/HTTP receiver on 127.0.0.1: decodes each `ExportTraceServiceRequest` (protobuf)
/// and hands its spans over; with `stall`, it never answers.
async fn otlp_receiver(stall: bool) -> (String, mpsc::UnboundedReceiver<Received>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        loop {
            let (stream, _) = listener.accept().await.unwrap();
            let tx = tx.clone();
            tokio::spawn(async move {
                let service = service_fn(move |req: Request<Incoming>| {
                    let tx = tx.clone();
                    async move {
                        if stall {
                            std::future::pending::<()>().await;
                        }
                        assert_eq!(req.uri().path(), "/v1/traces");
                        assert_eq!(req.headers()["content-type"], "application/x-protobuf");
                        let body = req.into_body().collect().await.unwrap().to_bytes();
                        let export = ExportTraceServiceRequest::decode(body).unwrap();
                        for resource in export.resource_spans {
                            let service = resource
                                .resource
                                .iter()
                                .flat_map(|r| &r.attributes)
                                .find(|kv| kv.key == "service.name")
                                .and_then(|kv| string_of(kv.value.as_ref()?))
                                .unwrap_or_default();
                            for span in resource.scope_spans.into_iter().flat_map(|s| s.spans) {
                                let _ = tx.send(Received {
                                    service: service.clone(),
                                    span,
                                });
                            }
                        }
                        let answer = ExportTraceServiceResponse::default().encode_to_vec();
                        Ok::<_, std::convert::Infallible>(
                            hyper::Response::builder()
                                .header("content-type", "application/x-protobuf")
                                .body(Full::new(bytes::Bytes::from(answer)))
                                .unwrap(),
                        )
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    (url, rx)
}

fn string_of(v: &AnyValue) -> Option<String> {
    match v.value.as_ref()? {
        any_value::Value::StringValue(s) => Some(s.clone()),
        _ => None,
    }
}

fn attribute(span: &Span, key: &str) -> Option<any_value::Value> {
    span.attributes
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.clone()?.value)
}

fn string_attr(span: &Span, key: &str) -> Option<String> {
    match attribute(span, key)? {
        any_value::Value::StringValue(s) => Some(s),
        _ => None,
    }
}

fn int_attr(span: &Span, key: &str) -> Option<i64> {
    match attribute(span, key)? {
        any_value::Value::IntValue(n) => Some(n),
        _ => None,
    }
}

async fn next_span(rx: &mut mpsc::UnboundedReceiver<Received>) -> Received {
    tokio::time::timeout(T, rx.recv()).await.unwrap().unwrap()
}

/// A gateway exporting to `endpoint`, in front of `engine`.
async fn traced_gateway(
    engine: &mock_engine::MockEngineHandle,
    config: TelemetryConfig,
) -> (Harness, Telemetry) {
    let telemetry = Telemetry::start(config).unwrap();
    let key = control_client::tokens::generate(control_client::tokens::API_KEY_PREFIX);
    let cred = credential(1, &key, control_client::model::Scope::Inference, None);
    let snap = snapshot(
        &[Inst::direct(7, engine.port())],
        std::slice::from_ref(&cred),
    );
    let (tx, rx) = tokio::sync::watch::channel(std::sync::Arc::new(snap));
    let gateway = gateway::Gateway::builder(
        GatewayConfig {
            count_tokens: true,
            ..Default::default()
        },
        rx,
    )
    .telemetry(telemetry.clone())
    .build()
    .unwrap();
    (Harness::serve(gateway, tx, key, cred).await, telemetry)
}

#[tokio::test]
async fn spans_reach_an_otlp_receiver_with_the_genai_attributes() {
    let engine = MockEngine::start(MockEngineConfig {
        tokens: 5,
        ..Default::default()
    })
    .await
    .unwrap();
    let (url, mut spans) = otlp_receiver(false).await;
    let (h, telemetry) = traced_gateway(
        &engine,
        TelemetryConfig {
            endpoint: Some(url),
            delay: std::time::Duration::from_millis(20),
            ..Default::default()
        },
    )
    .await;

    // Streamed, under the client's trace: one trace id from the client to the engine.
    let parent = format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-01");
    let resp = send(h.addr, with_trace(h.chat(true), &parent, None)).await;
    assert_eq!(resp.status(), 200);
    assert!(body_bytes(resp).await.ends_with(b"data: [DONE]\n\n"));
    let (to_engine, _) = seen_parent(&engine);
    let got = next_span(&mut spans).await;
    let span = &got.span;
    assert_eq!(got.service, "faden");
    assert_eq!(hex(&span.trace_id), CLIENT_TRACE);
    assert_eq!(to_engine[1], CLIENT_TRACE);
    assert_eq!(hex(&span.parent_span_id), CLIENT_SPAN);
    assert_eq!(
        hex(&span.span_id),
        to_engine[2],
        "the engine's parent is the span"
    );
    assert_eq!(span.name, format!("chat {MODEL}"));
    assert_eq!(span.kind, 2, "server");
    assert_eq!(
        string_attr(span, "gen_ai.operation.name").as_deref(),
        Some("chat")
    );
    assert_eq!(
        string_attr(span, "gen_ai.request.model").as_deref(),
        Some(MODEL)
    );
    assert_eq!(int_attr(span, "gen_ai.usage.output_tokens"), Some(5));
    assert!(int_attr(span, "gen_ai.usage.input_tokens").unwrap() > 0);
    assert_eq!(int_attr(span, "faden.instance.id"), Some(7));
    assert_eq!(string_attr(span, "faden.path").as_deref(), Some("direct"));
    assert_eq!(int_attr(span, "http.response.status_code"), Some(200));
    assert!(span.end_time_unix_nano >= span.start_time_unix_nano);

    // Without a traceparent: a new trace, a root span, the same trace at the engine.
    let resp = send(h.addr, h.chat(false)).await;
    assert_eq!(resp.status(), 200);
    body_bytes(resp).await;
    let (to_engine, _) = seen_parent(&engine);
    let span = next_span(&mut spans).await.span;
    assert_eq!(hex(&span.trace_id), to_engine[1]);
    assert_ne!(to_engine[1], CLIENT_TRACE);
    assert!(span.parent_span_id.is_empty());
    assert_eq!(hex(&span.span_id), to_engine[2]);
    assert_eq!(int_attr(&span, "gen_ai.usage.output_tokens"), Some(5));

    // A request refused before any upstream: a span with its status and error.
    let req = h.post("/v1/chat/completions", r#"{"model":"nope","messages":[]}"#);
    assert_eq!(send(h.addr, req).await.status(), 404);
    let span = next_span(&mut spans).await.span;
    assert_eq!(int_attr(&span, "http.response.status_code"), Some(404));
    assert_eq!(
        string_attr(&span, "error.type").as_deref(),
        Some("model_not_found")
    );

    // The GenAI metric names beside faden's own, and the exporter's counts.
    testkit::wait_until(T, "spans exported", || telemetry.counts().0 == 3).await;
    let text = String::from_utf8(
        body_bytes(
            send(
                h.addr,
                Request::get(format!("http://{}/metrics", h.addr))
                    .body(Full::default())
                    .unwrap(),
            )
            .await,
        )
        .await
        .to_vec(),
    )
    .unwrap();
    let labels = format!("gen_ai_operation_name=\"chat\",gen_ai_request_model=\"{MODEL}\"");
    for name in [
        format!("gen_ai_server_request_duration_seconds_count{{{labels}}} 2\n"),
        format!("gen_ai_server_time_to_first_token_seconds_count{{{labels}}} 2\n"),
        format!("gen_ai_server_time_per_output_token_seconds_count{{{labels}}} 2\n"),
        format!("gen_ai_client_token_usage_sum{{{labels},gen_ai_token_type=\"output\"}} 10\n"),
        "faden_otel_spans_exported_total 3\n".to_owned(),
        "faden_otel_spans_dropped_total 0\n".to_owned(),
        "faden_gateway_requests_total{".to_owned(),
    ] {
        assert!(text.contains(&name), "{name} not in\n{text}");
    }
    h.stop().await;
    telemetry.shutdown(T).await;
}

#[tokio::test]
async fn queued_spans_are_flushed_at_shutdown() {
    let engine = MockEngine::start(MockEngineConfig::default())
        .await
        .unwrap();
    let (url, mut spans) = otlp_receiver(false).await;
    // A delay no test waits for: only the shutdown sends the batch.
    let (h, telemetry) = traced_gateway(
        &engine,
        TelemetryConfig {
            endpoint: Some(url),
            delay: std::time::Duration::from_secs(3600),
            ..Default::default()
        },
    )
    .await;
    for _ in 0..3 {
        body_bytes(send(h.addr, h.chat(true)).await).await;
    }
    assert!(spans.try_recv().is_err());
    h.stop().await;
    telemetry.shutdown(T).await;
    for _ in 0..3 {
        next_span(&mut spans).await;
    }
    assert_eq!(telemetry.counts(), (3, 0, 0));
}

#[tokio::test]
async fn a_stalled_collector_drops_spans_without_holding_requests() {
    let engine = MockEngine::start(MockEngineConfig::default())
        .await
        .unwrap();
    let (url, _spans) = otlp_receiver(true).await;
    let (h, telemetry) = traced_gateway(
        &engine,
        TelemetryConfig {
            endpoint: Some(url),
            max_queue: 2,
            max_batch: 1,
            delay: std::time::Duration::ZERO,
            ..Default::default()
        },
    )
    .await;
    // The first span's export hangs; two more wait in the queue; the rest are dropped, and
    // every request is answered all the same.
    for _ in 0..8 {
        let resp = send(h.addr, h.chat(true)).await;
        assert_eq!(resp.status(), 200);
        body_bytes(resp).await;
    }
    testkit::wait_until(T, "spans dropped", || telemetry.counts().1 >= 5).await;
    let text = String::from_utf8(
        body_bytes(
            send(
                h.addr,
                Request::get(format!("http://{}/metrics", h.addr))
                    .body(Full::default())
                    .unwrap(),
            )
            .await,
        )
        .await
        .to_vec(),
    )
    .unwrap();
    assert!(
        text.contains("faden_otel_spans_dropped_total 5\n"),
        "{text}"
    );
    h.stop().await;
    // Bounded even though the collector never answers.
    telemetry
        .shutdown(std::time::Duration::from_millis(200))
        .await;
}
