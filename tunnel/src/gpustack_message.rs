//! GPUStack's tunnel messages (`gpustack.websocket_proxy.message`, protocol version 1): one
//! binary WebSocket message each, `[version 0x01][type u8][payload]`, integers big-endian,
//! sessions named by a 16-byte UUID. A GPUStack worker's tunnel client speaks these instead of
//! yamux; the server asks it to dial a target per relayed connection.
//!
//! | type | payload |
//! |---|---|
//! | `0x01` connect request | session, u16 length + target URL (`tcp://host:port`) |
//! | `0x02` connect response | session, u8 success, u8 length + error (0: none) |
//! | `0x03` data | session, u8 compression (0 none, 1 gzip), u32 length + bytes |
//! | `0x04` disconnect | session, u8 length + error (0: none) |
//! | `0x05` heartbeat | u64 timestamp |
//!
//! Types `0x06`–`0x08` (client lists, server-to-server updates) are GPUStack's own server
//! mesh; a worker never sends them, and they are refused here. Decoding is stricter than
//! GPUStack's in two ways (`tunnel/tests/gpustack_messages.rs` checks both against vectors made
//! by GPUStack's own code): bytes after the last field and gzip data are errors. GPUStack's
//! tunnel client never sends either, and inflating a peer's data would let one message grow
//! without bound. Like GPUStack, a missing error length at the end means no error.

use bytes::{BufMut, Bytes, BytesMut};

/// The protocol version byte every message starts with.
pub const VERSION: u8 = 0x01;

/// A session id: the UUID's 16 bytes.
pub type SessionId = [u8; 16];

/// One message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Message {
    /// Server to client: dial `target` for `session`.
    ConnectRequest { session: SessionId, target: String },
    /// Client to server: whether the dial succeeded, and the error when it did not.
    ConnectResponse {
        session: SessionId,
        success: bool,
        error: Option<String>,
    },
    /// Bytes of `session`, either way.
    Data { session: SessionId, data: Bytes },
    /// `session` is over, either way, with an error when it failed.
    Disconnect {
        session: SessionId,
        error: Option<String>,
    },
    /// Keep-alive.
    Heartbeat { timestamp: u64 },
}

/// Why a message could not be read or written.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum MessageError {
    #[error("message too short")]
    Truncated,
    #[error("unsupported protocol version {0}")]
    Version(u8),
    #[error("unknown message type {0:#04x}")]
    UnknownType(u8),
    #[error("message type {0:#04x} is GPUStack's server-to-server traffic")]
    Unsupported(u8),
    #[error("{0} bytes after the message")]
    Trailing(usize),
    #[error("compressed data (compression {0}) is not accepted")]
    Compressed(u8),
    #[error("success flag {0} is neither 0 nor 1")]
    Flag(u8),
    #[error("a text field is not UTF-8")]
    NotUtf8,
    #[error("a {field} of {len} bytes does not fit its length prefix")]
    TooLong { field: &'static str, len: usize },
}

const CONNECT_REQUEST: u8 = 0x01;
const CONNECT_RESPONSE: u8 = 0x02;
const DATA: u8 = 0x03;
const DISCONNECT: u8 = 0x04;
const HEARTBEAT: u8 = 0x05;

impl Message {
    /// The message's session, when it has one.
    pub fn session(&self) -> Option<&SessionId> {
        match self {
            Message::ConnectRequest { session, .. }
            | Message::ConnectResponse { session, .. }
            | Message::Data { session, .. }
            | Message::Disconnect { session, .. } => Some(session),
            Message::Heartbeat { .. } => None,
        }
    }

    /// Reads one whole message; `data`'s bytes are shared, not copied.
    pub fn decode(message: &Bytes) -> Result<Message, MessageError> {
        let mut r = Reader {
            bytes: message,
            pos: 0,
        };
        let version = r.u8()?;
        if version != VERSION {
            return Err(MessageError::Version(version));
        }
        let kind = r.u8()?;
        let msg = match kind {
            CONNECT_REQUEST => {
                let session = r.session()?;
                let len = usize::from(r.u16()?);
                Message::ConnectRequest {
                    session,
                    target: r.text(len)?,
                }
            }
            CONNECT_RESPONSE => {
                let session = r.session()?;
                let success = match r.u8()? {
                    0 => false,
                    1 => true,
                    other => return Err(MessageError::Flag(other)),
                };
                Message::ConnectResponse {
                    session,
                    success,
                    error: r.error()?,
                }
            }
            DATA => {
                let session = r.session()?;
                let compression = r.u8()?;
                if compression != 0 {
                    return Err(MessageError::Compressed(compression));
                }
                let len = r.u32()? as usize;
                Message::Data {
                    session,
                    data: r.bytes(len)?,
                }
            }
            DISCONNECT => {
                let session = r.session()?;
                Message::Disconnect {
                    session,
                    error: r.error()?,
                }
            }
            HEARTBEAT => Message::Heartbeat {
                timestamp: r.u64()?,
            },
            0x06..=0x08 => return Err(MessageError::Unsupported(kind)),
            other => return Err(MessageError::UnknownType(other)),
        };
        match message.len() - r.pos {
            0 => Ok(msg),
            n => Err(MessageError::Trailing(n)),
        }
    }

