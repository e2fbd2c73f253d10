//! SSE chunk forwarding through [`ProxyBody`] (deadlines re-armed per chunk, TTFT and duration
//! metrics), against the bare upstream body: an in-memory HTTP/1.1 connection streams 64 SSE
//! events of a vLLM-like size per response.

// Benchmark setup: failing loudly is right.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::disallowed_methods
)]

use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use control_client::model::ProxyMode;
use control_client::routing::Endpoint;
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use gateway::EjectionConfig;
use gateway::balance::Balancer;
use gateway::body::{Deadlines, ProxyBody};
use gateway::metrics::Metrics;
use gateway::route::Api;
use http::{Request, Response};
use http_body::{Body, Frame};
use http_body_util::{BodyExt, Empty};
use hyper::body::Incoming;
use hyper::client::conn::http1::SendRequest;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::time::Instant;

const EVENTS: usize = 64;

/// Streams prepared frames one by one (each becomes one chunk on the wire).
struct Events(VecDeque<Bytes>);

impl Body for Events {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        Poll::Ready(self.0.pop_front().map(|b| Ok(Frame::data(b))))
    }
}

fn event(i: usize) -> Bytes {
    Bytes::from(format!(
        "data: {{\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":0,\"model\":\"llama\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"tok{i} \"}},\"finish_reason\":null}}]}}\n\n"
    ))
}

async fn connect() -> SendRequest<Empty<Bytes>> {
    let (client, server) = tokio::io::duplex(64 * 1024);
    tokio::spawn(async move {
        let service = service_fn(|_req: Request<Incoming>| async {
            let events: VecDeque<Bytes> = (0..EVENTS).map(event).collect();
            let mut resp = Response::new(Events(events));
            resp.headers_mut().insert(
                http::header::CONTENT_TYPE,
                http::HeaderValue::from_static("text/event-stream"),
            );
            Ok::<_, Infallible>(resp)
        });
        let _ = hyper::server::conn::http1::Builder::new()
            .serve_connection(TokioIo::new(server), service)
            .await;
    });
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(client))
        .await
        .unwrap();
    tokio::spawn(conn);
    sender
}

async fn response(sender: &mut SendRequest<Empty<Bytes>>) -> Incoming {
    sender.ready().await.unwrap();
    let req = Request::get("/v1/chat/completions")
        .body(Empty::new())
        .unwrap();
    sender.send_request(req).await.unwrap().into_body()
}

async fn drain<B: Body<Data = Bytes> + Unpin>(mut body: B) -> usize
where
    B::Error: std::fmt::Debug,
{
    let mut n = 0;
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame.unwrap().into_data() {
            n += data.len();
        }
    }
    n
}

fn sse_forwarding(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    // Iterations run one after the other: the lock is never contended.
    let sender = Arc::new(tokio::sync::Mutex::new(rt.block_on(connect())));
    let metrics = Arc::new(Metrics::default());
    let balancer = Balancer::new(EjectionConfig::default());
    let endpoints = [Endpoint {
        instance_id: 1,
        model_id: 1,
        worker_id: 1,
        worker_name: "w".into(),
        cluster_id: 1,
        address: "127.0.0.1".into(),
        instance_port: 1,
        worker_port: 2,
        proxy_mode: ProxyMode::Direct,
        proxy_address: None,
    }];
    let mut g = c.benchmark_group("sse_64_events");
    g.throughput(Throughput::Elements(EVENTS as u64));
    g.bench_function("bare Incoming", |b| {
        b.to_async(&rt).iter(|| {
            let sender = sender.clone();
            async move {
                let incoming = response(&mut *sender.lock().await).await;
                drain(incoming).await
            }
        });
    });
    g.bench_function("ProxyBody", |b| {
        b.to_async(&rt).iter(|| {
            let sender = sender.clone();
            let metrics = metrics.clone();
            let inflight = balancer.pick(&endpoints, &[]).unwrap().start();
            async move {
                let incoming = response(&mut *sender.lock().await).await;
                let started = Instant::now();
                let deadlines = Deadlines {
                    first_byte: started + Duration::from_secs(60),
                    idle: Duration::from_secs(30),
                    total: started + Duration::from_secs(600),
                };
                let body = ProxyBody::new(
                    incoming.into(),
                    true,
                    deadlines,
                    started,
                    Api::ChatCompletions,
                    metrics.request_arrived(),
                    inflight,
                );
                drain(body).await
            }
        });
    });
    g.finish();
}

criterion_group!(benches, sse_forwarding);
criterion_main!(benches);
