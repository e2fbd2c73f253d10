//! Raw HTTP/1 over loopback sockets for hostile-input tests: clients bound to a chosen source
//! address (any of 127.0.0.0/8 on Linux), half-sent request heads, and reading answers.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

/// How long a read may wait for an answer or a close.
pub const WAIT: Duration = Duration::from_secs(10);

/// A loopback source address: `source(2)` is 127.0.0.2.
pub fn source(n: u8) -> IpAddr {
    IpAddr::from([127, 0, 0, n])
}

/// Connects to `addr` from `source` (an ephemeral port).
pub async fn connect_from(source: IpAddr, addr: SocketAddr) -> TcpStream {
    let socket = TcpSocket::new_v4().unwrap();
    socket.bind(SocketAddr::new(source, 0)).unwrap();
    let stream = socket.connect(addr).await.unwrap();
    stream.set_nodelay(true).unwrap();
    stream
}

/// Reads until the server closes the connection (or [`WAIT`] passes); the answer as text.
pub async fn read_to_close(stream: &mut TcpStream) -> String {
    let mut out = Vec::new();
    let mut buf = [0u8; 8192];
    let _ = tokio::time::timeout(WAIT, async {
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => out.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await;
    String::from_utf8_lossy(&out).into_owned()
}

/// Reads until the peer closes; what came before the close, or `None` when the connection is
/// still open after [`WAIT`] (or failed).
pub async fn until_closed<S: AsyncRead + Unpin>(io: &mut S) -> Option<String> {
    let mut out = Vec::new();
    match tokio::time::timeout(WAIT, io.read_to_end(&mut out)).await {
        Ok(Ok(_)) => Some(String::from_utf8_lossy(&out).into_owned()),
        _ => None,
    }
}

/// Reads one answer head, up to and including its blank line, a byte at a time so that
/// nothing after it is consumed (the start of a relayed or upgraded stream); the head as
/// text. Panics when the head does not arrive within [`WAIT`].
pub async fn read_head<S: AsyncRead + Unpin>(io: &mut S) -> String {
    let mut head = Vec::new();
    while !head.ends_with(b"\r\n\r\n") {
        let mut one = [0u8; 1];
        tokio::time::timeout(WAIT, io.read_exact(&mut one))
            .await
            .expect("no answer head in time")
            .expect("connection closed before the end of the answer head");
        head.push(one[0]);
    }
    String::from_utf8_lossy(&head).into_owned()
}

/// Sends `bytes` from `source` on a new connection and reads until the server closes it.
pub async fn exchange_from(source: IpAddr, addr: SocketAddr, bytes: &[u8]) -> String {
    let mut s = connect_from(source, addr).await;
    s.write_all(bytes).await.unwrap();
    read_to_close(&mut s).await
}

/// The status code of the first answer in `text` (0 when there is none).
pub fn status(text: &str) -> u16 {
    text.strip_prefix("HTTP/1.1 ")
        .and_then(|rest| rest.get(..3))
        .and_then(|code| code.parse().ok())
        .unwrap_or(0)
}

/// How many answers `text` holds.
pub fn answers(text: &str) -> usize {
    text.matches("HTTP/1.1 ").count()
}

/// The JSON body of the first answer (after its head), when it has one.
pub fn json_body(text: &str) -> serde_json::Value {
    let body = text.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    // One answer per connection in these tests; `content-length` bodies.
    serde_json::from_str(body.trim()).unwrap_or(serde_json::Value::Null)
}

/// The value of `name` in the first answer's head (case-insensitive), if present.
pub fn header<'a>(text: &'a str, name: &str) -> Option<&'a str> {
    let head = text.split_once("\r\n\r\n").map_or(text, |(h, _)| h);
    head.lines().skip(1).find_map(|line| {
        let (k, v) = line.split_once(':')?;
        k.trim().eq_ignore_ascii_case(name).then(|| v.trim())
    })
}

/// Opens `n` connections from `source` that send `partial` (a request head that never ends)
/// and then nothing: slowloris.
pub async fn slow_clients(
    source: IpAddr,
    addr: SocketAddr,
    n: usize,
    partial: &[u8],
) -> Vec<TcpStream> {
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let mut s = connect_from(source, addr).await;
        s.write_all(partial).await.unwrap();
        out.push(s);
    }
    out
}

