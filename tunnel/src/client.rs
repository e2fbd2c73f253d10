//! The worker end: dials the server, authenticates, serves every stream the server opens, and
//! reconnects with full-jitter exponential backoff.
//!
//! Given several server URLs (servers sharing one database), each attempt after a failure or a
//! session that ended dials the next one, so a worker whose server died comes up on another.
//!
//! The worker listens on no port for this: the one connection is outbound. Each session's
//! tasks (the yamux driver and one task per stream) end with the session, before the next one
//! starts, so reconnect loops cannot leak.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::{Buf as _, BytesMut};
use rustls::pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt as _};
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_tungstenite::tungstenite::handshake::client::generate_key;
use tokio_tungstenite::tungstenite::handshake::derive_accept_key;
use tokio_util::either::Either;
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;

use crate::error::TunnelError;
use crate::http::StreamHandler;
use crate::mux::{self, MuxConfig, Role};
use crate::protocol::{SUBPROTOCOL, connect_url};
use crate::ws_io::{Endpoint, Liveness, MoveSignal, WsIo};
use net::backoff::Backoff;

/// Worker-side settings.
#[derive(Clone, Debug)]
pub struct TunnelClientConfig {
    /// The server URLs (`http(s)://host:port`; `/connect` is added), tried in turn: the first
    /// at start, the next one after every failed attempt or ended session.
    pub server_urls: Vec<String>,
    /// The worker's own token.
    pub token: String,
    pub liveness: Liveness,
    /// Shortest ceiling of the reconnect delay (the first retry waits up to this long).
    pub backoff_min: Duration,
    /// Longest ceiling of the reconnect delay.
    pub backoff_max: Duration,
    /// Ceiling of the delay after the server refused the token (401/403): retrying at once
    /// will not help, and an operator may fix the token meanwhile.
    pub refused_backoff: Duration,
    /// A session that stayed up this long resets the backoff.
    pub stable_after: Duration,
    /// TCP connect, TLS and WebSocket handshake together.
    pub handshake_timeout: Duration,
    /// For `https`/`wss` server URLs: the TLS client settings (which server certificates to
    /// trust; no ALPN: the handshake is HTTP/1.1).
    pub tls: Option<Arc<rustls::ClientConfig>>,
    pub mux: MuxConfig,
}

impl TunnelClientConfig {
    /// One server URL and the defaults.
    pub fn new(server_url: impl Into<String>, token: impl Into<String>) -> Self {
        Self::with_urls([server_url], token)
    }

    /// Several server URLs (servers sharing one database), tried in turn, and the defaults.
    pub fn with_urls<U: Into<String>>(
        server_urls: impl IntoIterator<Item = U>,
        token: impl Into<String>,
    ) -> Self {
        Self {
            server_urls: server_urls.into_iter().map(Into::into).collect(),
            token: token.into(),
            liveness: Liveness::default(),
            backoff_min: Duration::from_millis(100),
            backoff_max: Duration::from_secs(2),
            refused_backoff: Duration::from_secs(30),
            stable_after: Duration::from_secs(5),
            handshake_timeout: Duration::from_secs(10),
            tls: None,
            mux: MuxConfig::default(),
        }
    }
}

/// The tunnel's state as seen from the worker.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TunnelStatus {
    /// Whether a tunnel is up now.
    pub connected: bool,
    /// Tunnels established so far.
    pub connects: u64,
    /// Why the last attempt or session failed.
    pub last_error: Option<String>,
    /// The tunnel URL of the tunnel up now, or of the last one; `None` before the first.
    pub url: Option<String>,
}

/// The worker end of the tunnel.
#[derive(Debug)]
pub struct TunnelClient {
    config: TunnelClientConfig,
    /// The tunnel URLs, in the order of `config.server_urls`.
    urls: Vec<http::Uri>,
    /// Index in `urls` of the current (or last) attempt.
    current: AtomicUsize,
    status: watch::Sender<TunnelStatus>,
    leaving: Leaving,
}

/// A worker's way out of its tunnel: [`Leaving::go_away`] tells the server to open no more
/// streams while the open ones go on; the session ends when `shutdown` fires (the worker waits
/// for what it relays first) and no new one is dialled. Cheap to clone.
#[derive(Clone, Debug, Default)]
pub struct Leaving {
    token: CancellationToken,
    open: Arc<AtomicUsize>,
}

