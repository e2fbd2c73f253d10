//! The tunnel's WebSocket reader (`tunnel::ws_io::WsIo`). Byte 0: bit 0 picks the endpoint
//! (server: frames must be masked; client: unmasked), the other bits seed the size of the
//! connection's reads; the rest is the byte stream from the peer. Invariants: the bytes read
//! and how the stream ends (close frame, early end, protocol error) are the same for any split
//! and read size, and equal a frame-by-frame reading of RFC 6455 with the tunnel's rules
//! (binary only, 256 KiB messages, control frames final and at most 125 bytes).
#![no_main]

use std::collections::VecDeque;
use std::io;
use std::pin::Pin;
use std::sync::OnceLock;
use std::task::{Context, Poll};

use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};
use tunnel::protocol::MAX_MESSAGE_BYTES;
use tunnel::ws_io::{Endpoint, Liveness, WsIo};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    Closed,
    Eof,
    Invalid,
}

/// The peer's bytes in reads of at most `step`; writes are dropped.
struct Script {
    chunks: VecDeque<Vec<u8>>,
}

impl AsyncRead for Script {
    fn poll_read(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
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
    fn poll_write(self: Pin<&mut Self>, _: &mut Context<'_>, b: &[u8]) -> Poll<io::Result<usize>> {
        Poll::Ready(Ok(b.len()))
    }
    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("runtime")
    })
}

fn read(endpoint: Endpoint, input: &[u8], step: usize, read_size: usize) -> (Vec<u8>, End) {
    let script = Script {
        chunks: input.chunks(step).map(<[u8]>::to_vec).collect(),
    };
    runtime().block_on(async {
        // Its timers need the runtime.
        let mut ws = WsIo::new(script, endpoint, Liveness::default(), BytesMut::new());
        let mut out = Vec::new();
        let mut buf = vec![0u8; read_size];
        loop {
            match ws.read(&mut buf).await {
                Ok(0) => return (out, End::Closed),
                Ok(n) => out.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return (out, End::Eof),
                Err(e) => {
                    assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{e}");
                    return (out, End::Invalid);
                }
            }
        }
    })
}

/// Frame by frame, from the whole input.
fn reference(endpoint: Endpoint, b: &[u8]) -> (Vec<u8>, End) {
    let mut out = Vec::new();
    let mut at = 0;
    let mut fragmented: Option<usize> = None;
    loop {
        let Some(&b0) = b.get(at) else {
            return (out, End::Eof);
        };
        let (fin, opcode) = (b0 & 0x80 != 0, b0 & 0x0f);
        if b0 & 0x70 != 0 || !matches!(opcode, 0 | 1 | 2 | 8 | 9 | 10) {
            return (out, End::Invalid);
        }
        let Some(&b1) = b.get(at + 1) else {
            return (out, End::Eof);
        };
        let (len, mut size) = match b1 & 0x7f {
            126 => match b.get(at + 2..at + 4) {
                Some(l) => (u64::from(u16::from_be_bytes([l[0], l[1]])), 4),
                None => return (out, End::Eof),
            },
            127 => match b.get(at + 2..at + 10) {
                Some(l) => (u64::from_be_bytes(l.try_into().expect("8 bytes")), 10),
                None => return (out, End::Eof),
            },
            n => (u64::from(n), 2),
        };
        let control = opcode & 8 != 0;
        if (control && (!fin || len > 125)) || (!control && len > MAX_MESSAGE_BYTES as u64) {
            return (out, End::Invalid);
        }
        let masked = b1 & 0x80 != 0;
        let mut key = None;
        if masked {
            match b.get(at + size..at + size + 4) {
                Some(k) => key = Some([k[0], k[1], k[2], k[3]]),
                None => return (out, End::Eof),
            }
            size += 4;
        }
        if masked != (endpoint == Endpoint::Server) {
            return (out, End::Invalid);
        }
        let len = len as usize;
        let start = at + size;
        let unmask = |i: usize, x: u8| key.map_or(x, |k| x ^ k[i % 4]);
        if control {
            if b.len() < start + len {
                return (out, End::Eof);
            }
            at = start + len;
            if opcode == 8 {
                return (out, End::Closed);
            }
            continue;
        }
        let so_far = match (opcode, fragmented) {
            (1, _) => return (out, End::Invalid),
            (2, Some(_)) => return (out, End::Invalid),
            (2, None) => 0,
            (_, Some(n)) => n,
            (_, None) => return (out, End::Invalid),
        };
        if so_far + len > MAX_MESSAGE_BYTES {
            return (out, End::Invalid);
        }
        fragmented = if fin { None } else { Some(so_far + len) };
        let end = (start + len).min(b.len());
        out.extend(b[start..end].iter().enumerate().map(|(i, &x)| unmask(i, x)));
        if end < start + len {
            return (out, End::Eof);
        }
        at = start + len;
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, input)) = data.split_first() else {
        return;
    };
    let endpoint = if mode & 1 == 0 {
        Endpoint::Server
    } else {
        Endpoint::Client
    };
    let step = usize::from(mode >> 1) + 1;
    let want = reference(endpoint, input);
    assert_eq!(
        read(endpoint, input, input.len().max(1), 64 * 1024),
        want,
        "one read"
    );
    assert_eq!(read(endpoint, input, 1, 7), want, "byte by byte");
    assert_eq!(
        read(endpoint, input, step, step * 3 + 1),
        want,
        "step {step}"
    );
});
