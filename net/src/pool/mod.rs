//! The plain-HTTP upstream pool: HTTP/1.1 keep-alive connections, each request and its
//! response driven by the task that sends it.
//!
//! hyper-util's legacy `Client` runs every connection in a task of its own: a request crosses
//! from the handler's task to the connection's task through a channel, its response comes back
//! through a oneshot, every body chunk through another channel. hyper's low-level client
//! connection, driven in-task, still dispatches each request through a channel and a callback
//! and keeps its own buffers. Here the exchange is written for the gateway's case: the request
//! head is encoded straight from the caller's parts (`h1::client`) and written with
//! the first piece of body in one `writev`; the response head is parsed in place from the
//! connection's read buffer; the response body ([`PooledBody`]) owns the connection and
//! decodes its frames from that buffer (the server's own decoder, `h1::body`) as its
//! reader polls it. No task, channel or wake-up stands between the upstream socket and the
//! client's.
//!
//! Behaviour:
//! - keep-alive with the most recently used connection first, at most `max_idle` idle
//!   connections per upstream address, idle ones closed after `idle_timeout` (kept below the
//!   engines' own keep-alive so reuse does not race their close, GPUStack #4419);
//! - an idle connection is checked before reuse without a system call unless its socket
//!   reported readable (a close by the upstream, or unsolicited bytes: either retires it);
//!   a request that could not be written at all on a reused connection goes to the next one,
//!   and only then;
//! - `Host` from the URI when the caller set none, origin-form target, framing from the body's
//!   size (`Content-Length` when known, else chunked), `TCP_NODELAY`, a connect timeout;
//! - the response head may come before the request body was all sent (an early error): the
//!   rest of the body is then not sent and the connection not reused;
//! - a deadline for the response head ([`Prepared::within`]: the gateway's first-byte timeout)
//!   runs on a timer that the connection keeps across its exchanges, moved only when it would
//!   fire late or fired early (`Conn::poll_deadline`), where a timer per request would be
//!   inserted into and removed from the runtime's timer wheel each time (dialling a new
//!   connection is bounded by the same deadline, with a timer of its own);
//! - a connection goes back to the pool only once its response body was read to the end, with
//!   nothing after it; dropping a body before that closes the connection, which is how a client
//!   disconnect cancels the upstream work.
//!
//! An idle connection is not polled: a close by the upstream is noticed when the connection is
//! next checked out or when the reaper drops it.
//!
//! Connections run on any [`Transport`]: [`Pool::send`] dials TCP by the request URI's
//! authority; [`Pool::send_keyed`] takes a key and a connector of the caller's (the tunnel
//! transport keys its connections by instance and dials yamux streams).
//!
//! The pieces: [`Pool`] itself (here) sends a request on an idle connection or a new one; `idle`
//! keeps the idle connections and reaps them; `conn` is one connection and its reads and
//! writes; `outgoing` the request bytes queued for the socket; `exchange` a request driven on a
//! connection up to its response head; `body` the response body read from the connection;
//! `dial` the TCP connect.

mod body;
mod conn;
mod dial;
mod error;
mod exchange;
mod idle;
mod outgoing;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::future::{Future, poll_fn};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use bytes::Bytes;
use http::uri::Authority;
use http::{Request, Response};
use http_body::Body;
use parking_lot::Mutex;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::time::Instant;

use crate::BoxError;

pub use body::PooledBody;
pub use conn::Connection;
pub use dial::{bare_host, dial_tcp};
pub use error::{PoolError, PoolErrorKind};
pub use exchange::Prepared;

use error::{body_failed, first_byte_timeout};
use exchange::ExchangeError;
use idle::PoolInner;

/// Pool settings.
#[derive(Clone, Copy, Debug)]
pub struct PoolConfig {
    /// For the TCP connections [`Pool::send`] dials.
    pub connect_timeout: Duration,
    /// Idle connections are closed after this long (keep it below the upstream's keep-alive).
    pub idle_timeout: Duration,
    /// Idle connections kept per key, at most.
    pub max_idle: usize,
}

/// What a request body sent through the pool must be: the gateway sends buffered bodies
/// (`Full<Bytes>`), the worker proxy streams its client's body (`Incoming`).
pub trait RequestBody: Body<Data = Bytes, Error: Into<BoxError>> + Send + Unpin + 'static {}

impl<B> RequestBody for B where B: Body<Data = Bytes, Error: Into<BoxError>> + Send + Unpin + 'static
{}

/// The byte stream a pooled connection runs on: TCP, a tunnel stream, a relayed connection.
pub trait Transport: AsyncRead + AsyncWrite + Send + Unpin + 'static {}

impl<T> Transport for T where T: AsyncRead + AsyncWrite + Send + Unpin + 'static {}

/// Idle connections by key (`host:port` for TCP). Clones share the pool.
#[derive(Clone, Debug)]
pub struct Pool {
    inner: Arc<PoolInner>,
}