impl Leaving {
    /// Starts leaving (see [`MuxHandle::go_away`](crate::mux::MuxHandle::go_away)).
    pub fn go_away(&self) {
        self.token.cancel();
    }

    /// Whether leaving started.
    pub fn is_leaving(&self) -> bool {
        self.token.is_cancelled()
    }

    /// Streams the server opened that are still being served (each a relayed connection).
    pub fn open_streams(&self) -> usize {
        self.open.load(Ordering::Relaxed)
    }
}

/// The TLS variant is boxed: a plain tunnel then does not carry a TLS connection's worth of
/// space in every task that holds its stream.
type Transport = Either<TcpStream, Box<tokio_rustls::client::TlsStream<TcpStream>>>;

impl TunnelClient {
    /// Checks every URL (and that a `wss` one has TLS settings); at least one is needed.
    pub fn new(config: TunnelClientConfig) -> Result<Self, TunnelError> {
        if config.server_urls.is_empty() {
            return Err(TunnelError::InvalidUrl {
                url: String::new(),
                reason: "no server URL given",
            });
        }
        let mut urls = Vec::with_capacity(config.server_urls.len());
        for server_url in &config.server_urls {
            let url = connect_url(server_url)?;
            if url.scheme_str() == Some("wss") && config.tls.is_none() {
                return Err(TunnelError::Tls(format!(
                    "{server_url}: an https/wss server URL needs TLS settings (a CA bundle)"
                )));
            }
            urls.push(url);
        }
        Ok(Self {
            config,
            urls,
            current: AtomicUsize::new(0),
            status: watch::Sender::new(TunnelStatus::default()),
            leaving: Leaving::default(),
        })
    }

    /// The handle that makes this client leave, and counts its open streams.
    pub fn leaving(&self) -> Leaving {
        self.leaving.clone()
    }

    /// The tunnel URL dialled or served now, or the next one to dial while waiting to retry;
    /// the first one before any attempt.
    pub fn url(&self) -> &http::Uri {
        &self.urls[self.current.load(Ordering::Relaxed)]
    }

    /// Every tunnel URL, in the order they are tried.
    pub fn urls(&self) -> &[http::Uri] {
        &self.urls
    }

    /// Moves the next attempt to the next URL.
    fn move_on(&self) {
        let next = (self.current.load(Ordering::Relaxed) + 1) % self.urls.len();
        self.current.store(next, Ordering::Relaxed);
    }

    /// Watches the tunnel's status.
    pub fn status(&self) -> watch::Receiver<TunnelStatus> {
        self.status.subscribe()
    }

