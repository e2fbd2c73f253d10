//! The native HTTP/1 chunked decoder, which reads client request bodies on the server and
//! upstream response bodies in the client. The first byte seeds a read size; the rest is the
//! body. Invariants: the same data, end and verdict for any split of the input; a body that
//! ends is exactly what a line-by-line reading of RFC 9112 §7.1 accepts, with the same data and
//! the same bytes consumed.
#![no_main]

use bytes::BytesMut;
use net::h1::fuzzing::{BodyDecoder, BodyFraming, Piece};
use libfuzzer_sys::fuzz_target;

const MAX_CHUNK_LINE: usize = 4096;
const MAX_TRAILERS: usize = 16 * 1024;

#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    /// The body ended after this many bytes.
    End(usize),
    /// The input ended first.
    More,
    Error,
}

fn decode(input: &[u8], step: usize) -> (Vec<u8>, Outcome) {
    let mut d = BodyDecoder::new(BodyFraming::Chunked);
    let mut buf = BytesMut::new();
    let mut out = Vec::new();
    let mut fed = 0;
    loop {
        match d.decode(&mut buf) {
            Ok(Piece::Data(data)) => out.extend_from_slice(&data),
            Ok(Piece::End) => return (out, Outcome::End(fed - buf.len())),
            Ok(Piece::More) => {
                if fed == input.len() {
                    return (out, Outcome::More);
                }
                let n = step.min(input.len() - fed);
                buf.extend_from_slice(&input[fed..fed + n]);
                fed += n;
            }
            Err(_) => return (out, Outcome::Error),
        }
    }
}

fn tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

fn skip_ws(s: &[u8]) -> &[u8] {
    let n = s.iter().take_while(|&&b| b == b' ' || b == b'\t').count();
    &s[n..]
}

fn take_while(s: &[u8], f: impl Fn(u8) -> bool) -> (&[u8], &[u8]) {
    let n = s.iter().take_while(|&&b| f(b)).count();
    s.split_at(n)
}

/// The size of a chunk-size line (without its CRLF), if the line is valid.
fn size_line(line: &[u8]) -> Option<u64> {
    let (digits, mut rest) = take_while(line, |b| b.is_ascii_hexdigit());
    if digits.is_empty() {
        return None;
    }
    let mut size = 0u64;
    for &d in digits {
        size = size
            .checked_mul(16)?
            .checked_add(u64::from((d as char).to_digit(16)?))?;
    }
    loop {
        rest = skip_ws(rest);
        let Some(after) = rest.strip_prefix(b";") else {
            return rest.is_empty().then_some(size);
        };
        let (name, after) = take_while(skip_ws(after), tchar);
        if name.is_empty() {
            return None;
        }
        rest = skip_ws(after);
        if let Some(after) = rest.strip_prefix(b"=") {
            let after = skip_ws(after);
            if let Some(mut q) = after.strip_prefix(b"\"") {
                loop {
                    match q.split_first()? {
                        (b'"', r) => {
                            rest = r;
                            break;
                        }
                        (b'\\', r) => {
                            let (&e, r) = r.split_first()?;
                            if !(e == b'\t' || e == b' ' || (0x21..=0x7e).contains(&e) || e >= 0x80)
                            {
                                return None;
                            }
                            q = r;
                        }
                        (&c, r) => {
                            if !(c == b'\t' || c == b' ' || (0x21..=0x7e).contains(&c) || c >= 0x80)
                            {
                                return None;
                            }
                            q = r;
                        }
                    }
                }
            } else {
                let (value, r) = take_while(after, tchar);
                if value.is_empty() {
                    return None;
                }
                rest = r;
            }
        }
    }
}

fn field_line(line: &[u8]) -> bool {
    let (name, rest) = take_while(line, tchar);
    let Some(value) = rest.strip_prefix(b":") else {
        return false;
    };
    !name.is_empty()
        && value
            .iter()
            .all(|&b| b == b'\t' || b == b' ' || (0x21..=0x7e).contains(&b) || b >= 0x80)
}

/// The whole body read line by line: `Some((data, consumed))` when a complete, valid body
/// starts `input`.
fn reference(input: &[u8]) -> Option<(Vec<u8>, usize)> {
    let mut at = 0;
    let mut data = Vec::new();
    let line = |from: usize| -> Option<(&[u8], usize)> {
        let end = from + input[from..].windows(2).position(|w| w == b"\r\n")?;
        Some((&input[from..end], end + 2))
    };
    loop {
        let (text, next) = line(at)?;
        if text.len() + 1 > MAX_CHUNK_LINE {
            return None;
        }
        let size = size_line(text)?;
        at = next;
        if size == 0 {
            let start = at;
            loop {
                let (text, next) = line(at)?;
                if next - start > MAX_TRAILERS {
                    return None;
                }
                at = next;
                if text.is_empty() {
                    return Some((data, at));
                }
                if !field_line(text) {
                    return None;
                }
            }
        }
        let end = at.checked_add(usize::try_from(size).ok()?)?;
        data.extend_from_slice(input.get(at..end)?);
        if input.get(end..end + 2)? != b"\r\n" {
            return None;
        }
        at = end + 2;
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&seed, input)) = data.split_first() else {
        return;
    };
    let whole = decode(input, input.len().max(1));
    assert_eq!(decode(input, 1), whole, "byte by byte");
    let step = usize::from(seed) + 1;
    assert_eq!(decode(input, step), whole, "step {step}");
    match (&whole, reference(input)) {
        ((body, Outcome::End(n)), Some((want, m))) => {
            assert_eq!(body, &want, "data");
            assert_eq!(*n, m, "consumed");
        }
        ((_, Outcome::End(_)), None) => panic!("accepted a body the reference refuses"),
        (_, Some(_)) => panic!("refused a body the reference accepts: {:?}", whole.1),
        _ => {}
    }
});
