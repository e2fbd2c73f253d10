//! The server end of a GPUStack worker's tunnel: GPUStack's own dialect
//! ([`crate::gpustack_message`]) over one WebSocket, one session per relayed connection, which
//! the worker's tunnel client dials to the target it is asked for.
//!
//! GPUStack's protocol has no flow control per session: the worker sends a session's bytes as
//! fast as its engine produces them. One task reads the WebSocket and hands each session's bytes
//! to that session without waiting for it, so a slow reader never stalls the others; what it
//! holds is bounded instead. A session whose unread bytes would pass
//! [`GpuStackLinkConfig::session_buffer`], or whose bytes would take the tunnel's unread total
//! past [`GpuStackLinkConfig::tunnel_buffer`], ends at once: its reader gets an error, the
//! worker a `DISCONNECT`, and nothing else is affected. Writes towards the worker wait for room
//! in one bounded queue: the WebSocket's own pace.
//!
//! A message that cannot be read (not binary, not GPUStack's, a session it does not know that
//! is not ending anyway) closes this tunnel, and only it.

use std::collections::HashMap;
use std::io;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::Bytes;
use futures_util::{SinkExt as _, StreamExt as _};
use ipnet::IpNet;
use parking_lot::Mutex;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::Message as WsMessage;
use tokio_util::sync::{CancellationToken, PollSender};

use crate::error::TunnelError;
use crate::gpustack_message::{Message, SessionId};

/// Limits of one GPUStack tunnel.
#[derive(Clone, Debug)]
pub struct GpuStackLinkConfig {
    /// Sessions open at once; more are refused ([`TunnelError::TooManyStreams`]).
    pub max_sessions: usize,
    /// Unread bytes one session may hold before it ends with an error.
    pub session_buffer: usize,
    /// Unread bytes all sessions of the tunnel may hold together.
    pub tunnel_buffer: usize,
    /// Largest WebSocket message read (GPUStack's client sends at most 8 KiB of data per
    /// message).
    pub max_message: usize,
    /// Time for the worker to answer a connect request.
    pub connect_timeout: Duration,
    /// A ping goes out this often; a tunnel silent for three periods is dead.
    pub ping_interval: Duration,
}

impl Default for GpuStackLinkConfig {
    fn default() -> Self {
        Self {
            max_sessions: 4096,
            session_buffer: 1 << 20,
            tunnel_buffer: 64 << 20,
            max_message: 1 << 20,
            connect_timeout: Duration::from_secs(10),
            ping_interval: Duration::from_secs(20),
        }
    }
}

/// Messages towards the worker waiting for the WebSocket, at most.
const OUTGOING: usize = 256;
/// Bytes of one data message towards the worker, at most.
const MAX_DATA: usize = 64 * 1024;

/// A session's end of its bytes from the worker.
type Inbound = mpsc::UnboundedSender<io::Result<Bytes>>;

struct Slot {
    /// Until the worker answered the connect request.
    connected: Option<oneshot::Sender<Result<(), String>>>,
    inbound: Inbound,
    unread: Arc<AtomicUsize>,
}

struct Shared {
    config: GpuStackLinkConfig,
    /// The address ranges the worker said it reaches (`x-cidrs`).
    cidrs: Vec<IpNet>,
    sessions: Mutex<HashMap<SessionId, Slot>>,
    /// Unread bytes of all sessions.
    unread: AtomicUsize,
    outgoing: mpsc::Sender<Message>,
    closed: CancellationToken,
}

/// A handle on one GPUStack tunnel. Cheap to clone; the tunnel ends with [`close`](Self::close)
/// or when the worker goes away.
#[derive(Clone)]
pub struct GpuStackLink {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for GpuStackLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuStackLink")
            .field("cidrs", &self.shared.cidrs)
            .field("sessions", &self.shared.sessions.lock().len())
            .finish_non_exhaustive()
    }
}

/// Parses `x-cidrs` (`10.0.0.2/32,10.0.1.0/24`); a bare address is its own /32 or /128.
pub fn parse_cidrs(header: &str) -> Result<Vec<IpNet>, String> {
    header
        .split(',')
        .map(str::trim)
        .filter(|c| !c.is_empty())
        .map(|c| {
            c.parse::<IpNet>()
                .or_else(|_| c.parse::<IpAddr>().map(IpNet::from))
                .map_err(|_| format!("{c:?} is not an address range"))
        })
        .collect()
}

