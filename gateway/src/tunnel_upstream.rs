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
//! The connections are the gateway's own pool ([`net::pool`]) on tunnel streams: keyed by
//! instance (or worker), most recently used first, driven by the request's task (no task per
//! connection, no channel per request or chunk), idle ones closed after `POOL_IDLE_TIMEOUT`.
//!
//! With several servers on one database a worker's tunnel ends on one of them, its owner (the
//! endpoint's `proxy_address`). A request for a worker whose tunnel is not here goes to the
//! owner's proxy port ([`TunnelUpstream::with_owners`]): one more hop, authenticated with this
//! server's data-plane key.

use std::sync::Arc;
use std::time::Duration;

use crate::error::{ErrorKind, GatewayError};
use crate::proxy_port_upstream::ProxyPortUpstream;
use crate::upstream::{UpstreamBody, UpstreamFuture, UpstreamRequest, first_byte_timeout};
use bytes::Bytes;
use control_client::routing::Endpoint;
use http::{HeaderValue, Request, Response, Uri, header};
use http_body_util::Full;
use hyper_util::rt::TokioIo;
use net::pool::{Connection, Pool, PoolConfig, Prepared};
use tunnel::target::relay_target;

use tunnel::http::{Connected, Relayed};
use tunnel::mux::TunnelStream;
use tunnel::server::{Dialect, TunnelServer};

/// [`crate::Upstream`] over the in-process tunnel registry.
#[derive(Clone, Debug)]
pub struct TunnelUpstream {
    server: TunnelServer,
    pool: Pool,
    /// Tunnels that end on other servers: their proxy ports, and this server's own proxy
    /// address (a stale record of it is not dialled: it would come back here).
    owners: Option<(ProxyPortUpstream, Arc<str>)>,
}

impl TunnelUpstream {
    pub fn new(server: TunnelServer) -> Self {
        Self {
            server,
            pool: Pool::new(PoolConfig {
                // Streams are opened, not dialled: the tunnel's own liveness bounds them.
                connect_timeout: Duration::from_secs(10),
                idle_timeout: POOL_IDLE_TIMEOUT,
                max_idle: MAX_IDLE_PER_KEY,
            }),
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

/// Idle connections kept per instance (or per worker, for workers without the relay), at most.
const MAX_IDLE_PER_KEY: usize = 512;

/// A stream connection unused for longer than this is closed rather than reused: below the
/// engines' own keep-alive (uvicorn: 5 s), which now ends the relayed connections, so that
/// reuse does not race their close (the worker proxy's own engine pool uses the same 3 s).
const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(3);

/// `Host` as the worker proxy sends it to an instance: `127.0.0.1:<port>` (the port left out
/// when it is 80, or unknown).
fn engine_host(port: u16) -> HeaderValue {
    match port {
        0 | 80 => HeaderValue::from_static("127.0.0.1"),
        port => HeaderValue::try_from(format!("127.0.0.1:{port}"))
            .unwrap_or_else(|_| HeaderValue::from_static("127.0.0.1")),
    }
}

/// The endpoint fields a request needs.
#[derive(Clone, Copy, Debug)]
struct Target {
    worker: i64,
    instance: i64,
    model: i64,
    port: u16,
    /// The worker's address, when it is an IP: what a GPUStack worker's tunnel dials.
    ip: Option<std::net::IpAddr>,
}

impl Target {
    /// Pool key of the connections relayed to this instance.
    fn relay_key(self) -> String {
        format!("relay/{}/{}", self.worker, self.instance)
    }

    /// Pool key of the sessions a GPUStack worker's tunnel client opened to this instance.
    fn session_key(self) -> String {
        format!("gpustack/{}/{}", self.worker, self.instance)
    }
}

/// What asking a worker for a relay came to.
enum Relay {
    Connected(Connection),
    /// The worker proxy's own answer (404 marked no-such-instance, 502, 401, 429): the gateway
    /// handles it as it would the proxied request's.
    Answered(Response<UpstreamBody>),
}

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
            && !self.server.takes_streams(endpoint.worker_id)
        {
            return remote.send(endpoint, request, deadline);
        }
        let this = self.clone();
        let target = Target {
            worker: endpoint.worker_id,
            instance: endpoint.instance_id,
            model: endpoint.model_id,
            port: endpoint.instance_port,
            ip: endpoint.address.parse().ok(),
        };
        Box::pin(async move { this.send_to(target, request, deadline).await })
    }
}

impl TunnelUpstream {
    /// Sends `request` to `target` in origin form, its response head due by `deadline`: on a
    /// pooled connection the pool's per-connection timer bounds the wait; dialling a new
    /// stream (and its relay request) has a timer of its own.
    async fn send_to(
        &self,
        target: Target,
        request: UpstreamRequest,
        deadline: tokio::time::Instant,
    ) -> Result<Response<UpstreamBody>, GatewayError> {
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
        let wire = |headers| {
            let mut wire = Request::new(Full::new(body));
            *wire.method_mut() = method;
            *wire.uri_mut() = Uri::from(path_and_query);
            *wire.headers_mut() = headers;
            wire
        };
        if self.server.dialect(target.worker) == Some(Dialect::GpuStack) {
            // GPUStack's tunnel client dials the instance itself: HTTP/1.1 to the engine over
            // the session, as on the direct path.
            let key = target.session_key();
            headers.insert(header::HOST, engine_host(target.port));
            let prepared = Prepared::new(wire(headers))?.within(deadline);
            let connect = || async {
                let stream = self.open_session(target).await?;
                Ok(Connection::new(stream, &key, Bytes::new()))
            };
            let response = self
                .pool
                .send_keyed(&key, None, prepared, connect)
                .await
                .map_err(through_tunnel)?;
            return Ok(response.map(UpstreamBody::from));
        }
        let key = target.relay_key();
        let first = match self.pool.checkout(&key) {
            Some(conn) => conn,
            None => match tokio::time::timeout_at(
                deadline,
                self.relay(target, &key, credential.clone()),
            )
            .await
            .map_err(|_| first_byte_timeout())??
            {
                Relay::Connected(conn) => conn,
                Relay::Answered(response) => return Ok(response),
            },
        };
        headers.insert(header::HOST, engine_host(target.port));
        let prepared = Prepared::new(wire(headers))?.within(deadline);
        let connect = || self.relay_again(target, &key, credential.clone());
        let response = self
            .pool
            .send_keyed(&key, Some(first), prepared, connect)
            .await
            .map_err(through_tunnel)?;
        Ok(response.map(UpstreamBody::from))
    }

