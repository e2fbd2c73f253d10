//! Why a list or watch session ended.

use std::error::Error as StdError;
use std::fmt::Write as _;
use std::time::Duration;

use hyper::StatusCode;

use super::framing::FrameError;

/// The end of one list-and-watch session. Every variant but [`Closed`](Self::Closed) leads to a
/// retry after a backoff.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SessionError {
    #[error("request failed: {}", chain(.0))]
    Request(hyper_util::client::legacy::Error),
    #[error("building the request failed: {0}")]
    BuildRequest(http::Error),
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    #[error("authentication refused ({status}): {body}")]
    Auth { status: StatusCode, body: String },
    #[error("server answered {status}: {body}")]
    Status { status: StatusCode, body: String },
    #[error("reading the body failed: {}", chain(.0.as_ref()))]
    Body(Box<dyn StdError + Send + Sync>),
    #[error("list answer larger than {0} bytes")]
    ListTooLarge(usize),
    #[error("list answer is not a list: {0}")]
    ListDecode(serde_json::Error),
    #[error("malformed watch event: {0}")]
    MalformedEvent(serde_json::Error),
    #[error(transparent)]
    Frame(#[from] FrameError),
    #[error("no byte received for {0:?}")]
    Idle(Duration),
    #[error("watch stream ended")]
    Ended,
    #[error("server no longer has the history since revision {since}")]
    HistoryGone { since: u64 },
    #[error("sync is shutting down")]
    Closed,
}

impl SessionError {
    /// Whether the next session must start with a full list. After a transport failure a
    /// resumable stream (known revision) just resumes; after broken or lost events it cannot.
    pub(crate) fn requires_relist(&self) -> bool {
        matches!(
            self,
            SessionError::MalformedEvent(_)
                | SessionError::Frame(_)
                | SessionError::HistoryGone { .. }
        )
    }

    /// The HTTP status the server answered with, if that is why the session ended.
    pub(crate) fn status(&self) -> Option<StatusCode> {
        match self {
            SessionError::Auth { status, .. } | SessionError::Status { status, .. } => {
                Some(*status)
            }
            _ => None,
        }
    }
}

/// An error and its sources, `: `-separated (hyper's own messages are terse, the cause is in the
/// sources: "client error (Connect): tcp connect error: Connection refused").
pub(crate) fn chain(error: &(dyn StdError + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let _ = write!(text, ": {cause}");
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("outer")]
    struct Outer(#[source] std::io::Error);

    #[test]
    fn chain_joins_sources() {
        let e = Outer(std::io::Error::other("inner"));
        assert_eq!(chain(&e), "outer: inner");
    }
}
