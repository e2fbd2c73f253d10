//! The HTTP side: the target, the prepared requests, one connection per worker, and the
//! measurement of one request.
//!
//! Each connection is a `hyper::client::conn::http1` handshake over a `TcpStream` with
//! `TCP_NODELAY` (without it, small writes meet delayed ACKs and latency gets a ~40 ms floor),
//! opened to the target, or to a proxy that first gets `CONNECT` (see
//! [`crate::config::ConnectProxy`]). No pool sits between the worker and its connection: a
//! closed-loop worker owns one, an open-loop request borrows an idle one or opens a new one.

use std::time::Duration;

use anyhow::{Context as _, bail};
use bytes::Bytes;
use http::{HeaderValue, Method, Request, StatusCode, Uri, header};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use serde::Deserialize;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::config::{ConnectProxy, RunConfig, Workload, WorkloadKind};
use crate::sse::{SseReader, Usage};

/// Why a request failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorClass {
    /// The TCP connection or the HTTP handshake failed.
    Connect,
    /// The connection failed after it was open, before the response head (reset, closed).
    Io,
    /// The request did not finish within the timeout.
    Timeout,
    /// The answer had a non-2xx status.
    Status(u16),
    /// A stream ended with neither a finish reason nor `[DONE]`, broke off, or reported an error
    /// event.
    StreamBroken,
    /// Open loop: the request was due while `max_outstanding` requests were in flight.
    Dropped,
}

/// A base URL resolved into what each request needs.
#[derive(Debug)]
pub struct Target {
    /// `host:port` to connect to.
    pub(crate) addr: String,
    host: HeaderValue,
    /// The request path of each [`WorkloadKind`], under the URL's prefix.
    paths: [Uri; 3],
    auth: Option<HeaderValue>,
    /// The proxy's address and the `CONNECT` request to send it first.
    proxy: Option<(String, Bytes)>,
}

/// Largest `CONNECT` answer head accepted from a proxy.
const MAX_CONNECT_HEAD: usize = 8 * 1024;

impl Target {
    /// The target of `config`: its URL, key and `CONNECT` proxy.
    pub fn new(config: &RunConfig) -> anyhow::Result<Self> {
        Self::with_url(config, &config.url)
    }

    /// Every target of `config`, one per URL, in order.
    pub fn all(config: &RunConfig) -> anyhow::Result<Vec<Self>> {
        config.urls().map(|u| Self::with_url(config, u)).collect()
    }

    fn with_url(config: &RunConfig, url: &str) -> anyhow::Result<Self> {
        let mut target = Self::parse(url, config.api_key.as_deref())?;
        if let Some(proxy) = &config.connect_proxy {
            target.proxy = Some((proxy.addr.clone(), connect_head(proxy, &target.addr)?));
        }
        Ok(target)
    }

    fn path(&self, kind: WorkloadKind) -> Uri {
        let i = match kind {
            WorkloadKind::Chat => 0,
            WorkloadKind::Completions => 1,
            WorkloadKind::Embeddings => 2,
        };
        self.paths[i].clone()
    }

    /// Parses `http://host[:port][/prefix]`.
    pub fn parse(url: &str, api_key: Option<&str>) -> anyhow::Result<Self> {
        let uri: Uri = url
            .parse()
            .with_context(|| format!("--url {url:?} is not a URL"))?;
        match uri.scheme_str() {
            Some("http") => {}
            Some("https") => bail!("--url {url:?}: https is not supported yet (use http://)"),
            _ => bail!("--url {url:?} must start with http://"),
        }
        let Some(authority) = uri.authority() else {
            bail!("--url {url:?} has no host");
        };
        let port = authority.port_u16().unwrap_or(80);
        let addr = format!("{}:{port}", authority.host());
        let host = HeaderValue::from_str(authority.as_str()).context("invalid host")?;
        let prefix = uri.path().trim_end_matches('/');
        let path = |kind: WorkloadKind| -> anyhow::Result<Uri> {
            format!("{prefix}{}", kind.path())
                .parse()
                .context("invalid request path")
        };
        let paths = [
            path(WorkloadKind::Chat)?,
            path(WorkloadKind::Completions)?,
            path(WorkloadKind::Embeddings)?,
        ];
        let auth = match api_key {
            Some(k) => Some(
                HeaderValue::from_str(&format!("Bearer {k}"))
                    .context("the API key is not a valid header value")?,
            ),
            None => None,
        };
        Ok(Self {
            addr,
            host,
            paths,
            auth,
            proxy: None,
        })
    }
}

/// `CONNECT <target> HTTP/1.1` with `Host` and `Proxy-Authorization`, checked for characters
/// that would break the head.
fn connect_head(proxy: &ConnectProxy, default_target: &str) -> anyhow::Result<Bytes> {
    let target = proxy.target.as_deref().unwrap_or(default_target);
    let plain = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_graphic());
    if !plain(target) {
        bail!("--connect-target {target:?} is not a valid authority");
    }
    if !plain(&proxy.addr) {
        bail!("--connect-proxy {:?} is not a valid host:port", proxy.addr);
    }
    let mut head = format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n");
    if let Some(key) = &proxy.auth {
        if !plain(key) {
            bail!("the --proxy-auth key is not a valid header value");
        }
        head.push_str(&format!("Proxy-Authorization: Bearer {key}\r\n"));
    }
    head.push_str("\r\n");
    Ok(Bytes::from(head))
}