impl GpuStackLink {
    /// Starts driving `ws` (the worker's WebSocket, handshake done) in a task; the returned
    /// future is that task, which ends with the tunnel.
    pub fn start<T>(
        ws: WebSocketStream<T>,
        cidrs: Vec<IpNet>,
        config: GpuStackLinkConfig,
    ) -> (
        Self,
        impl Future<Output = Result<(), TunnelError>> + Send + 'static,
    )
    where
        T: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let (tx, rx) = mpsc::channel(OUTGOING);
        let shared = Arc::new(Shared {
            config,
            cidrs,
            sessions: Mutex::default(),
            unread: AtomicUsize::new(0),
            outgoing: tx,
            closed: CancellationToken::new(),
        });
        let link = Self {
            shared: shared.clone(),
        };
        (link, drive(ws, shared, rx))
    }

    /// The address ranges the worker reaches.
    pub fn cidrs(&self) -> &[IpNet] {
        &self.shared.cidrs
    }

    /// Sessions open now.
    pub fn sessions(&self) -> usize {
        self.shared.sessions.lock().len()
    }

    /// Ends the tunnel (every session fails).
    pub fn close(&self) {
        self.shared.closed.cancel();
    }

    /// Resolves once the tunnel has ended.
    pub async fn closed(&self) {
        self.shared.closed.cancelled().await;
    }

    /// Asks the worker to dial `ip:port` and returns the session once it did. Only addresses in
    /// the worker's ranges are asked for.
    pub async fn open(&self, ip: IpAddr, port: u16) -> Result<GpuStackStream, TunnelError> {
        if !self.shared.cidrs.iter().any(|net| net.contains(&ip)) {
            return Err(TunnelError::OutOfRange(ip));
        }
        let session = *uuid::Uuid::new_v4().as_bytes();
        let (inbound, reader) = mpsc::unbounded_channel();
        let (connected, answer) = oneshot::channel();
        let unread = Arc::new(AtomicUsize::new(0));
        {
            let mut sessions = self.shared.sessions.lock();
            if self.shared.closed.is_cancelled() {
                return Err(TunnelError::Closed);
            }
            if sessions.len() >= self.shared.config.max_sessions {
                return Err(TunnelError::TooManyStreams);
            }
            sessions.insert(
                session,
                Slot {
                    connected: Some(connected),
                    inbound,
                    unread: unread.clone(),
                },
            );
        }
        // Removed again unless the session is handed out.
        let mut stream = GpuStackStream {
            session,
            reader,
            pending: Bytes::new(),
            unread,
            shared: self.shared.clone(),
            writer: PollSender::new(self.shared.outgoing.clone()),
            ended: false,
        };
        let target = match ip {
            IpAddr::V4(v4) => format!("tcp://{v4}:{port}"),
            IpAddr::V6(v6) => format!("tcp://[{v6}]:{port}"),
        };
        self.shared
            .outgoing
            .send(Message::ConnectRequest { session, target })
            .await
            .map_err(|_| TunnelError::Closed)?;
        match tokio::time::timeout(self.shared.config.connect_timeout, answer).await {
            Ok(Ok(Ok(()))) => Ok(stream),
            Ok(Ok(Err(error))) => {
                stream.ended = true;
                Err(TunnelError::Io(io::Error::new(
                    io::ErrorKind::ConnectionRefused,
                    format!("the worker could not connect: {error}"),
                )))
            }
            Ok(Err(_)) => {
                stream.ended = true;
                Err(TunnelError::Closed)
            }
            Err(_) => Err(TunnelError::OpenTimeout),
        }
    }
}

/// One relayed connection through a GPUStack tunnel. Dropping it ends the session (the worker
/// closes its connection). GPUStack's protocol has no half-close, so shutting down the write
/// half ends the session too, as GPUStack's own proxy does when its client closes: what the
/// worker already sent can still be read, then the stream ends. Otherwise a relay whose client
/// has gone would hold the session for as long as the engine keeps its connection open.
pub struct GpuStackStream {
    session: SessionId,
    reader: mpsc::UnboundedReceiver<io::Result<Bytes>>,
    pending: Bytes,
    unread: Arc<AtomicUsize>,
    shared: Arc<Shared>,
    writer: PollSender<Message>,
    /// The session is gone from the table (the worker ended it, or it failed).
    ended: bool,
}

impl std::fmt::Debug for GpuStackStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuStackStream")
            .field("session", &uuid::Uuid::from_bytes(self.session))
            .finish_non_exhaustive()
    }
}