    /// Keeps a tunnel up until `shutdown` fires, serving each stream the server opens with
    /// `handler` (see [`crate::http::HttpHandler`] for a hyper service such as the worker
    /// proxy). Returns once every session's tasks have ended; after [`Leaving::go_away`]
    /// the session serves on until `shutdown` (or its end), and no new one is dialled.
    ///
    /// A server that is stopping asks its workers to move ([`crate::ws_io::MoveSignal`]):
    /// with another server to go to, the worker dials it at once while the old tunnel serves
    /// on; once the new one is up, the old one goes away after [`MOVE_SETTLE`] and ends when
    /// its last stream has (make before break: no request meets a closed tunnel).
    pub async fn run<H: StreamHandler>(&self, shutdown: CancellationToken, handler: H) {
        let handler = Arc::new(handler);
        let mut backoff = Backoff::new(self.config.backoff_min, self.config.backoff_max);
        let mut refused = Backoff::new(self.config.refused_backoff, self.config.refused_backoff);
        let leaving = self.leaving.token.clone();
        // Sessions the server asked this worker to leave, serving on; and the tokens that
        // send them away once the next session is up.
        let mut moving: JoinSet<()> = JoinSet::new();
        let mut to_retire: Vec<CancellationToken> = Vec::new();
        while !shutdown.is_cancelled() && !leaving.is_cancelled() {
            let url = self.url().clone();
            // The handshake's state (TLS, HTTP) lives on the heap only while it runs, not in
            // this long-lived future.
            let attempt = tokio::select! {
                () = shutdown.cancelled() => break,
                () = leaving.cancelled() => break,
                r = Box::pin(self.connect(&url)) => r,
            };
            let delay = match attempt {
                Ok(upgraded) => {
                    let started = Instant::now();
                    let (mux, span, asked) = self.start_session(upgraded, &url);
                    self.status.send_modify(|s| {
                        s.connected = true;
                        s.connects += 1;
                        s.last_error = None;
                        s.url = Some(url.to_string());
                    });
                    tracing::info!(parent: &span, "tunnel up");
                    for retire in to_retire.drain(..) {
                        retire.cancel();
                    }
                    let retire = CancellationToken::new();
                    let mut session = Box::pin(serve(
                        mux,
                        span.clone(),
                        shutdown.clone(),
                        handler.clone(),
                        self.leaving.clone(),
                        retire.clone(),
                    ));
                    let result = tokio::select! {
                        result = &mut session => Some(result),
                        () = asked.cancelled(), if self.urls.len() > 1 => None,
                    };
                    let Some(result) = result else {
                        tracing::info!(
                            parent: &span,
                            "the server asked this worker to move: dialling the next server \
                             while this tunnel serves on"
                        );
                        moving.spawn(async move {
                            if let Err(e) = session.await {
                                tracing::info!(error = %e, "left tunnel down");
                            }
                        });
                        to_retire.push(retire);
                        self.move_on();
                        continue;
                    };
                    if let Err(e) = &result {
                        tracing::info!(%url, error = %e, "tunnel down");
                    }
                    self.status.send_modify(|s| {
                        s.connected = false;
                        s.last_error = result.err().map(|e| e.to_string());
                    });
                    if started.elapsed() >= self.config.stable_after {
                        backoff.reset();
                    }
                    backoff.next_delay()
                }
                Err(e) => {
                    let delay = if e.is_auth_failure() {
                        refused.next_delay().max(self.config.refused_backoff / 2)
                    } else {
                        backoff.next_delay()
                    };
                    // Each cause is said once (at its first failure); repeats go to debug.
                    let why = e.to_string();
                    let repeated = self.status.borrow().last_error.as_deref() == Some(why.as_str());
                    if repeated {
                        tracing::debug!(%url, error = %e, retry_in = ?delay, "tunnel connect failed again");
                    } else if e.is_auth_failure() {
                        tracing::error!(
                            %url, error = %e, retry_in = ?delay,
                            "the server refused the worker token (revoked, or the worker was \
                             deleted): retrying will not help; retrying slowly"
                        );
                    } else {
                        tracing::warn!(%url, error = %e, retry_in = ?delay, "tunnel connect failed; retrying");
                    }
                    self.status
                        .send_modify(|s| s.last_error = Some(e.to_string()));
                    delay
                }
            };
            // Servers sharing a database all take the worker: the next attempt tries another.
            self.move_on();
            tokio::select! {
                () = shutdown.cancelled() => break,
                () = leaving.cancelled() => break,
                () = tokio::time::sleep(delay) => {}
            }
        }
        // The sessions being left end with their streams (or at `shutdown`).
        while moving.join_next().await.is_some() {}
    }

    /// Dials and performs the WebSocket handshake, within the handshake timeout.
    async fn connect(&self, url: &http::Uri) -> Result<(Transport, BytesMut), TunnelError> {
        tokio::time::timeout(self.config.handshake_timeout, self.connect_inner(url))
            .await
            .map_err(|_| TunnelError::HandshakeTimeout)?
    }

    async fn connect_inner(&self, url: &http::Uri) -> Result<(Transport, BytesMut), TunnelError> {
        let bad = |reason| TunnelError::InvalidUrl {
            url: url.to_string(),
            reason,
        };
        let host = url.host().ok_or_else(|| bad("missing host"))?;
        let secure = url.scheme_str() == Some("wss");
        let port = url.port_u16().unwrap_or(if secure { 443 } else { 80 });
        let bare_host = host.trim_start_matches('[').trim_end_matches(']');
        let tcp = TcpStream::connect((bare_host, port)).await?;
        let _ = tcp.set_nodelay(true);
        let mut transport: Transport = match (&self.config.tls, secure) {
            (Some(tls), true) => {
                let name = ServerName::try_from(bare_host.to_owned())
                    .map_err(|e| TunnelError::Tls(e.to_string()))?;
                let tls = tokio_rustls::TlsConnector::from(tls.clone())
                    .connect(name, tcp)
                    .await
                    .map_err(|e| TunnelError::Tls(e.to_string()))?;
                Either::Right(Box::new(tls))
            }
            _ => Either::Left(tcp),
        };
        let read_ahead = upgrade(&mut transport, url, &self.config.token).await?;
        Ok((transport, read_ahead))
    }

