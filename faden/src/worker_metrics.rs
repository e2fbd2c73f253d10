//! The worker's metrics endpoint (`worker_metrics_port`): Prometheus text on `GET /metrics`.

use std::convert::Infallible;

use bytes::Bytes;
use http::{Response, StatusCode};
use http_body_util::Full;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// Serves `/metrics` until `shutdown`.
pub async fn serve(listener: TcpListener, worker_id: i64, shutdown: CancellationToken) {
    let started = std::time::Instant::now();
    loop {
        let stream = tokio::select! {
            _ = shutdown.cancelled() => return,
            accepted = listener.accept() => match accepted {
                Ok((s, _)) => s,
                Err(_) => {
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let service = service_fn(
            move |req: http::Request<hyper::body::Incoming>| async move {
                let response = if req.uri().path() == "/metrics" {
                    let body = format!(
                        "# TYPE faden_worker_info gauge\nfaden_worker_info{{worker_id=\"{worker_id}\",version=\"{}\"}} 1\n# TYPE faden_worker_uptime_seconds gauge\nfaden_worker_uptime_seconds {}\n",
                        env!("CARGO_PKG_VERSION"),
                        started.elapsed().as_secs()
                    );
                    Response::builder()
                        .header(http::header::CONTENT_TYPE, "text/plain; version=0.0.4")
                        .body(Full::new(Bytes::from(body)))
                } else {
                    Response::builder()
                        .status(StatusCode::NOT_FOUND)
                        .body(Full::new(Bytes::new()))
                };
                Ok::<_, Infallible>(response.unwrap_or_default())
            },
        );
        tokio::spawn(async move {
            let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}
