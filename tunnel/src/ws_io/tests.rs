#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::disallowed_methods
)]

use std::collections::VecDeque;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use futures_util::{SinkExt as _, StreamExt as _};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::protocol::frame::coding::OpCode;
use tokio_tungstenite::tungstenite::protocol::frame::{Frame, FrameHeader};
use tokio_tungstenite::tungstenite::protocol::{Role, WebSocketConfig};
use tokio_tungstenite::tungstenite::{self, Message};

use super::frame::*;
use super::*;
use crate::protocol::MAX_MESSAGE_BYTES;

/// A frame as tungstenite writes it (the reference encoder).
fn frame(opcode: u8, fin: bool, payload: &[u8], masked: bool) -> Vec<u8> {
    let header = FrameHeader {
        is_final: fin,
        opcode: OpCode::from(opcode),
        mask: masked.then(rand::random),
        ..FrameHeader::default()
    };
    let mut out = Vec::new();
    Frame::from_payload(header, payload.to_vec().into())
        .format(&mut out)
        .unwrap();
    out
}

fn payload(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// A scripted connection: reads hand out `chunks` one after another (a `Pending` in
/// between when `stall` is set), then EOF; writes are kept.
#[derive(Debug, Default)]
struct Script {
    chunks: VecDeque<Vec<u8>>,
    stall: bool,
    stalled: bool,
    written: Vec<u8>,
}

impl Script {
    fn new(chunks: impl IntoIterator<Item = Vec<u8>>, stall: bool) -> Self {
        Self {
            chunks: chunks.into_iter().collect(),
            stall,
            ..Self::default()
        }
    }
}

impl AsyncRead for Script {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.stall && !self.stalled {
            self.stalled = true;
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        self.stalled = false;
        while self.chunks.front().is_some_and(Vec::is_empty) {
            self.chunks.pop_front();
        }
        if let Some(mut chunk) = self.chunks.pop_front() {
            let n = chunk.len().min(buf.remaining());
            buf.put_slice(&chunk[..n]);
            if n < chunk.len() {
                self.chunks.push_front(chunk.split_off(n));
            }
        }
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for Script {
    fn poll_write(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.written.extend_from_slice(buf);
        Poll::Ready(Ok(buf.len()))
    }
    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

/// Reads everything with reads of `read_size` bytes: the bytes, and how it ended.
async fn read_all<S: AsyncRead + AsyncWrite + Unpin>(
    ws: &mut WsIo<S>,
    read_size: usize,
) -> (Vec<u8>, io::Result<()>) {
    let mut out = Vec::new();
    let mut buf = vec![0u8; read_size];
    loop {
        match ws.read(&mut buf).await {
            Ok(0) => return (out, Ok(())),
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(e) => return (out, Err(e)),
        }
    }
}

/// Every frame the bytes hold (tungstenite's decoder, as the reference).
fn frames(mut bytes: &[u8]) -> Vec<(FrameHeader, Vec<u8>)> {
    let mut out = Vec::new();
    while !bytes.is_empty() {
        let mut cursor = io::Cursor::new(bytes);
        let (header, len) = FrameHeader::parse(&mut cursor).unwrap().unwrap();
        let start = cursor.position() as usize;
        let mut data = bytes[start..start + len as usize].to_vec();
        if let Some(key) = header.mask {
            apply_mask(&mut data, key, 0);
        }
        bytes = &bytes[start + len as usize..];
        out.push((header, data));
    }
    out
}

fn server(chunks: impl IntoIterator<Item = Vec<u8>>, stall: bool) -> WsIo<Script> {
    WsIo::new(
        Script::new(chunks, stall),
        Endpoint::Server,
        Liveness::default(),
        BytesMut::new(),
    )
}

fn client(chunks: impl IntoIterator<Item = Vec<u8>>, stall: bool) -> WsIo<Script> {
    WsIo::new(
        Script::new(chunks, stall),
        Endpoint::Client,
        Liveness::default(),
        BytesMut::new(),
    )
}

#[test]
fn headers_parse_like_tungstenite_writes_them() {
    for len in [0usize, 1, 125, 126, 127, 65535, 65536, MAX_MESSAGE_BYTES] {
        for masked in [false, true] {
            let bytes = frame(OP_BINARY, true, &payload(len, 1), masked);
            let size = bytes.len() - len;
            for cut in 0..size {
                assert_eq!(parse_header(&bytes[..cut]), Ok(None), "{len} {cut}");
            }
            let header = parse_header(&bytes).unwrap().unwrap();
            assert_eq!(header.size, size);
            assert_eq!(header.len, len as u64);
            assert!(header.fin);
            assert_eq!(header.opcode, OP_BINARY);
            assert_eq!(header.mask.is_some(), masked);
            // And ours encodes the same header.
            let mut ours = [0u8; MAX_HEADER];
            let n = encode_header(&mut ours, OP_BINARY, len, header.mask);
            assert_eq!(&ours[..n], &bytes[..size]);
        }
    }
}

#[test]
fn masking_works_at_any_offset() {
    let key = [1, 2, 3, 4];
    let data = payload(1000, 9);
    let mut whole = data.clone();
    apply_mask(&mut whole, key, 0);
    for split in [0, 1, 2, 3, 5, 333, 999, 1000] {
        let mut parts = data.clone();
        let (a, b) = parts.split_at_mut(split);
        apply_mask(a, key, 0);
        apply_mask(b, key, split);
        assert_eq!(parts, whole, "{split}");
    }
    let expected: Vec<u8> = data
        .iter()
        .enumerate()
        .map(|(i, b)| b ^ key[i % 4])
        .collect();
    assert_eq!(whole, expected);
}

#[test]
fn header_errors() {
    let cases: [(&[u8], FrameError); 6] = [
        (&[0xc2, 0x80, 0, 0, 0, 0], FrameError::ReservedBits),
        (&[0x83, 0x80, 0, 0, 0, 0], FrameError::ReservedOpcode(3)),
        (&[0x8b, 0x80, 0, 0, 0, 0], FrameError::ReservedOpcode(0xb)),
        (&[0x09, 0x80, 0, 0, 0, 0], FrameError::FragmentedControl),
        (
            &[0x89, 0xfe, 0, 126, 0, 0, 0, 0],
            FrameError::ControlTooLong(126),
        ),
        (
            &[0x82, 0xff, 0x7f, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff],
            FrameError::TooLarge,
        ),
    ];
    for (bytes, error) in cases {
        assert_eq!(parse_header(bytes), Err(error), "{bytes:?}");
    }
    // The largest message is allowed, one byte more is not.
    let max = (MAX_MESSAGE_BYTES as u64).to_be_bytes();
    let over = (MAX_MESSAGE_BYTES as u64 + 1).to_be_bytes();
    assert!(parse_header(&[&[0x82, 0x7f][..], &max].concat()).is_ok());
    assert_eq!(
        parse_header(&[&[0x82, 0x7f][..], &over].concat()),
        Err(FrameError::TooLarge)
    );
}

/// A client's stream with every kind of frame the server must take: lengths at every
/// boundary, empty frames, fragments with control frames between them.
fn client_stream() -> (Vec<u8>, Vec<u8>) {
    let mut wire = Vec::new();
    let mut data = Vec::new();
    let mut binary = |wire: &mut Vec<u8>, opcode, fin, p: Vec<u8>| {
        wire.extend(frame(opcode, fin, &p, true));
        data.extend(p);
    };
    for (i, len) in [0usize, 1, 3, 125, 126, 127, 1000, 65535, 65536, 70000]
        .into_iter()
        .enumerate()
    {
        binary(&mut wire, OP_BINARY, true, payload(len, i as u8));
    }
    binary(&mut wire, OP_BINARY, false, payload(10, 50));
    wire.extend(frame(OP_PING, true, b"are you there", true));
    binary(&mut wire, OP_CONTINUATION, false, payload(0, 51));
    wire.extend(frame(OP_PONG, true, b"", true));
    binary(&mut wire, OP_CONTINUATION, false, payload(3000, 52));
    binary(&mut wire, OP_CONTINUATION, true, payload(7, 53));
    binary(&mut wire, OP_BINARY, true, payload(5, 54));
    (wire, data)
}

#[tokio::test]
async fn reads_every_frame_whatever_the_read_sizes_and_splits() {
    let (wire, data) = client_stream();
    let closed = [wire.clone(), frame(OP_CLOSE, true, &[3, 232], true)].concat();
    // Split in two at a spread of places, reading with several buffer sizes.
    let mut cuts: Vec<usize> = (0..300).collect();
    cuts.extend((300..closed.len()).step_by(997));
    cuts.extend(closed.len() - 300..=closed.len());
    for cut in cuts {
        for read_size in [1usize, 12, 4096, 70_000] {
            // Tiny reads are slow in a debug build: fewer of them.
            if (read_size == 1 && cut % 101 != 0) || (read_size == 12 && cut % 7 != 0) {
                continue;
            }
            let chunks = [closed[..cut].to_vec(), closed[cut..].to_vec()];
            let mut ws = server(chunks, cut % 2 == 0);
            let (got, end) = read_all(&mut ws, read_size).await;
            assert!(end.is_ok(), "cut {cut}, reads of {read_size}: {end:?}");
            assert!(got == data, "cut {cut}, reads of {read_size}");
        }
    }
}

#[tokio::test]
async fn reads_byte_by_byte_arrivals() {
    let (wire, data) = client_stream();
    let closed = [wire, frame(OP_CLOSE, true, &[], true)].concat();
    let chunks: Vec<Vec<u8>> = closed.iter().map(|b| vec![*b]).collect();
    let mut ws = server(chunks, true);
    let (got, end) = read_all(&mut ws, 4096).await;
    end.unwrap();
    assert!(got == data);
    // The ping got its pong, the close its close; masked by no one (server side).
    let sent = frames(&ws.io.written);
    assert_eq!(sent.len(), 2);
    assert_eq!(sent[0].0.opcode, OpCode::from(OP_PONG));
    assert_eq!(sent[0].1, b"are you there");
    assert!(sent[0].0.mask.is_none());
    assert_eq!(sent[1].0.opcode, OpCode::from(OP_CLOSE));
    assert_eq!(ws.buffers(), (false, 0));
}

#[tokio::test]
async fn the_client_takes_unmasked_frames_and_masks_its_pongs() {
    let wire = [
        frame(OP_BINARY, true, &payload(70000, 1), false),
        frame(OP_PING, true, b"x", false),
        frame(OP_CLOSE, true, &[], false),
    ]
    .concat();
    let mut ws = client([wire], false);
    let (got, end) = read_all(&mut ws, 8192).await;
    end.unwrap();
    assert!(got == payload(70000, 1));
    let sent = frames(&ws.io.written);
    assert_eq!(sent[0].0.opcode, OpCode::from(OP_PONG));
    assert!(sent[0].0.mask.is_some());
    assert_eq!(sent[0].1, b"x");
}

async fn read_error(mut ws: WsIo<Script>) -> io::Error {
    let (_, end) = read_all(&mut ws, 4096).await;
    end.unwrap_err()
}

fn invalid(e: &io::Error) -> FrameError {
    assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{e}");
    e.get_ref()
        .and_then(|e| e.downcast_ref::<FrameError>())
        .cloned_error()
}

trait ClonedError {
    fn cloned_error(self) -> FrameError;
}

impl ClonedError for Option<&FrameError> {
    fn cloned_error(self) -> FrameError {
        match self.unwrap() {
            FrameError::ReservedOpcode(op) => FrameError::ReservedOpcode(*op),
            FrameError::ControlTooLong(n) => FrameError::ControlTooLong(*n),
            FrameError::ReservedBits => FrameError::ReservedBits,
            FrameError::FragmentedControl => FrameError::FragmentedControl,
            FrameError::Unmasked => FrameError::Unmasked,
            FrameError::Masked => FrameError::Masked,
            FrameError::TooLarge => FrameError::TooLarge,
            FrameError::Text => FrameError::Text,
            FrameError::UnexpectedContinuation => FrameError::UnexpectedContinuation,
            FrameError::ExpectedContinuation => FrameError::ExpectedContinuation,
        }
    }
}

#[tokio::test]
async fn protocol_errors_end_the_stream() {
    let big = payload(MAX_MESSAGE_BYTES / 2 + 1, 0);
    let cases: Vec<(Vec<u8>, FrameError)> = vec![
        (frame(OP_BINARY, true, b"abc", false), FrameError::Unmasked),
        (frame(OP_PING, true, b"", false), FrameError::Unmasked),
        (frame(OP_TEXT, true, b"hello", true), FrameError::Text),
        (frame(OP_TEXT, false, b"he", true), FrameError::Text),
        (
            frame(OP_CONTINUATION, true, b"abc", true),
            FrameError::UnexpectedContinuation,
        ),
        (
            [
                frame(OP_BINARY, false, b"a", true),
                frame(OP_BINARY, true, b"b", true),
            ]
            .concat(),
            FrameError::ExpectedContinuation,
        ),
        (
            [
                frame(OP_BINARY, false, &big, true),
                frame(OP_CONTINUATION, true, &big, true),
            ]
            .concat(),
            FrameError::TooLarge,
        ),
        (
            frame(OP_PING, true, &[0; 126], true),
            FrameError::ControlTooLong(126),
        ),
        (
            vec![0x82 | 0x40, 0x80, 0, 0, 0, 0],
            FrameError::ReservedBits,
        ),
        (vec![0x83, 0x80, 0, 0, 0, 0], FrameError::ReservedOpcode(3)),
    ];
    for (wire, expected) in cases {
        let e = read_error(server([wire], false)).await;
        assert_eq!(invalid(&e), expected);
    }
    // Masked frames from the server.
    let e = read_error(client([frame(OP_BINARY, true, b"abc", true)], false)).await;
    assert_eq!(invalid(&e), FrameError::Masked);
    // The connection ends without a close frame, between frames or inside one.
    let whole = frame(OP_BINARY, true, &payload(5000, 0), true);
    for cut in [whole.len(), 1, 5, 100, 4000] {
        let e = read_error(server([whole[..cut].to_vec()], false)).await;
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof, "{cut}");
    }
}

#[tokio::test]
async fn writes_one_message_per_flush_from_one_bounded_buffer() {
    for endpoint in [Endpoint::Client, Endpoint::Server] {
        let mut ws = WsIo::new(
            Script::default(),
            endpoint,
            Liveness::default(),
            BytesMut::new(),
        );
        let sizes = [1usize, 12, 125, 126, 65535, 65536, 65537, 200_000];
        for (i, len) in sizes.into_iter().enumerate() {
            ws.write_all(&payload(len, i as u8)).await.unwrap();
            ws.flush().await.unwrap();
            let (read, write) = ws.buffers();
            assert!(!read);
            assert!(write <= MAX_HEADER + MAX_OUT_MESSAGE, "{write}");
        }
        // Two writes, one flush: one message.
        ws.write_all(b"head").await.unwrap();
        ws.write_all(b"body").await.unwrap();
        ws.flush().await.unwrap();
        ws.shutdown().await.unwrap();
        let sent = frames(&ws.io.written);
        let mut messages = sent.iter();
        for (i, len) in sizes.into_iter().enumerate() {
            let mut data = payload(len, i as u8);
            // A message is at most MAX_OUT_MESSAGE bytes; the rest follows.
            while !data.is_empty() {
                let (header, body) = messages.next().unwrap();
                let n = data.len().min(MAX_OUT_MESSAGE);
                assert_eq!(header.opcode, OpCode::from(OP_BINARY));
                assert!(header.is_final);
                assert_eq!(header.mask.is_some(), endpoint == Endpoint::Client);
                assert!(body[..] == data[..n], "{len}");
                data.drain(..n);
            }
        }
        assert_eq!(messages.next().unwrap().1, b"headbody");
        let (close, code) = messages.next().unwrap();
        assert_eq!(close.opcode, OpCode::from(OP_CLOSE));
        assert_eq!(code, &1000u16.to_be_bytes());
        assert!(messages.next().is_none());
        // Nothing more goes out after the close.
        assert!(ws.write_all(b"late").await.is_err());
    }
}

/// Pings every 10 s, dead after 25 s of silence.
const TEST_LIVENESS: Liveness = Liveness {
    ping_interval: Duration::from_secs(10),
    dead_after: Duration::from_secs(25),
};

/// Reads from `ws` until a read fails: the error and when it came.
fn read_until_error(
    mut ws: WsIo<tokio::io::DuplexStream>,
) -> tokio::task::JoinHandle<(io::Error, tokio::time::Instant)> {
    tokio::spawn(async move {
        let mut buf = [0u8; 16];
        let e = ws.read(&mut buf).await.unwrap_err();
        (e, tokio::time::Instant::now())
    })
}

#[tokio::test(start_paused = true)]
async fn pings_on_time_and_declares_a_silent_peer_dead() {
    let (near, mut far) = tokio::io::duplex(64 * 1024);
    let ws = WsIo::new(near, Endpoint::Client, TEST_LIVENESS, BytesMut::new());
    let reader = read_until_error(ws);
    let started = tokio::time::Instant::now();
    let (e, at) = reader.await.unwrap();
    assert_eq!(e.kind(), io::ErrorKind::TimedOut);
    assert_eq!(at - started, Duration::from_secs(25));
    let mut sent = vec![0u8; 1024];
    let n = far.read(&mut sent).await.unwrap();
    let pings = frames(&sent[..n]);
    assert_eq!(pings.len(), 2, "pings at 10 s and 20 s");
    for (header, body) in pings {
        assert_eq!(header.opcode, OpCode::from(OP_PING));
        assert!(header.mask.is_some() && body.is_empty());
    }
}

#[tokio::test(start_paused = true)]
async fn any_frame_keeps_the_peer_alive() {
    let (near, mut far) = tokio::io::duplex(64 * 1024);
    let ws = WsIo::new(near, Endpoint::Server, TEST_LIVENESS, BytesMut::new());
    let reader = read_until_error(ws);
    let started = tokio::time::Instant::now();
    for _ in 0..4 {
        tokio::time::sleep(Duration::from_secs(20)).await;
        far.write_all(&frame(OP_PONG, true, b"", true))
            .await
            .unwrap();
    }
    let (e, at) = reader.await.unwrap();
    assert_eq!(e.kind(), io::ErrorKind::TimedOut);
    assert_eq!(at - started, Duration::from_secs(80 + 25));
}

// Paused time: a write that waits for the peer leaves the runtime idle, so the 100 ms pass at
// once; one that makes progress never lets them pass.
#[tokio::test(start_paused = true)]
async fn writes_wait_for_a_slow_peer_with_one_message_held() {
    let (near, far) = tokio::io::duplex(16 * 1024);
    let mut ws = WsIo::new(near, Endpoint::Server, Liveness::default(), BytesMut::new());
    let chunk = payload(8 * 1024, 3);
    let mut accepted = 0usize;
    let blocked = loop {
        let write = async {
            ws.write_all(&chunk).await.unwrap();
            ws.flush().await.unwrap();
        };
        match tokio::time::timeout(Duration::from_millis(100), write).await {
            Ok(()) => accepted += chunk.len(),
            Err(_) => break true,
        }
        if accepted > 1 << 20 {
            break false;
        }
    };
    assert!(blocked, "writes never waited");
    let (read, write) = ws.buffers();
    assert!(!read);
    assert!(write <= MAX_HEADER + MAX_OUT_MESSAGE, "{write}");
    drop(far);
}

/// Both ends against tungstenite's: data both ways, pings answered, a clean close.
#[tokio::test]
async fn speaks_with_tungstenite_on_either_side() {
    for ours in [Endpoint::Client, Endpoint::Server] {
        let (near, far) = tokio::io::duplex(256 * 1024);
        let role = match ours {
            Endpoint::Client => Role::Server,
            Endpoint::Server => Role::Client,
        };
        let config = WebSocketConfig::default().max_message_size(Some(MAX_MESSAGE_BYTES));
        let mut peer = WebSocketStream::from_raw_socket(far, role, Some(config)).await;
        let mut ws = WsIo::new(near, ours, Liveness::default(), BytesMut::new());
        let data = payload(300_000, 7);
        let ours_task = tokio::spawn(async move {
            ws.write_all(&data).await.unwrap();
            ws.flush().await.unwrap();
            let mut back = vec![0u8; 100_000];
            ws.read_exact(&mut back).await.unwrap();
            assert!(back == payload(100_000, 8));
            ws.shutdown().await.unwrap();
            let mut rest = Vec::new();
            ws.read_to_end(&mut rest).await.unwrap();
            assert!(rest.is_empty());
            ws.buffers()
        });
        let mut got = Vec::new();
        while got.len() < 300_000 {
            match peer.next().await.unwrap().unwrap() {
                Message::Binary(b) => got.extend_from_slice(&b),
                other => panic!("{other:?}"),
            }
        }
        assert!(got == payload(300_000, 7));
        peer.send(Message::Ping(b"hi".to_vec().into()))
            .await
            .unwrap();
        for part in payload(100_000, 8).chunks(30_000) {
            peer.send(Message::Binary(part.to_vec().into()))
                .await
                .unwrap();
        }
        let mut pong = false;
        let mut closed = false;
        while let Some(message) = peer.next().await {
            match message {
                Ok(Message::Pong(p)) => pong = &p[..] == b"hi",
                Ok(Message::Close(_)) => closed = true,
                Ok(other) => panic!("{other:?}"),
                Err(tungstenite::Error::ConnectionClosed) => break,
                Err(e) => panic!("{e}"),
            }
        }
        assert!(pong && closed, "{ours:?}");
        // Nothing is read after the close.
        assert!(!ours_task.await.unwrap().0);
    }
}

#[tokio::test(start_paused = true)]
async fn an_idle_connection_drops_its_buffers() {
    let (near, mut far) = tokio::io::duplex(256 * 1024);
    let mut ws = WsIo::new(near, Endpoint::Server, Liveness::default(), BytesMut::new());
    let data = payload(100_000, 5);
    far.write_all(&frame(OP_BINARY, true, &data, true))
        .await
        .unwrap();
    let mut got = vec![0u8; data.len()];
    ws.read_exact(&mut got).await.unwrap();
    assert!(got == data);
    ws.write_all(&data).await.unwrap();
    ws.flush().await.unwrap();
    let (read, write) = ws.buffers();
    assert!(read && write > 0, "{read} {write}");
    // Still held a little before the idle limit, dropped once it has passed.
    let mut buf = [0u8; 64];
    let wait = IDLE_RELEASE - Duration::from_millis(100);
    assert!(tokio::time::timeout(wait, ws.read(&mut buf)).await.is_err());
    assert_ne!(ws.buffers(), (false, 0));
    let wait = Duration::from_millis(200);
    assert!(tokio::time::timeout(wait, ws.read(&mut buf)).await.is_err());
    assert_eq!(ws.buffers(), (false, 0));
    // And they come back with the next traffic.
    far.write_all(&frame(OP_BINARY, true, b"again", true))
        .await
        .unwrap();
    let n = ws.read(&mut buf).await.unwrap();
    assert_eq!(&buf[..n], b"again");
}