    /// Starts the connection task of a new session.
    fn start_session(
        &self,
        (transport, read_ahead): (Transport, BytesMut),
        url: &http::Uri,
    ) -> (mux::Mux, tracing::Span, CancellationToken) {
        let session = self.status.borrow().connects + 1;
        let span = tracing::info_span!("tunnel", session, %url);
        let moves = MoveSignal::default();
        let io = WsIo::new(
            transport,
            Endpoint::Client,
            self.config.liveness,
            read_ahead,
        )
        .with_moves(moves.clone());
        let mux = mux::spawn(io, Role::Acceptor, &self.config.mux, span.clone());
        (mux, span, moves.asked())
    }
}

/// Serves one session until it ends or `shutdown` fires; its tasks have all ended when this
/// returns. After `leaving` (the worker stops) or `retire` (it moved to another server, plus
/// [`MOVE_SETTLE`]) the session goes away: the server opens no more streams on it; a retired
/// one then ends with its last stream.
async fn serve<H: StreamHandler>(
    mut mux: mux::Mux,
    span: tracing::Span,
    shutdown: CancellationToken,
    handler: Arc<H>,
    leaving: Leaving,
    retire: CancellationToken,
) -> Result<(), TunnelError> {
    let mut streams = JoinSet::new();
    // Streams of this session counted in `leaving.open` (every session's add up there).
    let mut counted = 0;
    // Held until the connection ends: dropping it would reset it, which the server ignores.
    let mut signal = None;
    // When a retired session goes away (`retire` plus MOVE_SETTLE).
    let mut settle: Option<Instant> = None;
    let mut retired = false;
    loop {
        let open = streams.len();
        if open > counted {
            leaving.open.fetch_add(open - counted, Ordering::Relaxed);
        } else {
            leaving.open.fetch_sub(counted - open, Ordering::Relaxed);
        }
        counted = open;
        if retired && signal.is_some() && streams.is_empty() {
            tracing::info!(parent: &span, "left for the new tunnel: closing this one");
            break;
        }
        if (leaving.token.is_cancelled() || retired) && signal.is_none() {
            match tokio::time::timeout(GO_AWAY_TIMEOUT, mux.handle.go_away()).await {
                Ok(Ok(stream)) => {
                    tracing::info!(parent: &span, open = streams.len(), "going away: the server opens no more streams");
                    signal = Some(stream);
                }
                Ok(Err(e)) => {
                    tracing::info!(parent: &span, error = %e, "going away: the tunnel is gone");
                    break;
                }
                Err(_) => {
                    tracing::info!(parent: &span, "going away: the tunnel does not take the signal");
                    break;
                }
            }
            continue;
        }
        tokio::select! {
            () = shutdown.cancelled() => {
                mux.handle.close();
                break;
            }
            () = leaving.token.cancelled(), if signal.is_none() => continue,
            () = retire.cancelled(), if settle.is_none() => {
                // The gateways learn of the new tunnel meanwhile, and send there.
                settle = Some(Instant::now() + MOVE_SETTLE);
            }
            () = until(settle), if settle.is_some() && !retired => retired = true,
            inbound = mux.inbound.recv() => {
                let Some(inbound) = inbound else { break };
                let handler = handler.clone();
                streams.spawn(
                    async move {
                        match inbound.accept().await {
                            Ok(stream) => handler.handle(stream).await,
                            Err(e) => tracing::debug!(error = %e, "stream closed before use"),
                        }
                    }
                    .instrument(span.clone()),
                );
            }
            Some(_) = streams.join_next(), if !streams.is_empty() => {}
        }
    }
    // The connection is gone (or going): stop every stream task with it.
    mux.handle.close();
    streams.shutdown().await;
    leaving.open.fetch_sub(counted, Ordering::Relaxed);
    drop(signal);
    match mux.task.await {
        Ok(result) => result,
        Err(_) => Err(TunnelError::Closed),
    }
}