    /// Writes the message as GPUStack's `pack()` does.
    pub fn encode(&self) -> Result<Bytes, MessageError> {
        let mut out = BytesMut::with_capacity(self.encoded_len());
        out.put_u8(VERSION);
        match self {
            Message::ConnectRequest { session, target } => {
                out.put_u8(CONNECT_REQUEST);
                out.put_slice(session);
                let len = u16::try_from(target.len()).map_err(|_| MessageError::TooLong {
                    field: "target",
                    len: target.len(),
                })?;
                out.put_u16(len);
                out.put_slice(target.as_bytes());
            }
            Message::ConnectResponse {
                session,
                success,
                error,
            } => {
                out.put_u8(CONNECT_RESPONSE);
                out.put_slice(session);
                out.put_u8(u8::from(*success));
                put_error(&mut out, error.as_deref())?;
            }
            Message::Data { session, data } => {
                out.put_u8(DATA);
                out.put_slice(session);
                out.put_u8(0);
                let len = u32::try_from(data.len()).map_err(|_| MessageError::TooLong {
                    field: "data",
                    len: data.len(),
                })?;
                out.put_u32(len);
                out.put_slice(data);
            }
            Message::Disconnect { session, error } => {
                out.put_u8(DISCONNECT);
                out.put_slice(session);
                put_error(&mut out, error.as_deref())?;
            }
            Message::Heartbeat { timestamp } => {
                out.put_u8(HEARTBEAT);
                out.put_u64(*timestamp);
            }
        }
        Ok(out.freeze())
    }

    fn encoded_len(&self) -> usize {
        2 + match self {
            Message::ConnectRequest { target, .. } => 16 + 2 + target.len(),
            Message::ConnectResponse { error, .. } => {
                16 + 2 + error.as_ref().map_or(0, String::len)
            }
            Message::Data { data, .. } => 16 + 1 + 4 + data.len(),
            Message::Disconnect { error, .. } => 16 + 1 + error.as_ref().map_or(0, String::len),
            Message::Heartbeat { .. } => 8,
        }
    }
}

/// An error text: a length byte (0: none) and the text. GPUStack writes `len(encoded)` into one
/// byte and fails on longer texts; faden refuses them before writing.
fn put_error(out: &mut BytesMut, error: Option<&str>) -> Result<(), MessageError> {
    match error.filter(|e| !e.is_empty()) {
        None => out.put_u8(0),
        Some(e) => {
            let len = u8::try_from(e.len()).map_err(|_| MessageError::TooLong {
                field: "error",
                len: e.len(),
            })?;
            out.put_u8(len);
            out.put_slice(e.as_bytes());
        }
    }
    Ok(())
}

