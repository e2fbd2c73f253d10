//! The worker end: dials the server, authenticates, serves every stream the server opens, and
//! reconnects with full-jitter exponential backoff.
//!
//! The worker listens on no port for this: the one connection is outbound. Each session's
//! tasks (the yamux driver and one task per stream) end with the session, before the next one
//! starts, so reconnect loops cannot leak.

use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::ServerName;
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite;
use tokio_tungstenite::tungstenite::client::IntoClientRequest as _;
use tokio_util::either::Either;
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;

use crate::backoff::Backoff;
use crate::error::TunnelError;
use crate::http::StreamHandler;
use crate::mux::{self, MuxConfig, Role};
use crate::protocol::{SUBPROTOCOL, connect_url};
use crate::ws_io::{Liveness, WsIo, ws_config};

/// Worker-side settings.
#[derive(Clone, Debug)]
pub struct TunnelClientConfig {
    /// The server URL the worker registers with (`http(s)://host:port`); `/connect` is added.
    pub server_url: String,
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
    pub fn new(server_url: impl Into<String>, token: impl Into<String>) -> Self {
        Self {
            server_url: server_url.into(),
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
}

/// The worker end of the tunnel.
#[derive(Debug)]
pub struct TunnelClient {
    config: TunnelClientConfig,
    url: http::Uri,
    status: watch::Sender<TunnelStatus>,
}

/// The TLS variant is boxed: a plain tunnel then does not carry a TLS connection's worth of
/// space in every task that holds its stream.
type Transport = Either<TcpStream, Box<tokio_rustls::client::TlsStream<TcpStream>>>;

impl TunnelClient {
    /// Checks the URL (and that a `wss` URL has TLS settings).
    pub fn new(config: TunnelClientConfig) -> Result<Self, TunnelError> {
        let url = connect_url(&config.server_url)?;
        if url.scheme_str() == Some("wss") && config.tls.is_none() {
            return Err(TunnelError::Tls(
                "an https/wss server URL needs TLS settings (a CA bundle)".into(),
            ));
        }
        Ok(Self {
            config,
            url,
            status: watch::Sender::new(TunnelStatus::default()),
        })
    }

    /// The tunnel URL dialled.
    pub fn url(&self) -> &http::Uri {
        &self.url
    }

    /// Watches the tunnel's status.
    pub fn status(&self) -> watch::Receiver<TunnelStatus> {
        self.status.subscribe()
    }

    /// Keeps a tunnel up until `shutdown` fires, serving each stream the server opens with
    /// `handler` (see [`crate::http::HttpHandler`] for a hyper service such as the worker
    /// proxy). Returns once the last session's tasks have ended.
    pub async fn run<H: StreamHandler>(&self, shutdown: CancellationToken, handler: H) {
        let handler = Arc::new(handler);
        let mut backoff = Backoff::new(self.config.backoff_min, self.config.backoff_max);
        let mut refused = Backoff::new(self.config.refused_backoff, self.config.refused_backoff);
        while !shutdown.is_cancelled() {
            // The handshake's state (TLS, HTTP) lives on the heap only while it runs, not in
            // this long-lived future.
            let attempt = tokio::select! {
                () = shutdown.cancelled() => break,
                r = Box::pin(self.connect()) => r,
            };
            let delay = match attempt {
                Ok(ws) => {
                    let started = Instant::now();
                    let (mux, span) = self.start_session(ws);
                    let result = self.serve(mux, span, &shutdown, handler.clone()).await;
                    if let Err(e) = &result {
                        tracing::info!(error = %e, "tunnel down");
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
                        tracing::warn!(error = %e, "the server refused the worker token");
                        refused.next_delay().max(self.config.refused_backoff / 2)
                    } else {
                        tracing::debug!(error = %e, "tunnel connect failed");
                        backoff.next_delay()
                    };
                    self.status
                        .send_modify(|s| s.last_error = Some(e.to_string()));
                    delay
                }
            };
            tokio::select! {
                () = shutdown.cancelled() => break,
                () = tokio::time::sleep(delay) => {}
            }
        }
    }

    /// Dials and performs the WebSocket handshake, within the handshake timeout.
    async fn connect(&self) -> Result<WebSocketStream<Transport>, TunnelError> {
        tokio::time::timeout(self.config.handshake_timeout, self.connect_inner())
            .await
            .map_err(|_| TunnelError::HandshakeTimeout)?
    }

    async fn connect_inner(&self) -> Result<WebSocketStream<Transport>, TunnelError> {
        let bad = |reason| TunnelError::InvalidUrl {
            url: self.config.server_url.clone(),
            reason,
        };
        let host = self.url.host().ok_or_else(|| bad("missing host"))?;
        let secure = self.url.scheme_str() == Some("wss");
        let port = self.url.port_u16().unwrap_or(if secure { 443 } else { 80 });
        let bare_host = host.trim_start_matches('[').trim_end_matches(']');
        let tcp = TcpStream::connect((bare_host, port)).await?;
        let _ = tcp.set_nodelay(true);
        let transport: Transport = match (&self.config.tls, secure) {
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
        let mut request = (&self.url).into_client_request()?;
        let headers = request.headers_mut();
        let bearer = http::HeaderValue::from_str(&format!("Bearer {}", self.config.token))
            .map_err(|_| TunnelError::Refused {
                status: 401,
                message: "the worker token is not a valid header value".into(),
            })?;
        headers.insert(http::header::AUTHORIZATION, bearer);
        headers.insert(
            http::header::SEC_WEBSOCKET_PROTOCOL,
            http::HeaderValue::from_static(SUBPROTOCOL),
        );
        match tokio_tungstenite::client_async_with_config(request, transport, Some(ws_config()))
            .await
        {
            Ok((ws, _response)) => Ok(ws),
            Err(tungstenite::Error::Http(response)) => {
                let status = response.status().as_u16();
                let body = response.body().as_deref().unwrap_or_default();
                let message = String::from_utf8_lossy(&body[..body.len().min(512)]).into_owned();
                Err(TunnelError::Refused { status, message })
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Starts the connection task of a new session.
    fn start_session(&self, ws: WebSocketStream<Transport>) -> (mux::Mux, tracing::Span) {
        let session = self.status.borrow().connects + 1;
        let span = tracing::info_span!("tunnel", session);
        let io = WsIo::new(ws, self.config.liveness);
        let mux = mux::spawn(io, Role::Acceptor, &self.config.mux, span.clone());
        (mux, span)
    }

    /// Serves one session until it ends or `shutdown` fires; its tasks have all ended when
    /// this returns.
    async fn serve<H: StreamHandler>(
        &self,
        mut mux: mux::Mux,
        span: tracing::Span,
        shutdown: &CancellationToken,
        handler: Arc<H>,
    ) -> Result<(), TunnelError> {
        self.status.send_modify(|s| {
            s.connected = true;
            s.connects += 1;
            s.last_error = None;
        });
        tracing::info!(parent: &span, "tunnel up");
        let mut streams = JoinSet::new();
        loop {
            tokio::select! {
                () = shutdown.cancelled() => {
                    mux.handle.close();
                    break;
                }
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
        match mux.task.await {
            Ok(result) => result,
            Err(_) => Err(TunnelError::Closed),
        }
    }
}
