//! `GET /connect` of a tunnel server as an axum router (the tests' and the `idle_tunnels`
//! example's; `faden server` merges the same route into its management API).

use std::net::SocketAddr;

use tunnel::TunnelServer;

/// `GET /connect` of `server` as an axum router, with each request's source address.
pub fn connect_router(server: &TunnelServer) -> axum::Router {
    let server = server.clone();
    axum::Router::new().route(
        tunnel::protocol::CONNECT_PATH,
        axum::routing::get(move |req: http::Request<axum::body::Body>| {
            let server = server.clone();
            async move {
                let peer = req
                    .extensions()
                    .get::<axum::extract::ConnectInfo<SocketAddr>>()
                    .map(|c| c.0);
                server.handle_connect(req, peer).await
            }
        }),
    )
}
