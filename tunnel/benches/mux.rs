//! One HTTP/1.1 request over a yamux stream on an in-memory duplex (no sockets): the cost the
//! tunnel adds per request, without the WebSocket framing or the kernel.

// Benchmark setup: failing loudly is right.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::disallowed_methods
)]

use std::convert::Infallible;
use std::time::Duration;

use bytes::Bytes;
use criterion::{Criterion, criterion_group, criterion_main};
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::service::service_fn;
use tunnel::http::serve_connection;
use tunnel::mux::{self, MuxConfig, Role};

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let config = MuxConfig::default();
    let (server_io, worker_io) = tokio::io::duplex(256 * 1024);
    let (opener, worker) = rt.block_on(async {
        let opener = mux::spawn(server_io, Role::Opener, &config, tracing::Span::none());
        let mut worker = mux::spawn(worker_io, Role::Acceptor, &config, tracing::Span::none());
        // The worker answers every stream with a 64-byte body.
        let inbound = tokio::spawn(async move {
            while let Some(stream) = worker.inbound.recv().await {
                tokio::spawn(async move {
                    let Ok(stream) = stream.accept().await else {
                        return;
                    };
                    let service = service_fn(|_req: Request<hyper::body::Incoming>| async {
                        Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(
                            &[b'x'; 64],
                        ))))
                    });
                    let _ = serve_connection(stream, service, &Default::default()).await;
                });
            }
        });
        (opener, inbound)
    });
    c.bench_function("request_over_yamux_in_memory", |b| {
        b.to_async(&rt).iter(|| async {
            let stream = opener.handle.open_stream().await.unwrap();
            let request = Request::post("http://worker/v1/x")
                .body(Full::new(Bytes::from_static(&[b'y'; 64])))
                .unwrap();
            let response = tunnel::http::send_request(stream, request).await.unwrap();
            let body = response.into_body().collect().await.unwrap().to_bytes();
            assert_eq!(body.len(), 64);
        })
    });
    opener.handle.close();
    rt.block_on(async {
        let _ = tokio::time::timeout(Duration::from_secs(2), worker).await;
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
