//! Spans from the real binaries: `faden server` configured by the standard
//! `OTEL_EXPORTER_OTLP_ENDPOINT`, a `direct` worker, a client `traceparent`; the span reaches an
//! OTLP receiver in the test (decoded with `opentelemetry-proto`) when the server shuts down
//! gracefully, in the client's trace, with the GenAI attributes.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::disallowed_methods
)]

mod common;

use bytes::Bytes;
use common::*;
use http_body_util::{BodyExt as _, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::KeyValue;
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message as _;
use testkit::process::start_faden_server;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";

/// An OTLP/HTTP receiver: each span with its resource's attributes.
async fn receiver() -> (String, mpsc::UnboundedReceiver<(Vec<KeyValue>, Span)>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        loop {
            let (stream, _) = listener.accept().await.unwrap();
            let tx = tx.clone();
            let service = service_fn(move |req: http::Request<Incoming>| {
                let tx = tx.clone();
                async move {
                    assert_eq!(req.uri().path(), "/v1/traces");
                    let body = req.into_body().collect().await.unwrap().to_bytes();
                    let export = ExportTraceServiceRequest::decode(body).unwrap();
                    for rs in export.resource_spans {
                        let resource = rs.resource.map(|r| r.attributes).unwrap_or_default();
                        for span in rs.scope_spans.into_iter().flat_map(|s| s.spans) {
                            let _ = tx.send((resource.clone(), span));
                        }
                    }
                    let answer = ExportTraceServiceResponse::default().encode_to_vec();
                    Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(Bytes::from(
                        answer,
                    ))))
                }
            });
            tokio::spawn(
                hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service),
            );
        }
    });
    (url, rx)
}

fn attr(attrs: &[KeyValue], key: &str) -> Option<Value> {
    attrs
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.clone()?.value)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[tokio::test]
async fn the_server_exports_spans_in_the_clients_trace_and_flushes_them_at_shutdown() {
    let (url, mut spans) = receiver().await;
    let dir = tempfile::tempdir().unwrap();
    let endpoint = url.clone();
    // A schedule no test waits for: the spans leave at the graceful shutdown.
    let envs = [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
        ("OTEL_BSP_SCHEDULE_DELAY", "3600000"),
        ("OTEL_SERVICE_NAME", "faden-under-test"),
    ];
    let mut server =
        start_faden_server(bin(), &dir.path().join("server"), [0; 3], &[], &envs).await;
    let (token, key) = provision(&server.admin).await;
    let engine = engine(4, 0, 0).await;
    let (mut worker, _) = start_worker(&worker_args(
        &server.api_url(),
        &token,
        "direct",
        engine.port(),
        &dir.path().join("worker"),
    ))
    .await;
    assert!(wait_serving(server.gateway, &key, T).await.is_some());

    let tcp = TcpStream::connect(server.gateway).await.unwrap();
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
        .await
        .unwrap();
    tokio::spawn(conn);
    let req = http::Request::post(format!("http://{}/v1/chat/completions", server.gateway))
        .header("authorization", format!("Bearer {key}"))
        .header("traceparent", format!("00-{TRACE}-00f067aa0ba902b7-01"))
        .body(Full::new(Bytes::from_static(
            br#"{"model":"demo","stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"hi"}]}"#,
        )))
        .unwrap();
    let resp = sender.send_request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    assert!(body.ends_with(b"data: [DONE]\n\n"));
    let seen = engine.stats.last_request().unwrap();
    let to_engine = seen.headers["traceparent"].to_str().unwrap().to_owned();
    assert!(
        to_engine.starts_with(&format!("00-{TRACE}-")),
        "{to_engine}"
    );
    assert!(
        spans.try_recv().is_err(),
        "nothing leaves before the schedule or the shutdown"
    );

    // SIGTERM: the server drains, then sends what is queued.
    let status = std::process::Command::new("kill")
        .args(["-TERM", &server.running.child.id().unwrap().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let exit = tokio::time::timeout(T, server.running.child.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(exit.success(), "{exit:?}");
    let span = loop {
        let (resource, span) = tokio::time::timeout(T, spans.recv())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            attr(&resource, "service.name"),
            Some(Value::StringValue("faden-under-test".into()))
        );
        if hex(&span.trace_id) == TRACE {
            break span;
        }
    };
    assert_eq!(hex(&span.parent_span_id), "00f067aa0ba902b7");
    assert_eq!(
        to_engine,
        format!("00-{TRACE}-{}-01", hex(&span.span_id)),
        "the engine's parent is the gateway's span"
    );
    let attrs = &span.attributes;
    assert_eq!(
        attr(attrs, "gen_ai.request.model"),
        Some(Value::StringValue("demo".into()))
    );
    assert_eq!(
        attr(attrs, "faden.path"),
        Some(Value::StringValue("direct".into()))
    );
    assert_eq!(
        attr(attrs, "gen_ai.usage.output_tokens"),
        Some(Value::IntValue(4))
    );
    stop(&mut worker).await;
}
