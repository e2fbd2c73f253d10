//! One way to reach what a tunnel worker serves, whichever dialect its tunnel speaks.
//!
//! A route through a tunnel is data: a worker and a [`Target`] on it (its reverse proxy, or a
//! model instance). [`Connector::open`] returns a byte stream to the target:
//! - a faden worker (`faden-tunnel.v1`): a yamux stream to its proxy; for an instance, the same
//!   stream after `CONNECT model-<m>-<i>.static:0` (with the worker credential), which the
//!   worker's proxy turns into a byte relay to the instance (or refuses with an answer of its
//!   own, passed back as [`Opened::Answered`]);
//! - a GPUStack worker (its own tunnel client): a session its client dials to
//!   `<worker ip>:<instance port>` (a GPUStack worker has no faden proxy to reach).
//!
//! [`Connector::send`] sends a request to the target on kept-alive streams in a [`net::pool`],
//! keyed by worker and target: the gateway's tunnel transport and the proxy port both send
//! through it, and a stream carries request after request with no HTTP work on the worker.

use std::collections::hash_map::RandomState;
use std::hash::BuildHasher as _;
use std::net::IpAddr;

use bytes::Bytes;
use http::{HeaderValue, Method, Request, Response, StatusCode, Uri, header};
use http_body_util::{Either, Empty};
use hyper::body::Incoming;
use hyper::upgrade::Upgraded;
use hyper_util::rt::TokioIo;
use net::pool::{Connection, Pool, PoolConfig, PoolError, PooledBody, Prepared, RequestBody};
use net::relay::{RelayIo, with_read_ahead};

use crate::TunnelError;
use crate::gpustack_link::GpuStackStream;
use crate::mux::TunnelStream;
use crate::server::TunnelServer;
use crate::target::relay_target;

/// What a stream reaches on a worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// The worker's reverse proxy (faden workers only).
    Proxy,
    /// A model instance.
    Instance(Instance),
}

/// A model instance as a route names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Instance {
    /// The instance's model and its own id: the name a faden worker's proxy relays to.
    pub model: i64,
    pub id: i64,
    /// Where it listens on its worker: what a GPUStack worker's tunnel client dials.
    pub port: u16,
    /// The worker's IP, when the caller knows it; else the worker's registered address.
    pub ip: Option<IpAddr>,
}