/// Sleeps until `at`; forever without one.
async fn until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// How long a worker that moved keeps sending on its old tunnel once the new one is up, for
/// the gateways to learn where its tunnel is now, before it goes away there.
pub const MOVE_SETTLE: Duration = Duration::from_secs(1);

/// How long the go-away signal may take to leave (a stalled tunnel is closed instead).
const GO_AWAY_TIMEOUT: Duration = Duration::from_secs(5);

/// The longest handshake response head the worker reads.
const MAX_RESPONSE_HEAD: usize = 16 * 1024;
/// The most of a refusal's body the worker reads (and shows 512 bytes of).
const MAX_REFUSAL_BODY: usize = 4 * 1024;

/// Performs the WebSocket upgrade (RFC 6455 §4.1) on `io`: sends the request, reads and
/// checks the response. Returns the bytes read past the response head (the start of the
/// server's first frames), if any.
async fn upgrade<S>(io: &mut S, url: &http::Uri, token: &str) -> Result<BytesMut, TunnelError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let bearer = format!("Bearer {token}");
    if http::HeaderValue::from_str(&bearer).is_err() {
        return Err(TunnelError::Refused {
            status: 401,
            message: "the worker token is not a valid header value".into(),
        });
    }
    let authority = url.authority().map(|a| a.as_str()).unwrap_or_default();
    let path = url.path_and_query().map_or("/", |p| p.as_str());
    let key = generate_key();
    let request = format!(
        "GET {path} HTTP/1.1\r\nHost: {authority}\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\
         Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: {key}\r\n\
         Sec-WebSocket-Protocol: {SUBPROTOCOL}\r\nAuthorization: {bearer}\r\n\r\n"
    );
    io.write_all(request.as_bytes()).await?;
    io.flush().await?;

    let mut buf = BytesMut::with_capacity(1024);
    let head = loop {
        if tokio::io::AsyncReadExt::read_buf(io, &mut buf).await? == 0 {
            return Err(TunnelError::Handshake(
                "the server closed the connection during the handshake".into(),
            ));
        }
        match parse_response(&buf)? {
            Some(head) => break head,
            None if buf.len() >= MAX_RESPONSE_HEAD => {
                return Err(TunnelError::Handshake(
                    "the handshake response head is too long".into(),
                ));
            }
            None => {}
        }
    };
    buf.advance(head.size);
    if head.status != 101 {
        // A refusal: its (JSON) body says why.
        let want = head.content_length.unwrap_or(0).min(MAX_REFUSAL_BODY);
        while buf.len() < want {
            match tokio::io::AsyncReadExt::read_buf(io, &mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
        }
        let shown = buf
            .len()
            .min(head.content_length.unwrap_or(usize::MAX))
            .min(512);
        let body = &buf[..shown];
        return Err(TunnelError::Refused {
            status: head.status,
            message: String::from_utf8_lossy(body).into_owned(),
        });
    }
    verify(&head, &key)?;
    // Usually nothing: the handshake buffer is not kept for it.
    Ok(if buf.is_empty() {
        BytesMut::new()
    } else {
        BytesMut::from(&buf[..])
    })
}

/// Checks a `101` answer: an upgrade to a WebSocket, accepted for `key`, with the tunnel
/// subprotocol.
fn verify(head: &ResponseHead, key: &str) -> Result<(), TunnelError> {
    let failed = |what: &str| Err(TunnelError::Handshake(what.to_owned()));
    if !head.upgrade_websocket || !head.connection_upgrade {
        return failed("the server did not upgrade the connection to a WebSocket");
    }
    if head.accept.as_deref() != Some(derive_accept_key(key.as_bytes()).as_str()) {
        return failed("the server's Sec-WebSocket-Accept does not match the key");
    }
    if head.protocol.as_deref() != Some(SUBPROTOCOL) {
        return failed("the server did not select the tunnel subprotocol");
    }
    Ok(())
}

/// The worker's verdict on the handshake answer in `bytes` for the request that sent `key`:
/// `Ok(None)` while its head is incomplete, the head's size for an accepted upgrade, else why
/// not (a refusal's body is not read here). Public only for fuzzing.
#[doc(hidden)]
pub fn check_answer(bytes: &[u8], key: &str) -> Result<Option<usize>, TunnelError> {
    let Some(head) = parse_response(bytes)? else {
        return Ok(None);
    };
    if head.status != 101 {
        return Err(TunnelError::Refused {
            status: head.status,
            message: String::new(),
        });
    }
    verify(&head, key)?;
    Ok(Some(head.size))
}

