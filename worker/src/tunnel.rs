//! A tunnel worker's serving: the worker proxy on the streams of the tunnel it dials, instead
//! of on a port.

use std::convert::Infallible;
use std::net::SocketAddr;

use hyper::service::service_fn;
use tokio_util::sync::CancellationToken;
use tunnel::TunnelClient;
use tunnel::http::{HttpHandler, ServeConfig};

use crate::proxy::WorkerProxy;

/// Serves `proxy` on every stream the server opens over `client`'s tunnel, reconnecting as the
/// client does, until `shutdown`; returns once the last session's tasks have ended.
pub async fn serve(client: TunnelClient, proxy: WorkerProxy, shutdown: CancellationToken) {
    // Streams come from the server this worker authenticated with; there is no peer address.
    let peer = SocketAddr::from(([127, 0, 0, 1], 0));
    let service = service_fn(move |req| {
        let proxy = proxy.clone();
        async move { Ok::<_, Infallible>(proxy.handle(req, peer).await) }
    });
    client
        .run(shutdown, HttpHandler::new(service, ServeConfig::default()))
        .await;
}