struct Reader<'a> {
    bytes: &'a Bytes,
    pos: usize,
}

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], MessageError> {
        let end = self.pos.checked_add(n).ok_or(MessageError::Truncated)?;
        let slice = self
            .bytes
            .get(self.pos..end)
            .ok_or(MessageError::Truncated)?;
        self.pos = end;
        Ok(slice)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], MessageError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    fn u8(&mut self) -> Result<u8, MessageError> {
        Ok(self.array::<1>()?[0])
    }

    fn u16(&mut self) -> Result<u16, MessageError> {
        self.array().map(u16::from_be_bytes)
    }

    fn u32(&mut self) -> Result<u32, MessageError> {
        self.array().map(u32::from_be_bytes)
    }

    fn u64(&mut self) -> Result<u64, MessageError> {
        self.array().map(u64::from_be_bytes)
    }

    fn session(&mut self) -> Result<SessionId, MessageError> {
        self.array()
    }

    fn bytes(&mut self, n: usize) -> Result<Bytes, MessageError> {
        let start = self.pos;
        self.take(n)?;
        Ok(self.bytes.slice(start..start + n))
    }

    fn text(&mut self, n: usize) -> Result<String, MessageError> {
        let raw = self.take(n)?;
        std::str::from_utf8(raw)
            .map(str::to_owned)
            .map_err(|_| MessageError::NotUtf8)
    }

    /// A length byte and a text; 0, or nothing left, is none.
    fn error(&mut self) -> Result<Option<String>, MessageError> {
        if self.pos == self.bytes.len() {
            return Ok(None);
        }
        match usize::from(self.u8()?) {
            0 => Ok(None),
            n => self.text(n).map(Some),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use super::*;

    const S: SessionId = [7; 16];

    fn round_trip(msg: Message) {
        let bytes = msg.encode().unwrap();
        assert_eq!(Message::decode(&bytes).unwrap(), msg);
        // A proper prefix is short, or (cut before an optional error text) the same message
        // without its error; never another kind of message.
        for cut in 0..bytes.len() {
            match Message::decode(&bytes.slice(..cut)) {
                Err(MessageError::Truncated) => {}
                Ok(Message::Disconnect {
                    session,
                    error: None,
                }) => {
                    assert!(matches!(msg, Message::Disconnect { session: s, .. } if s == session));
                }
                Ok(Message::ConnectResponse { session, .. }) => {
                    assert!(
                        matches!(msg, Message::ConnectResponse { session: s, .. } if s == session)
                    );
                }
                other => panic!("{msg:?} cut at {cut}: {other:?}"),
            }
        }
        let mut longer = bytes.to_vec();
        longer.push(0);
        assert_eq!(
            Message::decode(&Bytes::from(longer)),
            Err(MessageError::Trailing(1))
        );
    }

    #[test]
    fn every_message_round_trips() {
        round_trip(Message::ConnectRequest {
            session: S,
            target: "tcp://127.0.0.1:40000".into(),
        });
        round_trip(Message::ConnectResponse {
            session: S,
            success: true,
            error: None,
        });
        round_trip(Message::ConnectResponse {
            session: S,
            success: false,
            error: Some("connection refused".into()),
        });
        round_trip(Message::Data {
            session: S,
            data: Bytes::from_static(b"GET / HTTP/1.1\r\n\r\n"),
        });
        round_trip(Message::Data {
            session: S,
            data: Bytes::new(),
        });
        round_trip(Message::Disconnect {
            session: S,
            error: None,
        });
        round_trip(Message::Disconnect {
            session: S,
            error: Some("reset".into()),
        });
        round_trip(Message::Heartbeat {
            timestamp: u64::MAX,
        });
    }

    #[test]
    fn bad_messages_are_named() {
        let decode = |b: &[u8]| Message::decode(&Bytes::copy_from_slice(b));
        assert_eq!(
            decode(&[2, 5, 0, 0, 0, 0, 0, 0, 0, 0]),
            Err(MessageError::Version(2))
        );
        assert_eq!(decode(&[1, 0x09]), Err(MessageError::UnknownType(9)));
        assert_eq!(decode(&[1, 0x06]), Err(MessageError::Unsupported(6)));
        let mut flag = vec![1, CONNECT_RESPONSE];
        flag.extend_from_slice(&S);
        flag.extend_from_slice(&[2, 0]);
        assert_eq!(decode(&flag), Err(MessageError::Flag(2)));
        let mut gz = vec![1, DATA];
        gz.extend_from_slice(&S);
        gz.extend_from_slice(&[1, 0, 0, 0, 0]);
        assert_eq!(decode(&gz), Err(MessageError::Compressed(1)));
        let mut bad_text = vec![1, DISCONNECT];
        bad_text.extend_from_slice(&S);
        bad_text.extend_from_slice(&[1, 0xff]);
        assert_eq!(decode(&bad_text), Err(MessageError::NotUtf8));
        // A data length past the end is short, whatever it claims.
        let mut huge = vec![1, DATA];
        huge.extend_from_slice(&S);
        huge.extend_from_slice(&[0, 0xff, 0xff, 0xff, 0xff, b'x']);
        assert_eq!(decode(&huge), Err(MessageError::Truncated));
    }

    #[test]
    fn texts_longer_than_their_prefix_are_refused_on_write() {
        let long = "e".repeat(256);
        let msg = Message::Disconnect {
            session: S,
            error: Some(long),
        };
        assert!(matches!(
            msg.encode(),
            Err(MessageError::TooLong {
                field: "error",
                len: 256
            })
        ));
    }
}
