//! The worker's metrics endpoint (`worker_metrics_port`): Prometheus text on `GET /metrics`,
//! served by `net`'s listener (head deadline, pending-connection caps, header size limit).

use bytes::Bytes;
use http::{Response, StatusCode};
use http_body_util::Full;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// Serves `/metrics` until `shutdown`.
pub async fn serve(
    listener: TcpListener,
    worker_id: i64,
    limits: net::config::ListenerConfig,
    shutdown: CancellationToken,
) {
    let started = std::time::Instant::now();
    let handler = move |req: http::Request<hyper::body::Incoming>, _peer| async move {
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
        response.unwrap_or_default()
    };
    net::listener::serve(listener, &limits, handler, shutdown, || {}).await;
}
