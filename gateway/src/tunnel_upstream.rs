//! The gateway's transport for `tunnel` endpoints, in process.
//!
//! Per connection: open a yamux stream to the endpoint's worker, ask its proxy once for a byte
//! relay to the endpoint's instance (`CONNECT model-<m>-<i>.static:0`, see
//! [`tunnel::target::relay_target`]), then speak HTTP/1.1 to the engine itself over that
//! stream, kept alive and reused for the next requests to the same instance. The worker copies
//! bytes and does no HTTP work per request. The answer streams back as it arrives (nothing is
//! buffered); dropping it before its end closes the connection and resets the stream, which
//! closes the worker's connection to the engine and so cancels the request.
//!
//! What the engine receives is what the worker proxy sends it per request: origin-form, `Host:
//! 127.0.0.1:<instance port>`, and neither `X-GPUStack-Model-Instance` nor the gateway's worker
//! credential (that one goes on the `CONNECT` only; the client's own key never left the
//! gateway).
//!
//! Streams, relays and GPUStack sessions alike come from the tunnel's [`Connector`], whose pool
//! ([`net::pool`]) keeps them alive per instance, most recently used first, driven by the
//! request's task (no task per connection, no channel per request or chunk), idle ones closed
//! after `POOL_IDLE_TIMEOUT`.
//!
//! With several servers on one database a worker's tunnel ends on one of them, its owner (the
//! endpoint's `proxy_address`). A request for a worker whose tunnel is not here goes to the
//! owner's proxy port ([`TunnelUpstream::with_owners`]): one more hop, authenticated with this
//! server's data-plane key.

use std::sync::Arc;
use std::time::Duration;

use crate::error::{ErrorKind, GatewayError};
use crate::proxy_port_upstream::ProxyPortUpstream;
use crate::upstream::{UpstreamBody, UpstreamFuture, UpstreamRequest};
use control_client::routing::Endpoint;
use http::{Request, Uri, header};
use http_body_util::{Either, Full};
use net::pool::{PoolConfig, Prepared};
use tunnel::connector::{ConnectError, Connector, Instance, Target, engine_host};
use tunnel::server::TunnelServer;

/// [`crate::Upstream`] over the in-process tunnel registry.
#[derive(Clone, Debug)]
pub struct TunnelUpstream {
    connector: Connector,
    /// Tunnels that end on other servers: their proxy ports, and this server's own proxy
    /// address (a stale record of it is not dialled: it would come back here).
    owners: Option<(ProxyPortUpstream, Arc<str>)>,
}

impl TunnelUpstream {
    pub fn new(server: TunnelServer) -> Self {
        Self {
            connector: Connector::new(
                server,
                PoolConfig {
                    // Streams are opened, not dialled: the tunnel's own liveness bounds them.
                    connect_timeout: Duration::from_secs(10),
                    idle_timeout: POOL_IDLE_TIMEOUT,
                    max_idle: MAX_IDLE_PER_KEY,
                },
            ),
            owners: None,
        }
    }

    /// Sends requests for workers whose tunnel is not here to their owner's proxy port, through
    /// `remote`; `own` is this server's proxy address as recorded in `proxy_address`.
    pub fn with_owners(mut self, remote: ProxyPortUpstream, own: &str) -> Self {
        self.owners = Some((remote, own.into()));
        self
    }
}

/// Idle connections kept per instance, at most.
const MAX_IDLE_PER_KEY: usize = 512;

/// A stream connection unused for longer than this is closed rather than reused: below the
/// engines' own keep-alive (uvicorn: 5 s), which now ends the relayed connections, so that
/// reuse does not race their close (the worker proxy's own engine pool uses the same 3 s).
pub const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(3);

impl crate::Upstream for TunnelUpstream {
    fn send(
        &self,
        endpoint: &Endpoint,
        request: UpstreamRequest,
        deadline: tokio::time::Instant,
    ) -> UpstreamFuture {
        // The record says another server owns the tunnel, and none that takes streams is here
        // (not yet, or no longer: a worker moving away says so on its old tunnel).
        if let Some((remote, own)) = &self.owners
            && endpoint
                .proxy_address
                .as_deref()
                .is_some_and(|owner| owner != &**own)
            && !self.connector.server().takes_streams(endpoint.worker_id)
        {
            return remote.send(endpoint, request, deadline);
        }
        let this = self.clone();
        let worker = endpoint.worker_id;
        let instance = Instance {
            model: endpoint.model_id,
            id: endpoint.instance_id,
            port: endpoint.instance_port,
            ip: endpoint.address.parse().ok(),
        };
        Box::pin(async move { this.send_to(worker, instance, request, deadline).await })
    }
}

impl TunnelUpstream {
    /// Sends `request` to `instance` in origin form, its response head due by `deadline`.
    async fn send_to(
        &self,
        worker: i64,
        instance: Instance,
        request: UpstreamRequest,
        deadline: tokio::time::Instant,
    ) -> Result<http::Response<UpstreamBody>, GatewayError> {
        let UpstreamRequest {
            method,
            path_and_query,
            mut headers,
            body,
            route,
        } = request;
        // The credential is for the worker proxy: it goes on the relay's `CONNECT` only (the
        // stream is the target: neither the proxy address nor the instance header is sent).
        let (_, _, credential) = route.into_parts();
        headers.insert(header::HOST, engine_host(instance.port));
        let mut wire = Request::new(Full::new(body));
        *wire.method_mut() = method;
        *wire.uri_mut() = Uri::from(path_and_query);
        *wire.headers_mut() = headers;
        let prepared = Prepared::new(wire)?.within(deadline);
        let answer = self
            .connector
            .send(
                worker,
                Target::Instance(instance),
                prepared,
                credential.as_ref(),
            )
            .await
            .map_err(through_tunnel)?;
        Ok(answer.map(|body| match body {
            Either::Left(pooled) => UpstreamBody::from(pooled),
            Either::Right(refusal) => UpstreamBody::from(refusal),
        }))
    }
}

/// Says which path failed; the kind decides whether the gateway tries another instance.
fn through_tunnel(e: ConnectError) -> GatewayError {
    match e {
        ConnectError::Pool(e) => {
            let e = GatewayError::from(e);
            if e.kind != ErrorKind::UpstreamProtocol {
                return e;
            }
            GatewayError::new(
                ErrorKind::UpstreamProtocol,
                "the model instance failed before answering (through the tunnel)",
            )
            .with_cause(e)
        }
        e => GatewayError::new(ErrorKind::UpstreamConnect, connect_failure(&e)).with_cause(e),
    }
}

/// What the gateway says of a stream that did not reach the instance.
fn connect_failure(e: &ConnectError) -> &'static str {
    match e {
        ConnectError::NoAddress => {
            "the worker's address is not an IP: its GPUStack tunnel cannot dial it"
        }
        ConnectError::Relay(_) => {
            "the worker did not answer the relay request (through the tunnel)"
        }
        ConnectError::Refused(_) => {
            "the worker refused the relay to the instance (through the tunnel)"
        }
        ConnectError::Tunnel(_)
        | ConnectError::GoingAway
        | ConnectError::NoProxy
        | ConnectError::Pool(_) => "the worker's tunnel is not available",
    }
}
