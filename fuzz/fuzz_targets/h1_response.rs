//! The gateway's upstream client reading a response: the head parser, then the body decoder
//! its framing picks. Byte 0: bit 0 says the request was `HEAD`; the other bits seed a read
//! size. The rest is what the upstream sends. Invariants: an accepted head is the same when
//! parsed from its own bytes alone; written out by the native server and parsed again it has
//! the same status and headers (but for the framing, `date` and `connection` ones the writer
//! owns); a bodiless answer is framed empty; its body decodes to the same data, end and
//! verdict for any split of the input.
#![no_main]

use bytes::BytesMut;
use net::h1::fuzzing::{
    BodyDecoder, BodyFraming, MAX_HEADERS, Piece, encode_response_head, response_head,
};
use http::HeaderMap;
use libfuzzer_sys::fuzz_target;

fn body(framing: BodyFraming, input: &[u8], step: usize) -> (Vec<u8>, Option<usize>, bool) {
    let mut d = BodyDecoder::new(framing);
    let mut buf = BytesMut::new();
    let mut out = Vec::new();
    let mut fed = 0;
    loop {
        match d.decode(&mut buf) {
            Ok(Piece::Data(data)) => out.extend_from_slice(&data),
            Ok(Piece::End) => return (out, Some(fed - buf.len()), false),
            Ok(Piece::More) if fed == input.len() => return (out, None, false),
            Ok(Piece::More) => {
                let n = step.min(input.len() - fed);
                buf.extend_from_slice(&input[fed..fed + n]);
                fed += n;
            }
            Err(_) => return (out, None, true),
        }
    }
}

fn owned_by_writer(headers: &HeaderMap) -> HeaderMap {
    let mut h = headers.clone();
    for name in ["content-length", "date", "connection"] {
        h.remove(name);
    }
    h
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, input)) = data.split_first() else {
        return;
    };
    let head_request = mode & 1 == 1;
    let Some(Ok(head)) = response_head(input, head_request) else {
        return;
    };
    let again = response_head(&input[..head.len], head_request).and_then(Result::ok);
    let again = again.expect("the head alone parses");
    assert_eq!(again.response.status(), head.response.status());
    assert_eq!(again.response.headers(), head.response.headers());
    assert_eq!(again.framing, head.framing);

    let status = head.response.status();
    if head_request || status.is_informational() || status == 204 || status == 304 {
        assert_eq!(head.framing, BodyFraming::Empty);
    }
    if head.framing == BodyFraming::UntilClose {
        assert!(!head.keep_alive);
    }
    // The writer adds up to three lines (framing, `date`, `connection`): past the header cap
    // the re-encoded head is refused as it should be.
    if head.response.headers().len() + 3 > MAX_HEADERS {
        return;
    }
    let encoded = encode_response_head(status, head.response.headers(), head.keep_alive);
    let back = match response_head(&encoded, head_request) {
        Some(Ok(back)) => back,
        other => panic!(
            "re-encoded head refused: {other:?}\n{:?}",
            String::from_utf8_lossy(&encoded)
        ),
    };
    assert_eq!(back.len, encoded.len());
    assert_eq!(back.response.status(), status);
    assert_eq!(
        owned_by_writer(back.response.headers()),
        owned_by_writer(head.response.headers())
    );

    let rest = &input[head.len..];
    let whole = body(head.framing, rest, rest.len().max(1));
    assert_eq!(body(head.framing, rest, 1), whole, "byte by byte");
    let step = usize::from(mode >> 1) + 1;
    assert_eq!(body(head.framing, rest, step), whole, "step {step}");
});