/// Opens a TCP connection to `addr` and asks for a tunnel with `head`: the proxy must answer
/// 200 and send nothing else before the requests.
async fn connect_through(addr: &str, head: &[u8]) -> anyhow::Result<TcpStream> {
    let mut stream = TcpStream::connect(addr).await?;
    stream.set_nodelay(true)?;
    stream.write_all(head).await?;
    let mut answer = Vec::with_capacity(256);
    let mut buf = [0u8; 512];
    let end = loop {
        let n = stream.read(&mut buf).await?;
        if n == 0 {
            bail!("the proxy closed the connection before answering CONNECT");
        }
        answer.extend_from_slice(&buf[..n]);
        if let Some(i) = memchr::memmem::find(&answer, b"\r\n\r\n") {
            break i + 4;
        }
        if answer.len() > MAX_CONNECT_HEAD {
            bail!("the proxy's CONNECT answer is too long");
        }
    };
    let line = String::from_utf8_lossy(answer.split(|b| *b == b'\r').next().unwrap_or_default());
    let mut words = line.split(' ');
    let version_ok = words.next().is_some_and(|v| v.starts_with("HTTP/1."));
    if !version_ok || words.next() != Some("200") {
        bail!("the proxy refused CONNECT: {line}");
    }
    if end != answer.len() {
        bail!("the proxy sent data after its CONNECT answer");
    }
    Ok(stream)
}

/// A request ready to send (cheap to clone: the body is shared).
#[derive(Clone, Debug)]
pub(crate) struct Prepared {
    kind: WorkloadKind,
    body: Bytes,
    pub(crate) stream: bool,
    pub(crate) weight: u32,
}

impl Prepared {
    pub(crate) fn new(config: &RunConfig, w: &Workload) -> anyhow::Result<Self> {
        Ok(Self {
            kind: w.kind,
            body: request_body(&config.model, w)?,
            stream: w.stream,
            weight: w.weight,
        })
    }

    /// A chat completion with this body.
    pub(crate) fn chat(body: Bytes, stream: bool) -> Self {
        Self {
            kind: WorkloadKind::Chat,
            body,
            stream,
            weight: 1,
        }
    }

    fn request(&self, target: &Target) -> anyhow::Result<Request<Full<Bytes>>> {
        let mut req = Request::builder()
            .method(Method::POST)
            .uri(target.path(self.kind))
            .header(header::HOST, target.host.clone())
            .header(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
        if let Some(auth) = &target.auth {
            req = req.header(header::AUTHORIZATION, auth.clone());
        }
        if self.stream {
            req = req.header(
                header::ACCEPT,
                HeaderValue::from_static("text/event-stream"),
            );
        }
        Ok(req.body(Full::new(self.body.clone()))?)
    }
}

/// The JSON body of a workload, its prompt padded so the body is `prompt_bytes` long (or as
/// short as it can be).
pub(crate) fn request_body(model: &str, w: &Workload) -> anyhow::Result<Bytes> {
    let build = |prompt: &str| {
        let mut v = match w.kind {
            WorkloadKind::Chat => serde_json::json!({
                "model": model,
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": w.max_tokens,
            }),
            WorkloadKind::Completions => serde_json::json!({
                "model": model,
                "prompt": prompt,
                "max_tokens": w.max_tokens,
            }),
            WorkloadKind::Embeddings => serde_json::json!({"model": model, "input": prompt}),
        };
        if w.stream {
            v["stream"] = true.into();
            v["stream_options"] = serde_json::json!({"include_usage": true});
        }
        serde_json::to_vec(&v)
    };
    let bare = build("")?.len();
    let words = "the quick brown fox jumps over the lazy dog ";
    let pad = w.prompt_bytes.saturating_sub(bare);
    let prompt: String = words.chars().cycle().take(pad).collect();
    Ok(Bytes::from(build(&prompt)?))
}

/// One open HTTP/1.1 connection. Dropping it closes the connection.
#[derive(Debug)]
pub(crate) struct Conn {
    sender: http1::SendRequest<Full<Bytes>>,
    task: JoinHandle<()>,
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Conn {
    pub(crate) async fn open(target: &Target) -> anyhow::Result<Self> {
        let stream = match &target.proxy {
            Some((addr, head)) => connect_through(addr, head).await?,
            None => {
                let stream = TcpStream::connect(&target.addr).await?;
                stream.set_nodelay(true)?;
                stream
            }
        };
        let (sender, conn) = http1::Builder::new()
            .handshake(TokioIo::new(stream))
            .await?;
        // Ends with the connection; the handle is aborted when the worker drops it.
        #[allow(clippy::disallowed_methods)]
        let task = tokio::spawn(async move {
            let _ = conn.await;
        });
        Ok(Self { sender, task })
    }
}

/// What one request measured. Reused from request to request.
#[derive(Debug, Default)]
pub(crate) struct Outcome {
    pub(crate) error: Option<ErrorClass>,
    /// When the first chunk with content arrived.
    pub(crate) first_token: Option<Instant>,
    /// When the last chunk with content arrived.
    pub(crate) last_token: Option<Instant>,
    /// Gaps between chunks with content, in microseconds.
    pub(crate) itls: Vec<u64>,
    /// Chunks with content.
    pub(crate) chunks: u64,
    /// `usage.completion_tokens`, when the server sent it.
    pub(crate) usage_tokens: Option<u64>,
    /// `usage.prompt_tokens`, when the server sent it.
    pub(crate) prompt_tokens: Option<u64>,
    /// `usage.prompt_tokens_details.cached_tokens`, when the server sent it.
    pub(crate) cached_tokens: Option<u64>,
    /// Which of the run's URLs the request went to.
    pub(crate) target: usize,
    pub(crate) sse: SseReader,
}

impl Outcome {
    fn reset(&mut self) {
        self.error = None;
        self.first_token = None;
        self.last_token = None;
        self.itls.clear();
        self.chunks = 0;
        self.usage_tokens = None;
        self.prompt_tokens = None;
        self.cached_tokens = None;
        self.sse.reset();
    }