    /// A new stream to the worker, and `CONNECT` to the instance on it.
    async fn relay(
        &self,
        target: Target,
        key: &str,
        credential: Option<HeaderValue>,
    ) -> Result<Relay, GatewayError> {
        let connect_to =
            Uri::try_from(relay_target(target.model, target.instance)).map_err(|e| {
                GatewayError::new(ErrorKind::UpstreamConnect, "invalid instance id").with_cause(e)
            })?;
        let stream = self.open(target.worker).await?;
        let connected = tunnel::http::connect_instance(stream, connect_to, credential)
            .await
            .map_err(|e| {
                GatewayError::new(
                    ErrorKind::UpstreamConnect,
                    "the worker did not answer the relay request (through the tunnel)",
                )
                .with_cause(e)
            })?;
        match connected {
            // The relayed stream, after whatever hyper read past the answer.
            Connected::Relay(Relayed::Stream { stream, read_ahead }) => {
                Ok(Relay::Connected(Connection::new(stream, key, read_ahead)))
            }
            Connected::Relay(Relayed::Other(upgraded)) => Ok(Relay::Connected(Connection::new(
                TokioIo::new(upgraded),
                key,
                Bytes::new(),
            ))),
            Connected::Refused(response) => Ok(Relay::Answered(response.map(UpstreamBody::from))),
        }
    }

    /// Another relayed connection for a request a pooled one could not take: any answer but a
    /// relay is a failure to connect now (the request is already encoded for the engine).
    async fn relay_again(
        &self,
        target: Target,
        key: &str,
        credential: Option<HeaderValue>,
    ) -> Result<Connection, GatewayError> {
        match self.relay(target, key, credential).await? {
            Relay::Connected(conn) => Ok(conn),
            Relay::Answered(_) => Err(GatewayError::new(
                ErrorKind::UpstreamConnect,
                "the worker refused the relay to the instance (through the tunnel)",
            )),
        }
    }

    async fn open_session(
        &self,
        target: Target,
    ) -> Result<tunnel::gpustack_link::GpuStackStream, GatewayError> {
        let Some(ip) = target.ip else {
            return Err(GatewayError::new(
                ErrorKind::UpstreamConnect,
                "the worker's address is not an IP: its GPUStack tunnel cannot dial it",
            ));
        };
        self.server
            .open_session(target.worker, ip, target.port)
            .await
            .map_err(|e| {
                GatewayError::new(
                    ErrorKind::UpstreamConnect,
                    "the worker's GPUStack tunnel did not connect to the instance",
                )
                .with_cause(e)
            })
    }

    async fn open(&self, worker: i64) -> Result<TunnelStream, GatewayError> {
        self.server.open_stream(worker).await.map_err(|e| {
            GatewayError::new(
                ErrorKind::UpstreamConnect,
                "the worker's tunnel is not available",
            )
            .with_cause(e)
        })
    }
}

/// Says which path failed.
fn through_tunnel(e: GatewayError) -> GatewayError {
    if e.kind == ErrorKind::UpstreamProtocol {
        GatewayError::new(
            ErrorKind::UpstreamProtocol,
            "the model instance failed before answering (through the tunnel)",
        )
        .with_cause(e)
    } else {
        e
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engine_host_is_what_the_worker_proxy_sent() {
        assert_eq!(engine_host(40000), "127.0.0.1:40000");
        assert_eq!(engine_host(80), "127.0.0.1");
        assert_eq!(engine_host(0), "127.0.0.1");
    }
}
