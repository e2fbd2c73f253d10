//! The gateway's transport for `tunnel` endpoints, in process.
//!
//! Per connection: open a yamux stream to the endpoint's worker, ask its proxy once for a byte
//! relay to the endpoint's instance (`CONNECT model-<m>-<i>.static:0`, see
//! [`gateway::worker_proxy::relay_target`]), then speak HTTP/1.1 to the engine itself over that
//! stream, kept alive and reused for the next requests to the same instance. The worker copies
//! bytes and does no HTTP work per request. The answer streams back as it arrives (nothing is
//! buffered); dropping it before its end closes the connection and resets the stream, which
//! closes the worker's connection to the engine and so cancels the request.
//!
//! What the engine receives is what the worker proxy used to send it: origin-form, `Host:
//! 127.0.0.1:<instance port>`, and neither `X-GPUStack-Model-Instance` nor the gateway's worker
//! credential (that one goes on the `CONNECT` only; the client's own key never left the
//! gateway).
//!
//! A worker that predates the relay answers the `CONNECT` with 405 (400 is taken the same way):
//! it then gets HTTP/1.1 to its proxy per request, as before, on connections kept per worker,
//! and is asked again after [`RELAY_RECHECK`].

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use bytes::Bytes;
use control::routing::Endpoint;
use gateway::error::{ErrorKind, GatewayError};
use gateway::headers::X_GPUSTACK_MODEL_INSTANCE;
use gateway::upstream::{UpstreamBody, UpstreamFuture, instance_host};
use gateway::worker_proxy::relay_target;
use http::{HeaderValue, Request, Response, StatusCode, Uri, header};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::client::conn::http1::SendRequest;
use parking_lot::Mutex;

use crate::http::Connected;
use crate::mux::TunnelStream;
use crate::server::TunnelServer;

/// [`gateway::Upstream`] over the in-process tunnel registry.
#[derive(Clone, Debug)]
pub struct TunnelUpstream {
    server: TunnelServer,
    pool: Arc<StreamPool>,
}

impl TunnelUpstream {
    pub fn new(server: TunnelServer) -> Self {
        Self {
            server,
            pool: Arc::new(StreamPool::default()),
        }
    }
}

/// Connections kept per instance (or per worker, for workers without the relay), at most,
/// busy ones included. Beyond it, a request's stream connection ends with its answer.
const MAX_POOLED_PER_KEY: usize = 512;

/// A stream connection unused for longer than this is closed rather than reused: below the
/// engines' own keep-alive (uvicorn: 5 s), which now ends the relayed connections, so that
/// reuse does not race their close (the worker proxy's own engine pool uses the same 3 s).
const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(3);

/// How long a worker that refused the relay is sent per-request proxied HTTP before it is
/// asked again (it may have been upgraded meanwhile).
pub const RELAY_RECHECK: Duration = Duration::from_secs(60);

/// What a pooled connection leads to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Key {
    /// Relayed to one instance: HTTP/1.1 straight to its engine.
    Relay { worker: i64, instance: i64 },
    /// HTTP/1.1 to the worker proxy, which forwards each request.
    Proxy { worker: i64 },
}

/// HTTP/1.1 connections over tunnel streams, by [`Key`].
///
/// A connection stays in the pool while its response streams (its own task drives it), and is
/// handed out again once hyper reports it ready, that is after the previous response body was
/// read to the end; most recently used first. A connection whose body was dropped early is
/// closed by hyper (which resets the stream and so cancels the work on the worker) and is
/// pruned here. A reaper closes connections idle past [`POOL_IDLE_TIMEOUT`] even when no
/// request comes. No task per request.
#[derive(Debug, Default)]
struct StreamPool {
    conns: Mutex<HashMap<Key, Vec<Pooled>>>,
    /// Workers that refused the relay, and when to ask them again.
    no_relay: Mutex<HashMap<i64, Instant>>,
    reaper: AtomicBool,
}

#[derive(Debug)]
struct Pooled {
    sender: SendRequest<Full<Bytes>>,
    /// When the connection last took a request: a bound on how long it may have been idle.
    used: Instant,
}

impl Pooled {
    fn stale(&self, now: Instant) -> bool {
        self.sender.is_closed()
            || (self.sender.is_ready() && now.duration_since(self.used) > POOL_IDLE_TIMEOUT)
    }
}

impl StreamPool {
    /// A ready connection for `key`, most recently used first; prunes closed and stale ones
    /// on the way.
    fn checkout(&self, key: Key) -> Option<SendRequest<Full<Bytes>>> {
        let mut conns = self.conns.lock();
        let list = conns.get_mut(&key)?;
        let now = Instant::now();
        list.retain(|c| !c.stale(now));
        let found = list.iter().rposition(|c| c.sender.is_ready());
        let sender = found.map(|i| list.swap_remove(i).sender);
        if list.is_empty() {
            conns.remove(&key);
        }
        sender
    }