/// What the worker needs from a handshake response head.
#[derive(Debug, Default, PartialEq, Eq)]
struct ResponseHead {
    /// Bytes of the head, the empty line included.
    size: usize,
    status: u16,
    content_length: Option<usize>,
    upgrade_websocket: bool,
    connection_upgrade: bool,
    accept: Option<String>,
    protocol: Option<String>,
}

/// Parses a response head; `None` while it is incomplete.
fn parse_response(bytes: &[u8]) -> Result<Option<ResponseHead>, TunnelError> {
    let mut headers = [httparse::EMPTY_HEADER; 32];
    let mut response = httparse::Response::new(&mut headers);
    let size = match response.parse(bytes) {
        Ok(httparse::Status::Complete(size)) => size,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(e) => {
            return Err(TunnelError::Handshake(format!(
                "malformed handshake response: {e}"
            )));
        }
    };
    let mut head = ResponseHead {
        size,
        status: response.code.unwrap_or_default(),
        ..ResponseHead::default()
    };
    for header in response.headers.iter() {
        let value = String::from_utf8_lossy(header.value);
        let value = value.trim();
        let name = header.name;
        if name.eq_ignore_ascii_case("content-length") {
            head.content_length = value.parse().ok();
        } else if name.eq_ignore_ascii_case("upgrade") {
            head.upgrade_websocket |= value.eq_ignore_ascii_case("websocket");
        } else if name.eq_ignore_ascii_case("connection") {
            head.connection_upgrade |= value
                .split(',')
                .any(|t| t.trim().eq_ignore_ascii_case("upgrade"));
        } else if name.eq_ignore_ascii_case("sec-websocket-accept") {
            head.accept = Some(value.to_owned());
        } else if name.eq_ignore_ascii_case("sec-websocket-protocol") {
            head.protocol = Some(value.to_owned());
        }
    }
    Ok(Some(head))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_url_is_checked_and_named() {
        let new = |urls: &[&str]| {
            TunnelClient::new(TunnelClientConfig::with_urls(urls.iter().copied(), "t"))
        };
        let client = new(&["http://a:1", "ws://b:2/"]).unwrap();
        let urls: Vec<String> = client.urls().iter().map(ToString::to_string).collect();
        assert_eq!(urls, ["ws://a:1/connect", "ws://b:2/connect"]);
        assert_eq!(client.url().to_string(), "ws://a:1/connect");
        client.move_on();
        assert_eq!(client.url().to_string(), "ws://b:2/connect");
        client.move_on();
        assert_eq!(client.url().to_string(), "ws://a:1/connect");

        let err = new(&["http://a:1", "ftp://b"]).unwrap_err().to_string();
        assert!(err.contains("ftp://b"), "{err}");
        let err = new(&["http://a:1", "https://b:2"]).unwrap_err().to_string();
        assert!(err.contains("https://b:2") && err.contains("TLS"), "{err}");
        assert!(new(&[]).is_err());
    }

    #[test]
    fn parses_handshake_responses() {
        let ok = b"HTTP/1.1 101 Switching Protocols\r\nconnection: upgrade\r\nUpgrade: WebSocket\r\n\
                   sec-websocket-accept: abc=\r\nSec-WebSocket-Protocol: faden-tunnel.v1\r\n\r\n\x82\x00";
        assert_eq!(parse_response(&ok[..20]).ok(), Some(None));
        let head = parse_response(ok).ok().flatten().unwrap_or_default();
        assert_eq!(head.status, 101);
        assert_eq!(head.size, ok.len() - 2);
        assert!(head.upgrade_websocket && head.connection_upgrade);
        assert_eq!(head.accept.as_deref(), Some("abc="));
        assert_eq!(head.protocol.as_deref(), Some(SUBPROTOCOL));

        let refused = b"HTTP/1.1 401 Unauthorized\r\ncontent-length: 2\r\n\r\n{}";
        let head = parse_response(refused).ok().flatten().unwrap_or_default();
        assert_eq!((head.status, head.content_length), (401, Some(2)));
        assert!(parse_response(b"SSH-2.0-OpenSSH\r\n\r\n").is_err());
    }
}