/// Why no stream reached the target.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// The worker has no tunnel here, or its tunnel did not open a stream or session.
    #[error("the worker's tunnel is not available")]
    Tunnel(#[source] TunnelError),
    /// The worker is going away: its tunnel takes no new streams, nothing was sent.
    #[error("the worker is going away: its tunnel takes no new streams")]
    GoingAway,
    /// A GPUStack worker's tunnel dials addresses: its worker's address must be an IP.
    #[error("the worker's address is not an IP: its GPUStack tunnel cannot dial it")]
    NoAddress,
    /// A GPUStack worker has no faden reverse proxy.
    #[error("the worker's GPUStack tunnel reaches its instances only")]
    NoProxy,
    /// The worker's proxy did not answer the relay request.
    #[error("the worker did not answer the relay request")]
    Relay(#[source] hyper::Error),
    /// The worker's proxy refused a relay for a request on its way (404, 502, 401…).
    #[error("the worker refused the relay to the instance ({0})")]
    Refused(StatusCode),
    /// The exchange on the stream failed.
    #[error(transparent)]
    Pool(#[from] PoolError),
}

/// A stream to a target.
#[derive(Debug)]
pub enum Stream {
    /// A yamux stream, and what the relay's answer carried past its head.
    Mux {
        stream: TunnelStream,
        read_ahead: Bytes,
    },
    /// A GPUStack tunnel's session.
    Session(GpuStackStream),
    /// An IO hyper kept after the relay request (not expected: the relay request is sent on
    /// the stream itself).
    Upgraded(Upgraded),
}

impl Stream {
    /// The stream as a relay's far end.
    pub fn into_relay_io(self) -> Box<dyn RelayIo> {
        match self {
            Stream::Mux { stream, read_ahead } => with_read_ahead(stream, read_ahead),
            Stream::Session(session) => Box::new(session),
            Stream::Upgraded(upgraded) => Box::new(TokioIo::new(upgraded)),
        }
    }

    /// The stream as a pooled HTTP/1.1 connection under `key`.
    fn into_connection(self, key: &str) -> Connection {
        match self {
            Stream::Mux { stream, read_ahead } => Connection::new(stream, key, read_ahead),
            Stream::Session(session) => Connection::new(session, key, Bytes::new()),
            Stream::Upgraded(upgraded) => {
                Connection::new(TokioIo::new(upgraded), key, Bytes::new())
            }
        }
    }
}

/// What opening a stream came to.
#[derive(Debug)]
pub enum Opened {
    Stream(Stream),
    /// The worker proxy's own answer to the relay request (404 marked no-such-instance, 502
    /// when the instance did not accept, 401, 429), as it gave it.
    Answered(Response<Incoming>),
}

/// An answer from the target, or the worker proxy's refusal of the relay.
pub type Answer = Response<Either<PooledBody, Incoming>>;

/// Opens streams to tunnel workers' targets and sends requests on kept-alive ones. Cheap to
/// clone; clones share the pool.
#[derive(Clone, Debug)]
pub struct Connector {
    server: TunnelServer,
    pool: Pool,
    /// Keys streams by the credential their relay was opened with, unguessably: a stream the
    /// worker's proxy let through for one credential never carries a request that came with
    /// another.
    credentials: RandomState,
}

impl Connector {
    /// Streams through `server`'s tunnels; idle kept-alive ones by `pool`'s settings (keep the
    /// idle timeout below the engines' own keep-alive, uvicorn's 5 s).
    pub fn new(server: TunnelServer, pool: PoolConfig) -> Self {
        Self {
            server,
            pool: Pool::new(pool),
            credentials: RandomState::new(),
        }
    }

    /// The tunnels this connector goes through.
    pub fn server(&self) -> &TunnelServer {
        &self.server
    }

    /// A stream to `target` on `worker`'s tunnel; `credential` goes on a faden worker's relay
    /// request (its proxy checks it), and nowhere else.
    pub async fn open(
        &self,
        worker: i64,
        target: Target,
        credential: Option<&HeaderValue>,
    ) -> Result<Opened, ConnectError> {
        if let Some(stream) = self.open_session(worker, target).await? {
            return Ok(Opened::Stream(Stream::Session(stream)));
        }
        let stream = self.server.open_stream(worker).await.map_err(|e| match e {
            TunnelError::GoingAway => ConnectError::GoingAway,
            e => ConnectError::Tunnel(e),
        })?;
        let Target::Instance(instance) = target else {
            return Ok(Opened::Stream(Stream::Mux {
                stream,
                read_ahead: Bytes::new(),
            }));
        };
        relay(stream, instance, credential).await
    }

    /// Sends `request` (origin-form, its `Host` set) to `target` on `worker`'s tunnel, on an
    /// idle kept-alive stream when there is one; its response head due by the request's
    /// deadline ([`Prepared::within`]). The worker proxy's refusal of a new relay comes back
    /// as its answer (no byte of the request went out).
    pub async fn send<B: RequestBody>(
        &self,
        worker: i64,
        target: Target,
        request: Prepared<B>,
        credential: Option<&HeaderValue>,
    ) -> Result<Answer, ConnectError> {
        let key = self.pool_key(worker, target, credential);
        // A refusal is kept for the caller: the request went nowhere yet.
        let refused = parking_lot::Mutex::new(None);
        let connect = || async {
            match self.open(worker, target, credential).await? {
                Opened::Stream(stream) => Ok(stream.into_connection(&key)),
                Opened::Answered(answer) => {
                    let status = answer.status();
                    *refused.lock() = Some(answer);
                    Err(ConnectError::Refused(status))
                }
            }
        };
        match self.pool.send_keyed(&key, None, request, connect).await {
            Ok(answer) => Ok(answer.map(Either::Left)),
            Err(ConnectError::Refused(status)) => match refused.lock().take() {
                Some(answer) => Ok(answer.map(Either::Right)),
                None => Err(ConnectError::Refused(status)),
            },
            Err(e) => Err(e),
        }
    }

    /// Pool key of the kept-alive streams to `target` on `worker` opened with `credential`.
    fn pool_key(&self, worker: i64, target: Target, credential: Option<&HeaderValue>) -> String {
        let credential = credential.map_or(0, |c| self.credentials.hash_one(c.as_bytes()));
        match target {
            Target::Proxy => format!("{worker}/proxy/{credential:x}"),
            // A GPUStack session dials the port, a faden relay names the instance: both are one
            // instance's, whose port does not change while its id stays.
            Target::Instance(i) => format!("{worker}/{}/{}/{credential:x}", i.id, i.port),
        }
    }

    /// A GPUStack worker's session to an instance (`None` for a faden worker).
    async fn open_session(
        &self,
        worker: i64,
        target: Target,
    ) -> Result<Option<GpuStackStream>, ConnectError> {
        if self.server.dialect(worker) != Some(crate::Dialect::GpuStack) {
            return Ok(None);
        }
        let Target::Instance(instance) = target else {
            return Err(ConnectError::NoProxy);
        };
        let ip = instance
            .ip
            .or_else(|| self.server.address(worker)?.host.parse().ok())
            .ok_or(ConnectError::NoAddress)?;
        let session = self.server.open_session(worker, ip, instance.port).await;
        session.map(Some).map_err(ConnectError::Tunnel)
    }
}

/// `Host` as a faden worker's proxy sends it to an instance: `127.0.0.1:<port>` (the port left
/// out when it is 80, or unknown).
pub fn engine_host(port: u16) -> HeaderValue {
    match port {
        0 | 80 => HeaderValue::from_static("127.0.0.1"),
        port => HeaderValue::try_from(format!("127.0.0.1:{port}"))
            .unwrap_or_else(|_| HeaderValue::from_static("127.0.0.1")),
    }
}

/// `CONNECT model-<m>-<i>.static:0` on a new stream to a faden worker's proxy: 200 gives the
/// stream back as a relay to the instance; any other answer is the proxy's refusal.
async fn relay(
    stream: TunnelStream,
    instance: Instance,
    credential: Option<&HeaderValue>,
) -> Result<Opened, ConnectError> {
    let target = relay_target(instance.model, instance.id);
    let mut request = Request::new(Empty::<Bytes>::new());
    *request.method_mut() = Method::CONNECT;
    if let Ok(host) = HeaderValue::from_str(&target) {
        request.headers_mut().insert(header::HOST, host);
    }
    *request.uri_mut() = Uri::try_from(target).map_err(|_| {
        ConnectError::Tunnel(TunnelError::Handshake("invalid instance name".to_owned()))
    })?;
    if let Some(credential) = credential {
        request
            .headers_mut()
            .insert(header::AUTHORIZATION, credential.clone());
    }
    let mut sender = crate::http::handshake(stream)
        .await
        .map_err(ConnectError::Relay)?;
    let response = sender
        .send_request(request)
        .await
        .map_err(ConnectError::Relay)?;
    if response.status() != StatusCode::OK {
        return Ok(Opened::Answered(response));
    }
    // The connection task hands the stream (and whatever it read past the answer) over.
    let upgraded = hyper::upgrade::on(response)
        .await
        .map_err(ConnectError::Relay)?;
    Ok(Opened::Stream(
        match upgraded.downcast::<TokioIo<TunnelStream>>() {
            Ok(parts) => Stream::Mux {
                stream: parts.io.into_inner(),
                read_ahead: parts.read_buf,
            },
            Err(upgraded) => Stream::Upgraded(upgraded),
        },
    ))
}

#[cfg(test)]
mod tests {
    #![allow(
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::panic,
        clippy::disallowed_methods
    )]

    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    use super::*;
    use crate::mux::tests::pair;

    /// After a `CONNECT`, the relay takes the tunnel stream out of hyper's `Upgraded`, with
    /// the bytes hyper read past the answer.
    #[tokio::test]
    async fn relayed_streams_are_taken_out_of_upgraded() {
        let (_mux, out, mut inc) = pair().await;
        let worker = tokio::spawn(async move {
            // A worker that answers and sends bytes right behind the answer, in one write.
            let head = testkit::raw::read_head(&mut inc).await;
            assert!(head.starts_with("CONNECT model-1-2.static:0 HTTP/1.1\r\n"));
            inc.write_all(b"HTTP/1.1 200 OK\r\n\r\nahead")
                .await
                .unwrap();
            let mut two = [0u8; 2];
            inc.read_exact(&mut two).await.unwrap();
            two
        });
        let instance = Instance {
            model: 1,
            id: 2,
            port: 8000,
            ip: None,
        };
        let Ok(Opened::Stream(Stream::Mux {
            mut stream,
            read_ahead,
        })) = relay(out, instance, None).await
        else {
            panic!("no relayed tunnel stream");
        };
        // What hyper read past the answer (here all of it, since the answer and the bytes
        // behind it came in one frame), then the stream itself.
        let mut got = read_ahead.to_vec();
        while got.len() < 5 {
            let mut more = [0u8; 5];
            let n = stream.read(&mut more).await.unwrap();
            assert!(n > 0, "the stream ended early");
            got.extend_from_slice(&more[..n]);
        }
        assert_eq!(got, b"ahead");
        stream.write_all(b"hi").await.unwrap();
        assert_eq!(&worker.await.unwrap(), b"hi");
    }

    #[test]
    fn engine_host_is_what_the_worker_proxy_sends() {
        assert_eq!(engine_host(40000), "127.0.0.1:40000");
        assert_eq!(engine_host(80), "127.0.0.1");
        assert_eq!(engine_host(0), "127.0.0.1");
    }
}