/// Waits until every connection in `conns` is closed by the server; panics after [`WAIT`].
/// Returns how long that took.
pub async fn closed_by_server(conns: &mut [TcpStream]) -> Duration {
    let started = tokio::time::Instant::now();
    for s in conns.iter_mut() {
        let text = read_to_close(s).await;
        assert!(
            started.elapsed() < WAIT,
            "a slow connection was still open after {WAIT:?}"
        );
        // Whatever was answered (408 or nothing), the server closed it.
        let _ = text;
    }
    started.elapsed()
}

/// Request heads that must never be framed (`auth`: header lines to put in each, such as a
/// credential): a server answers each with 400, alone, and reads nothing after it.
pub fn smuggling_cases(auth: &str) -> Vec<(&'static str, Vec<u8>)> {
    let next = "GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n";
    let post = "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n";
    let body = r#"{"model":"mock-model"}"#;
    let chunked = format!("{:x}\r\n{body}\r\n0\r\n\r\n", body.len());
    [
        (
            "Content-Length and Transfer-Encoding",
            format!(
                "{post}{auth}content-length: 4\r\ntransfer-encoding: chunked\r\n\r\n{chunked}{next}"
            ),
        ),
        (
            "two different Content-Length values",
            format!(
                "{post}{auth}content-length: {}\r\ncontent-length: 4\r\n\r\n{body}{next}",
                body.len()
            ),
        ),
        (
            "Content-Length list with different values",
            format!(
                "{post}{auth}content-length: {}, 4\r\n\r\n{body}{next}",
                body.len()
            ),
        ),
        (
            "Transfer-Encoding: chunked, identity",
            format!("{post}{auth}transfer-encoding: chunked, identity\r\n\r\n{chunked}{next}"),
        ),
        (
            "Transfer-Encoding: identity",
            format!("{post}{auth}transfer-encoding: identity\r\n\r\n{body}{next}"),
        ),
        (
            "obs-fold",
            format!(
                "{post}{auth}x-folded: a\r\n b\r\ncontent-length: {}\r\n\r\n{body}{next}",
                body.len()
            ),
        ),
        (
            "obs-fold of Transfer-Encoding",
            format!("{post}{auth}transfer-encoding:\r\n chunked\r\n\r\n{chunked}{next}"),
        ),
        (
            "space before the colon",
            format!(
                "{post}{auth}content-length : {}\r\n\r\n{body}{next}",
                body.len()
            ),
        ),
        (
            "CR inside a header value",
            format!(
                "{post}{auth}x-inject: a\rinjected: 1\r\ncontent-length: {}\r\n\r\n{body}{next}",
                body.len()
            ),
        ),
        (
            "NUL inside a header value",
            format!(
                "{post}{auth}x-inject: a\0b\r\ncontent-length: {}\r\n\r\n{body}{next}",
                body.len()
            ),
        ),
    ]
    .into_iter()
    .map(|(name, text)| (name, text.into_bytes()))
    .collect()
}

/// Sends each of `cases` on a connection of its own: 400 and no second answer.
pub async fn assert_refused_alone(addr: SocketAddr, cases: &[(&str, Vec<u8>)]) {
    for (name, bytes) in cases {
        let out = exchange_from(source(1), addr, bytes).await;
        assert_eq!(status(&out), 400, "{name}: {out}");
        assert_eq!(
            answers(&out),
            1,
            "{name}: a second request was answered: {out}"
        );
    }
}

/// Reads one answer (its head and a `Content-Length` body, none without one) or until EOF,
/// leaving the connection open for the next request; the answer as text. Panics after
/// [`WAIT`].
pub async fn read_answer<S: AsyncRead + Unpin>(io: &mut S) -> String {
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    tokio::time::timeout(WAIT, async {
        loop {
            let n = io.read(&mut buf).await.unwrap_or(0);
            if n == 0 {
                break;
            }
            out.extend_from_slice(&buf[..n]);
            let text = String::from_utf8_lossy(&out);
            if let Some((head, body)) = text.split_once("\r\n\r\n") {
                let len = head
                    .lines()
                    .find_map(|l| {
                        l.to_ascii_lowercase()
                            .strip_prefix("content-length:")
                            .map(|v| v.trim().parse::<usize>().unwrap())
                    })
                    .unwrap_or(0);
                if body.len() >= len {
                    break;
                }
            }
        }
    })
    .await
    .expect("no whole answer in time");
    String::from_utf8_lossy(&out).into_owned()
}