    /// Keeps a connection that just took a request, when there is room.
    fn checkin(self: &Arc<Self>, key: Key, sender: SendRequest<Full<Bytes>>) {
        {
            let mut conns = self.conns.lock();
            let list = conns.entry(key).or_default();
            if list.len() < MAX_POOLED_PER_KEY {
                list.push(Pooled {
                    sender,
                    used: Instant::now(),
                });
            }
        }
        self.start_reaper();
    }

    /// Closes stale connections every [`POOL_IDLE_TIMEOUT`] while the pool exists.
    fn start_reaper(self: &Arc<Self>) {
        if self.reaper.swap(true, Ordering::Relaxed) {
            return;
        }
        let pool: Weak<Self> = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(POOL_IDLE_TIMEOUT).await;
                let Some(pool) = pool.upgrade() else { break };
                pool.reap();
            }
        });
    }

    fn reap(&self) {
        let now = Instant::now();
        let mut stale = Vec::new();
        self.conns.lock().retain(|_, list| {
            let (old, keep): (Vec<Pooled>, Vec<Pooled>) =
                std::mem::take(list).into_iter().partition(|c| c.stale(now));
            stale.extend(old);
            *list = keep;
            !list.is_empty()
        });
        // Closed outside the lock.
        drop(stale);
    }

    fn relays(&self, worker: i64) -> bool {
        let mut no_relay = self.no_relay.lock();
        match no_relay.get(&worker) {
            Some(until) if Instant::now() < *until => false,
            Some(_) => {
                no_relay.remove(&worker);
                true
            }
            None => true,
        }
    }

    fn refuses_relay(&self, worker: i64) {
        self.no_relay
            .lock()
            .insert(worker, Instant::now() + RELAY_RECHECK);
    }
}

/// Turns a proxied request into the one sent on a stream: origin-form target, `Host` from the
/// original authority, and the instance header (the gateway sets it; added if missing).
pub(crate) fn to_origin_form<B>(
    request: &mut Request<B>,
    instance: Option<HeaderValue>,
) -> Result<(), http::Error> {
    let authority = request.uri().authority().cloned();
    let path = request
        .uri()
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_owned();
    *request.uri_mut() = Uri::try_from(path)?;
    *request.version_mut() = http::Version::HTTP_11;
    let headers = request.headers_mut();
    if let Some(authority) = authority {
        if let Ok(host) = HeaderValue::from_str(authority.as_str()) {
            headers.insert(header::HOST, host);
        }
    }
    if let Some(instance) = instance {
        if !headers.contains_key(X_GPUSTACK_MODEL_INSTANCE) {
            headers.insert(X_GPUSTACK_MODEL_INSTANCE, instance);
        }
    }
    Ok(())
}

/// `Host` as the worker proxy sends it to an instance: `127.0.0.1:<port>` (the port left out
/// when it is 80, or unknown).
fn engine_host(port: u16) -> HeaderValue {
    match port {
        0 | 80 => HeaderValue::from_static("127.0.0.1"),
        port => HeaderValue::try_from(format!("127.0.0.1:{port}"))
            .unwrap_or_else(|_| HeaderValue::from_static("127.0.0.1")),
    }
}

/// What a send on the pool, or a relay request, came to.
#[allow(clippy::large_enum_variant)]
enum Attempt {
    Answered(Response<Incoming>),
    /// The request never left: no pooled connection could take it, or the worker refused
    /// the relay.
    Unsent(Request<Full<Bytes>>),
}

/// The endpoint fields a request needs.
#[derive(Clone, Copy, Debug)]
struct Target {
    worker: i64,
    instance: i64,
    model: i64,
    port: u16,
}

impl gateway::Upstream for TunnelUpstream {
    fn send(&self, endpoint: &Endpoint, request: Request<Full<Bytes>>) -> UpstreamFuture {
        let this = self.clone();
        let target = Target {
            worker: endpoint.worker_id,
            instance: endpoint.instance_id,
            model: endpoint.model_id,
            port: endpoint.instance_port,
        };
        let instance_header = HeaderValue::from_str(&instance_host(endpoint)).ok();
        Box::pin(async move {
            let response = this.send_to(target, instance_header, request).await?;
            Ok(response.map(UpstreamBody::from))
        })
    }
}

