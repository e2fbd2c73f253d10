//! The frames of RFC 6455: header parsing and encoding, masking.

use std::io;

use crate::protocol::MAX_MESSAGE_BYTES;

/// The longest frame header: 2 bytes, an 8-byte length, a 4-byte mask.
pub(super) const MAX_HEADER: usize = 14;

/// The longest control frame payload.
pub(super) const MAX_CONTROL_PAYLOAD: usize = 125;

pub(super) const OP_CONTINUATION: u8 = 0x0;
pub(super) const OP_TEXT: u8 = 0x1;
pub(super) const OP_BINARY: u8 = 0x2;
pub(super) const OP_CLOSE: u8 = 0x8;
pub(super) const OP_PING: u8 = 0x9;
pub(super) const OP_PONG: u8 = 0xa;

/// The close code sent on shutdown: normal closure.
pub(super) const CLOSE_NORMAL: u16 = 1000;

/// A WebSocket protocol violation by the peer.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("a reserved bit is set in a WebSocket frame (no extension was negotiated)")]
    ReservedBits,
    #[error("reserved WebSocket opcode {0:#x}")]
    ReservedOpcode(u8),
    #[error("a fragmented WebSocket control frame")]
    FragmentedControl,
    #[error("a WebSocket control frame of {0} bytes (at most 125)")]
    ControlTooLong(u64),
    #[error("an unmasked frame from the WebSocket client")]
    Unmasked,
    #[error("a masked frame from the WebSocket server")]
    Masked,
    #[error("a WebSocket message of more than {MAX_MESSAGE_BYTES} bytes")]
    TooLarge,
    #[error("a text message on a binary tunnel")]
    Text,
    #[error("a WebSocket continuation frame outside a fragmented message")]
    UnexpectedContinuation,
    #[error("a new WebSocket message inside a fragmented one")]
    ExpectedContinuation,
}

impl From<FrameError> for io::Error {
    fn from(e: FrameError) -> Self {
        io::Error::new(io::ErrorKind::InvalidData, e)
    }
}

/// A parsed frame header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Header {
    pub(super) fin: bool,
    pub(super) opcode: u8,
    pub(super) mask: Option<[u8; 4]>,
    pub(super) len: u64,
    /// Bytes the header itself takes.
    pub(super) size: usize,
}

impl Header {
    pub(super) fn is_control(&self) -> bool {
        self.opcode & 0x8 != 0
    }
}

/// Parses a frame header from the start of `b`; `None` while it is incomplete. Checks what
/// does not depend on the connection's state: reserved bits and opcodes, control frame rules,
/// the frame length bound.
pub(super) fn parse_header(b: &[u8]) -> Result<Option<Header>, FrameError> {
    let Some(&b0) = b.first() else {
        return Ok(None);
    };
    if b0 & 0x70 != 0 {
        return Err(FrameError::ReservedBits);
    }
    let fin = b0 & 0x80 != 0;
    let opcode = b0 & 0x0f;
    if !matches!(
        opcode,
        OP_CONTINUATION | OP_TEXT | OP_BINARY | OP_CLOSE | OP_PING | OP_PONG
    ) {
        return Err(FrameError::ReservedOpcode(opcode));
    }
    let Some(&b1) = b.get(1) else {
        return Ok(None);
    };
    let masked = b1 & 0x80 != 0;
    let (len, mut size) = match b1 & 0x7f {
        126 => {
            let Some(l) = b.get(2..4) else {
                return Ok(None);
            };
            (u64::from(u16::from_be_bytes([l[0], l[1]])), 4)
        }
        127 => {
            let Some(l) = b.get(2..10) else {
                return Ok(None);
            };
            let mut n = [0u8; 8];
            n.copy_from_slice(l);
            (u64::from_be_bytes(n), 10)
        }
        short => (u64::from(short), 2),
    };
    // Refused as soon as the length is known.
    if opcode & 0x8 != 0 {
        if !fin {
            return Err(FrameError::FragmentedControl);
        }
        if len > MAX_CONTROL_PAYLOAD as u64 {
            return Err(FrameError::ControlTooLong(len));
        }
    } else if len > MAX_MESSAGE_BYTES as u64 {
        return Err(FrameError::TooLarge);
    }
    let mask = if masked {
        let Some(m) = b.get(size..size + 4) else {
            return Ok(None);
        };
        size += 4;
        Some([m[0], m[1], m[2], m[3]])
    } else {
        None
    };
    Ok(Some(Header {
        fin,
        opcode,
        mask,
        len,
        size,
    }))
}

/// Writes a frame header (FIN set) into `out`; returns its length.
pub(super) fn encode_header(
    out: &mut [u8; MAX_HEADER],
    opcode: u8,
    len: usize,
    mask: Option<[u8; 4]>,
) -> usize {
    out[0] = 0x80 | opcode;
    let mask_bit = if mask.is_some() { 0x80 } else { 0 };
    let mut size = if len < 126 {
        out[1] = mask_bit | len as u8;
        2
    } else if let Ok(short) = u16::try_from(len) {
        out[1] = mask_bit | 126;
        out[2..4].copy_from_slice(&short.to_be_bytes());
        4
    } else {
        out[1] = mask_bit | 127;
        out[2..10].copy_from_slice(&(len as u64).to_be_bytes());
        10
    };
    if let Some(key) = mask {
        out[size..size + 4].copy_from_slice(&key);
        size += 4;
    }
    size
}

/// XORs `data` with the mask `key`, `data` starting `offset` bytes into the frame payload.
pub(super) fn apply_mask(data: &mut [u8], key: [u8; 4], offset: usize) {
    let mut k = [0u8; 4];
    for (i, b) in k.iter_mut().enumerate() {
        *b = key[(offset + i) % 4];
    }
    let word = u32::from_ne_bytes(k);
    let mut chunks = data.chunks_exact_mut(4);
    for c in &mut chunks {
        let w = u32::from_ne_bytes([c[0], c[1], c[2], c[3]]) ^ word;
        c.copy_from_slice(&w.to_ne_bytes());
    }
    for (b, m) in chunks.into_remainder().iter_mut().zip(k) {
        *b ^= m;
    }
}