    /// Output tokens: the usage when present, else the chunks with content.
    pub(crate) fn tokens(&self) -> u64 {
        self.usage_tokens.unwrap_or(self.chunks)
    }
}

#[derive(Deserialize)]
struct Answer {
    #[serde(default)]
    usage: Option<Usage>,
}

/// Sends `req` on `conn` (opening it if needed) and reads the whole answer into `out`.
/// Leaves `conn` empty when the connection cannot be reused.
pub(crate) async fn execute(
    target: &Target,
    conn: &mut Option<Conn>,
    req: &Prepared,
    out: &mut Outcome,
) {
    out.reset();
    out.error = send(target, conn, req, out).await.err();
    if out
        .error
        .is_some_and(|e| !matches!(e, ErrorClass::Status(_)))
    {
        *conn = None;
    }
}

async fn send(
    target: &Target,
    slot: &mut Option<Conn>,
    req: &Prepared,
    out: &mut Outcome,
) -> Result<(), ErrorClass> {
    if let Some(c) = slot.as_mut()
        && c.sender.ready().await.is_err()
    {
        *slot = None;
    }
    let conn = match slot {
        Some(c) => c,
        None => slot.insert(Conn::open(target).await.map_err(|_| ErrorClass::Connect)?),
    };
    let request = req.request(target).map_err(|_| ErrorClass::Io)?;
    let resp = conn
        .sender
        .send_request(request)
        .await
        .map_err(|_| ErrorClass::Io)?;
    let status = resp.status();
    let mut body = resp.into_body();
    if !status.is_success() {
        // Read the error body so the connection can carry the next request.
        if body.collect().await.is_err() {
            *slot = None;
        }
        return Err(ErrorClass::Status(status.as_u16()));
    }
    if !req.stream {
        let bytes = body.collect().await.map_err(|_| ErrorClass::Io)?.to_bytes();
        if let Ok(Answer { usage: Some(u) }) = serde_json::from_slice::<Answer>(&bytes) {
            out.usage_tokens = u.completion_tokens;
            out.prompt_tokens = u.prompt_tokens;
            out.cached_tokens = u.cached_tokens();
        }
        return Ok(());
    }
    let mut done = false;
    let mut finished = false;
    let mut broken = false;
    while let Some(frame) = body.frame().await {
        let Ok(frame) = frame else {
            return Err(ErrorClass::StreamBroken);
        };
        let Ok(data) = frame.into_data() else {
            continue;
        };
        let now = Instant::now();
        let Outcome {
            sse,
            first_token,
            last_token,
            itls,
            chunks,
            usage_tokens,
            prompt_tokens,
            cached_tokens,
            ..
        } = out;
        sse.feed(&data, |e| {
            if e.content {
                if let Some(prev) = *last_token {
                    itls.push(u64::try_from((now - prev).as_micros()).unwrap_or(u64::MAX));
                }
                first_token.get_or_insert(now);
                *last_token = Some(now);
                *chunks += 1;
            }
            if let Some(n) = e.completion_tokens {
                *usage_tokens = Some(n);
            }
            if e.prompt_tokens.is_some() {
                *prompt_tokens = e.prompt_tokens;
                *cached_tokens = e.cached_tokens;
            }
            broken |= e.error;
            finished |= e.finish;
            done |= e.done;
        });
    }
    // A stream that ends cleanly after a finish reason is complete even without `[DONE]`
    // (`transformers serve` ends so); one cut before its finish reason is not.
    if broken || !(done || finished) {
        return Err(ErrorClass::StreamBroken);
    }
    Ok(())
}

/// Makes a status code from a number (for reports).
pub(crate) fn status_name(code: u16) -> String {
    StatusCode::from_u16(code)
        .ok()
        .and_then(|s| s.canonical_reason())
        .map_or_else(|| code.to_string(), |r| format!("{code} {r}"))
}

/// `Duration` in microseconds, saturating.
pub(crate) fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}