impl Pool {
    pub fn new(config: PoolConfig) -> Self {
        let stop_reaper = tokio_util::sync::CancellationToken::new();
        Self {
            inner: Arc::new(PoolInner {
                config,
                idle: Mutex::new(HashMap::default()),
                reaper: AtomicBool::new(false),
                _stop_reaper: stop_reaper.clone().drop_guard(),
                stop_reaper,
            }),
        }
    }

    /// Sends `req` (absolute `http://` URI) over TCP and returns the response, whose body
    /// reads from the connection.
    pub fn send<B: RequestBody>(
        &self,
        req: Request<B>,
    ) -> impl Future<Output = Result<Response<PooledBody>, PoolError>> + Send + '_ {
        self.send_as(req, None)
    }

    /// [`Pool::send`] with the body made into a `T` (no other future wraps this one to do it),
    /// and the response head due by `deadline` if one is given ([`Prepared::within`]).
    ///
    /// The request is encoded before the future is made: the future holds the encoded bytes,
    /// not the request.
    pub fn send_as<B, T>(
        &self,
        req: Request<B>,
        deadline: Option<Instant>,
    ) -> impl Future<Output = Result<Response<T>, PoolError>> + Send + '_
    where
        B: RequestBody,
        T: From<PooledBody>,
    {
        let ready = match req.uri().authority().cloned() {
            Some(authority) => Prepared::new(req).map(|prepared| {
                let prepared = match deadline {
                    Some(deadline) => prepared.within(deadline),
                    None => prepared,
                };
                (authority, prepared)
            }),
            None => Err(PoolError::new(
                PoolErrorKind::Connect,
                "the model instance has an invalid address",
            )),
        };
        async move {
            let (authority, prepared) = ready?;
            let resp = self
                .send_keyed(authority.as_str(), None, prepared, || {
                    self.connect(&authority)
                })
                .await?;
            Ok(resp.map(T::from))
        }
    }

    /// Sends `prepared` on `first` if given, else on an idle connection of `key`, else on one
    /// `connect` makes. A request that could not be written at all on a reused connection goes
    /// to the next (idle or new) one, and only then.
    pub async fn send_keyed<B, C, F, E>(
        &self,
        key: &str,
        first: Option<Connection>,
        mut prepared: Prepared<B>,
        mut connect: C,
    ) -> Result<Response<PooledBody>, E>
    where
        B: RequestBody,
        C: FnMut() -> F,
        F: Future<Output = Result<Connection, E>>,
        E: From<PoolError>,
    {
        let mut next = first;
        loop {
            let mut conn = match next.take().or_else(|| self.checkout(key)) {
                Some(conn) => conn.0,
                None => match prepared.deadline {
                    Some(deadline) => {
                        tokio::time::timeout_at(deadline, connect())
                            .await
                            .map_err(|_| first_byte_timeout())??
                            .0
                    }
                    None => connect().await?.0,
                },
            };
            prepared.scanned = 0;
            match poll_fn(|cx| prepared.poll(cx, &mut conn)).await {
                Ok(head) => {
                    // A body cut short by an early answer leaves the connection unusable.
                    let keep_alive =
                        head.keep_alive && prepared.body_done && prepared.out.is_empty();
                    conn.reused = true;
                    let body = PooledBody::new(
                        conn,
                        Arc::downgrade(&self.inner),
                        head.framing,
                        keep_alive,
                    );
                    return Ok(head.response.map(|()| body));
                }
                Err(ExchangeError::Unsent(_)) if conn.reused => {}
                Err(ExchangeError::Unsent(e)) => {
                    return Err(PoolError::new(
                        PoolErrorKind::Protocol,
                        "the model instance closed a new connection before the request was sent",
                    )
                    .with_cause(e)
                    .into());
                }
                Err(ExchangeError::Failed(e)) => {
                    return Err(PoolError::new(
                        PoolErrorKind::Protocol,
                        "the model instance failed before answering",
                    )
                    .with_cause(e)
                    .into());
                }
                Err(ExchangeError::Body(e)) => return Err(body_failed(e).into()),
                Err(ExchangeError::TimedOut) => return Err(first_byte_timeout().into()),
            }
        }
    }

    /// The most recently used idle connection of `key` that has not timed out and is still
    /// usable.
    pub fn checkout(&self, key: &str) -> Option<Connection> {
        self.inner.checkout(key).map(Connection)
    }

    async fn connect(&self, authority: &Authority) -> Result<Connection, PoolError> {
        let io = dial_tcp(authority, 80, self.inner.config.connect_timeout).await?;
        Ok(Connection::new(io, authority.as_str(), Bytes::new()))
    }

    /// Idle connections (for tests).
    #[cfg(test)]
    fn idle_count(&self) -> usize {
        self.inner.lock().values().map(Vec::len).sum()
    }
}
