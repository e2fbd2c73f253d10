//! The gateway's transport for `tunnel` endpoints, in process: HTTP/1.1 to the worker's
//! reverse proxy over yamux streams of the worker's tunnel, kept alive and reused across
//! requests. The answer streams back as it arrives (nothing is buffered); dropping the answer
//! before its end closes the connection and resets the stream, which cancels the request on
//! the worker.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use control::routing::Endpoint;
use gateway::error::{ErrorKind, GatewayError};
use gateway::headers::X_GPUSTACK_MODEL_INSTANCE;
use gateway::upstream::{UpstreamFuture, instance_host};
use http::{HeaderValue, Request, Uri, header};
use http_body_util::Full;
use hyper::client::conn::http1::SendRequest;
use parking_lot::Mutex;

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

/// Connections kept per worker, at most. Beyond it, a request's stream connection ends with
/// its answer (streams are cheap; the pool saves the stream open and the HTTP/1 handshake on
/// both ends for the common case).
const MAX_POOLED_PER_WORKER: usize = 512;

/// A stream connection unused for longer than this is closed rather than reused: well under
/// the worker's keep-alive timeout, so that reuse never races its close.
const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(4);

/// HTTP/1.1 connections over tunnel streams, by worker.
///
/// A connection stays in the pool while its response streams (its own task drives it), and is
/// handed out again once hyper reports it ready, that is after the previous response body was
/// read to the end. A connection whose body was dropped early is closed by hyper (which resets
/// the stream and so cancels the work on the worker) and is pruned here. No task per request.
#[derive(Debug, Default)]
struct StreamPool {
    conns: Mutex<HashMap<i64, Vec<Pooled>>>,
}

#[derive(Debug)]
struct Pooled {
    sender: SendRequest<Full<Bytes>>,
    /// When the connection last took a request: a bound on how long it may have been idle.
    used: Instant,
}

impl StreamPool {
    /// A ready connection to `worker`'s proxy, most recently used first; prunes closed and
    /// stale ones on the way.
    fn checkout(&self, worker: i64) -> Option<SendRequest<Full<Bytes>>> {
        let mut conns = self.conns.lock();
        let list = conns.get_mut(&worker)?;
        let now = Instant::now();
        let stale = |c: &Pooled| {
            c.sender.is_closed()
                || (c.sender.is_ready() && now.duration_since(c.used) > POOL_IDLE_TIMEOUT)
        };
        list.retain(|c| !stale(c));
        let found = list.iter().rposition(|c| c.sender.is_ready());
        let sender = found.map(|i| list.swap_remove(i).sender);
        if list.is_empty() {
            conns.remove(&worker);
        }
        sender
    }

    /// Keeps a connection that just took a request, when there is room.
    fn checkin(&self, worker: i64, sender: SendRequest<Full<Bytes>>) {
        let mut conns = self.conns.lock();
        let list = conns.entry(worker).or_default();
        if list.len() < MAX_POOLED_PER_WORKER {
            list.push(Pooled {
                sender,
                used: Instant::now(),
            });
        }
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

impl gateway::Upstream for TunnelUpstream {
    fn send(&self, endpoint: &Endpoint, mut request: Request<Full<Bytes>>) -> UpstreamFuture {
        let server = self.server.clone();
        let pool = self.pool.clone();
        let worker = endpoint.worker_id;
        let instance = HeaderValue::from_str(&instance_host(endpoint)).ok();
        Box::pin(async move {
            to_origin_form(&mut request, instance).map_err(|e| {
                GatewayError::new(ErrorKind::UpstreamConnect, "invalid request target")
                    .with_cause(e)
            })?;
            // A pooled stream connection first; a request that never left it (the stream was
            // closed meanwhile) goes on a new one.
            while let Some(mut sender) = pool.checkout(worker) {
                match sender.try_send_request(request).await {
                    Ok(response) => {
                        pool.checkin(worker, sender);
                        return Ok(response);
                    }
                    Err(mut e) => match e.take_message() {
                        Some(unsent) => request = unsent,
                        None => return Err(failed(e.into_error())),
                    },
                }
            }
            let stream = server.open_stream(worker).await.map_err(|e| {
                GatewayError::new(
                    ErrorKind::UpstreamConnect,
                    "the worker's tunnel is not available",
                )
                .with_cause(e)
            })?;
            let mut sender = crate::http::handshake(stream).await.map_err(failed)?;
            let response = sender.send_request(request).await.map_err(failed)?;
            pool.checkin(worker, sender);
            Ok(response)
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
