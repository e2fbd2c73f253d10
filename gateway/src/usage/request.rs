//! The one request rewrite: asking a stream for its usage.

const INCLUDE_USAGE: &[u8] = br#""stream_options":{"include_usage":true},"#;

/// A streamed request body with `"stream_options":{"include_usage":true}` added right after
/// its opening `{`; every other byte is kept. Only for a body that
/// [`crate::route::read_json_request`] found to ask for a stream without `stream_options`
/// (`streamed_without_options`): a JSON object with a `stream` member, so a member follows the
/// one added. `None` when the body does not begin with `{`.
pub fn add_include_usage(body: &[u8]) -> Option<Vec<u8>> {
    let open = body.iter().position(|b| !b.is_ascii_whitespace())?;
    if body[open] != b'{' {
        return None;
    }
    let mut out = Vec::with_capacity(body.len() + INCLUDE_USAGE.len());
    out.extend_from_slice(&body[..=open]);
    out.extend_from_slice(INCLUDE_USAGE);
    out.extend_from_slice(&body[open + 1..]);
    Some(out)
}