impl AsyncRead for GpuStackStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        while self.pending.is_empty() {
            match ready!(self.reader.poll_recv(cx)) {
                Some(Ok(bytes)) => {
                    self.unread.fetch_sub(bytes.len(), Ordering::Relaxed);
                    self.shared.unread.fetch_sub(bytes.len(), Ordering::Relaxed);
                    self.pending = bytes;
                }
                Some(Err(e)) => return Poll::Ready(Err(e)),
                // The worker ended the session: end of stream.
                None => return Poll::Ready(Ok(())),
            }
        }
        let n = self.pending.len().min(buf.remaining());
        let chunk = self.pending.split_to(n);
        buf.put_slice(&chunk);
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for GpuStackStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        if self.ended {
            return Poll::Ready(Err(io::ErrorKind::BrokenPipe.into()));
        }
        if ready!(self.writer.poll_reserve(cx)).is_err() {
            return Poll::Ready(Err(io::ErrorKind::BrokenPipe.into()));
        }
        let n = buf.len().min(MAX_DATA);
        let data = Message::Data {
            session: self.session,
            data: Bytes::copy_from_slice(&buf[..n]),
        };
        match self.writer.send_item(data) {
            Ok(()) => Poll::Ready(Ok(n)),
            Err(_) => Poll::Ready(Err(io::ErrorKind::BrokenPipe.into())),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.ended = true;
        self.end_session();
        Poll::Ready(Ok(()))
    }
}

impl GpuStackStream {
    /// Takes the session out of the table and tells the worker, once. Bytes already queued for
    /// it stay readable (and counted as unread until read or dropped).
    fn end_session(&mut self) {
        let removed = self.shared.sessions.lock().remove(&self.session);
        if removed.is_none() || self.shared.closed.is_cancelled() {
            return;
        }
        let bye = Message::Disconnect {
            session: self.session,
            error: None,
        };
        // Behind the session's own data, in the same queue; when it is full, a task waits for
        // room (it ends when the message is queued or the tunnel is gone).
        if let Err(mpsc::error::TrySendError::Full(bye)) = self.shared.outgoing.try_send(bye) {
            let outgoing = self.shared.outgoing.clone();
            drop(net::task::spawn(async move {
                let _ = outgoing.send(bye).await;
            }));
        }
    }
}

impl Drop for GpuStackStream {
    fn drop(&mut self) {
        self.end_session();
        let unread = self.unread.swap(0, Ordering::Relaxed);
        self.shared.unread.fetch_sub(unread, Ordering::Relaxed);
    }
}

/// Reads and writes the WebSocket until the tunnel ends.
async fn drive<T>(
    mut ws: WebSocketStream<T>,
    shared: Arc<Shared>,
    mut outgoing: mpsc::Receiver<Message>,
) -> Result<(), TunnelError>
where
    T: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let period = shared.config.ping_interval;
    let mut ping = tokio::time::interval_at(Instant::now() + period, period);
    let mut heard = Instant::now();
    let result = loop {
        tokio::select! {
            () = shared.closed.cancelled() => break Ok(()),
            _ = ping.tick() => {
                if heard.elapsed() > period * 3 {
                    break Err(TunnelError::Io(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "the worker's tunnel went silent",
                    )));
                }
                if let Err(e) = ws.send(WsMessage::Ping(Bytes::new())).await {
                    break Err(ws_error(e));
                }
            }
            out = outgoing.recv() => {
                let Some(out) = out else { break Ok(()) };
                let frame = match out.encode() {
                    Ok(frame) => frame,
                    Err(e) => {
                        tracing::warn!(error = %e, "a message for the worker could not be written");
                        continue;
                    }
                };
                if let Err(e) = ws.send(WsMessage::Binary(frame)).await {
                    break Err(ws_error(e));
                }
            }
            received = ws.next() => {
                heard = Instant::now();
                match received {
                    None => break Ok(()),
                    Some(Err(e)) => break Err(ws_error(e)),
                    Some(Ok(WsMessage::Binary(bytes))) => {
                        if let Err(e) = dispatch(&shared, &bytes) {
                            tracing::info!(error = %e, "closing the tunnel: bad message from the worker");
                            break Err(e);
                        }
                    }
                    Some(Ok(WsMessage::Ping(_) | WsMessage::Pong(_) | WsMessage::Frame(_))) => {}
                    Some(Ok(WsMessage::Close(_))) => break Ok(()),
                    Some(Ok(WsMessage::Text(_))) => {
                        tracing::info!("closing the tunnel: a text message from the worker");
                        break Err(TunnelError::Handshake("a text message in the tunnel".into()));
                    }
                }
            }
        }
    };
    shared.closed.cancel();
    // Every session still open fails now: its reader sees the error at once.
    let sessions: Vec<Slot> = shared.sessions.lock().drain().map(|(_, s)| s).collect();
    for slot in sessions {
        if let Some(connected) = slot.connected {
            let _ = connected.send(Err("the tunnel closed".into()));
        }
        let _ = slot.inbound.send(Err(io::Error::new(
            io::ErrorKind::ConnectionAborted,
            "the worker's tunnel closed",
        )));
    }
    let _ = ws.close(None).await;
    result
}