impl TunnelUpstream {
    async fn send_to(
        &self,
        target: Target,
        instance_header: Option<HeaderValue>,
        mut request: Request<Full<Bytes>>,
    ) -> Result<Response<Incoming>, GatewayError> {
        to_origin_form(&mut request, None).map_err(|e| {
            GatewayError::new(ErrorKind::UpstreamConnect, "invalid request target").with_cause(e)
        })?;
        // Both were for the worker proxy: the credential goes on the CONNECT only.
        let headers = request.headers_mut();
        let credential = headers.remove(header::AUTHORIZATION);
        headers.remove(X_GPUSTACK_MODEL_INSTANCE);
        if self.pool.relays(target.worker) {
            request
                .headers_mut()
                .insert(header::HOST, engine_host(target.port));
            match self
                .send_relayed(target, request, credential.clone())
                .await?
            {
                Attempt::Answered(response) => return Ok(response),
                Attempt::Unsent(unsent) => request = unsent,
            }
        }
        // An older worker: its proxy forwards each request.
        let headers = request.headers_mut();
        if let Some(instance) = instance_header {
            headers.insert(X_GPUSTACK_MODEL_INSTANCE, instance);
        }
        if let Some(credential) = credential {
            headers.insert(header::AUTHORIZATION, credential);
        }
        let key = Key::Proxy {
            worker: target.worker,
        };
        let request = match self.send_pooled(key, request).await? {
            Attempt::Answered(response) => return Ok(response),
            Attempt::Unsent(request) => request,
        };
        let stream = self.open(target.worker).await?;
        let mut sender = crate::http::handshake(stream).await.map_err(failed)?;
        let response = sender.send_request(request).await.map_err(failed)?;
        self.pool.checkin(key, sender);
        Ok(response)
    }

    /// On a relayed connection to the instance: a pooled one, else a new stream and `CONNECT`.
    async fn send_relayed(
        &self,
        target: Target,
        request: Request<Full<Bytes>>,
        credential: Option<HeaderValue>,
    ) -> Result<Attempt, GatewayError> {
        let key = Key::Relay {
            worker: target.worker,
            instance: target.instance,
        };
        let request = match self.send_pooled(key, request).await? {
            Attempt::Answered(response) => return Ok(Attempt::Answered(response)),
            Attempt::Unsent(request) => request,
        };
        let connect_to =
            Uri::try_from(relay_target(target.model, target.instance)).map_err(|e| {
                GatewayError::new(ErrorKind::UpstreamConnect, "invalid instance id").with_cause(e)
            })?;
        let stream = self.open(target.worker).await?;
        let connected = crate::http::connect_instance(stream, connect_to, credential)
            .await
            .map_err(|e| {
                GatewayError::new(
                    ErrorKind::UpstreamConnect,
                    "the worker did not answer the relay request (through the tunnel)",
                )
                .with_cause(e)
            })?;
        let upgraded = match connected {
            Connected::Relay(upgraded) => upgraded,
            Connected::Refused(response)
                if matches!(
                    response.status(),
                    StatusCode::METHOD_NOT_ALLOWED | StatusCode::BAD_REQUEST
                ) =>
            {
                tracing::info!(
                    worker = target.worker,
                    status = response.status().as_u16(),
                    "the worker does not relay to instances (an older faden?): proxying each request"
                );
                self.pool.refuses_relay(target.worker);
                return Ok(Attempt::Unsent(request));
            }
            // The worker proxy's own answer (404 marked no-such-instance, 502, 401, 429): the
            // gateway handles it as it would the proxied request's.
            Connected::Refused(response) => return Ok(Attempt::Answered(response)),
        };
        let mut sender = crate::http::handshake_io(upgraded).await.map_err(failed)?;
        let response = sender.send_request(request).await.map_err(failed)?;
        self.pool.checkin(key, sender);
        Ok(Attempt::Answered(response))
    }

    /// On a pooled connection of `key`; a request that never left one (the stream was closed
    /// meanwhile) goes to the next, and comes back when none is left.
    async fn send_pooled(
        &self,
        key: Key,
        mut request: Request<Full<Bytes>>,
    ) -> Result<Attempt, GatewayError> {
        while let Some(mut sender) = self.pool.checkout(key) {
            match sender.try_send_request(request).await {
                Ok(response) => {
                    self.pool.checkin(key, sender);
                    return Ok(Attempt::Answered(response));
                }
                Err(mut e) => match e.take_message() {
                    Some(unsent) => request = unsent,
                    None => return Err(failed(e.into_error())),
                },
            }
        }
        Ok(Attempt::Unsent(request))
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

fn failed(e: hyper::Error) -> GatewayError {
    GatewayError::new(
        ErrorKind::UpstreamProtocol,
        "the model instance failed before answering (through the tunnel)",
    )
    .with_cause(e)
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