fn ws_error(e: tokio_tungstenite::tungstenite::Error) -> TunnelError {
    TunnelError::Io(io::Error::other(e))
}

/// Hands one message from the worker to its session.
fn dispatch(shared: &Shared, bytes: &Bytes) -> Result<(), TunnelError> {
    if bytes.len() > shared.config.max_message {
        return Err(TunnelError::Handshake(format!(
            "a message of {} bytes",
            bytes.len()
        )));
    }
    let msg = Message::decode(bytes)
        .map_err(|e| TunnelError::Handshake(format!("GPUStack message: {e}")))?;
    match msg {
        Message::Heartbeat { .. } => Ok(()),
        Message::ConnectRequest { .. } => Err(TunnelError::Handshake(
            "the worker sent a connect request".into(),
        )),
        Message::ConnectResponse {
            session,
            success,
            error,
        } => {
            let mut sessions = shared.sessions.lock();
            // None: the opener gave up already (its drop ended the session on the worker).
            let Some(connected) = sessions.get_mut(&session).and_then(|s| s.connected.take())
            else {
                return Ok(());
            };
            if !success {
                sessions.remove(&session);
            }
            drop(sessions);
            let _ = connected.send(match success {
                true => Ok(()),
                false => Err(error.unwrap_or_else(|| "refused".into())),
            });
            Ok(())
        }
        Message::Data { session, data } => {
            let mut sessions = shared.sessions.lock();
            let Some(slot) = sessions.get(&session) else {
                // A session that just ended here; the worker learns it from our DISCONNECT.
                return Ok(());
            };
            let len = data.len();
            let session_over =
                slot.unread.load(Ordering::Relaxed) + len > shared.config.session_buffer;
            let tunnel_over =
                shared.unread.load(Ordering::Relaxed) + len > shared.config.tunnel_buffer;
            if session_over || tunnel_over {
                let Some(slot) = sessions.remove(&session) else {
                    return Ok(());
                };
                drop(sessions);
                let why = if session_over {
                    "the session's receive buffer is full (its reader is too slow)"
                } else {
                    "the tunnel's receive buffers are full"
                };
                tracing::info!(
                    session = %uuid::Uuid::from_bytes(session),
                    unread = slot.unread.load(Ordering::Relaxed),
                    "ending a session: {why}"
                );
                let _ = slot
                    .inbound
                    .send(Err(io::Error::new(io::ErrorKind::OutOfMemory, why)));
                let _ = shared.outgoing.try_send(Message::Disconnect {
                    session,
                    error: Some(why.into()),
                });
                return Ok(());
            }
            slot.unread.fetch_add(len, Ordering::Relaxed);
            shared.unread.fetch_add(len, Ordering::Relaxed);
            if slot.inbound.send(Ok(data)).is_err() {
                // Its reader is gone (being dropped): take the bytes back.
                slot.unread.fetch_sub(len, Ordering::Relaxed);
                shared.unread.fetch_sub(len, Ordering::Relaxed);
            }
            Ok(())
        }
        Message::Disconnect { session, error } => {
            if let Some(slot) = shared.sessions.lock().remove(&session) {
                if let Some(connected) = slot.connected {
                    let _ = connected.send(Err(error.unwrap_or_else(|| "disconnected".into())));
                } else if let Some(error) = error {
                    let _ = slot.inbound.send(Err(io::Error::new(
                        io::ErrorKind::ConnectionReset,
                        format!("the worker ended the session: {error}"),
                    )));
                }
                // Dropping `inbound` is the end of stream.
            }
            Ok(())
        }
    }
}
