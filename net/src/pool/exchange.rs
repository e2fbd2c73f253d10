//! A request encoded for the wire and driven on a connection up to its response head.

use std::pin::Pin;
use std::task::{Context, Poll, Waker, ready};

use bytes::Bytes;
use http::{Method, Request, header};
use http_body::Frame;
use tokio::time::Instant;

use super::RequestBody;
use super::conn::Conn;
use super::dial::host;
use super::error::{PoolError, body_failed};
use super::outgoing::Outgoing;
use crate::BoxError;
use crate::h1::client::{self, RequestFraming, ResponseHead};

/// A request encoded for the wire and ready to go on a connection
/// ([`Pool::send_keyed`](super::Pool::send_keyed)): its head and first piece of body, and the rest
/// of its body. It survives an attempt that wrote nothing, for the next connection.
#[derive(Debug)]
pub struct Prepared<B> {
    pub(super) out: Outgoing,
    body: B,
    chunked: bool,
    pub(super) body_done: bool,
    head_request: bool,
    pub(super) scanned: usize,
    /// Everything was written but the transport's flush did not finish: it is polled again
    /// until it does (a TLS stream holds the last records until then).
    unflushed: bool,
    /// The response head is due by then ([`Prepared::within`]).
    pub(super) deadline: Option<Instant>,
}

/// How an exchange failed.
pub(super) enum ExchangeError {
    /// Nothing of the request was written: another connection may take it.
    Unsent(BoxError),
    /// The upstream may have seen (part of) the request.
    Failed(BoxError),
    /// The request body (the caller's) failed.
    Body(BoxError),
    /// No response head came by the deadline.
    TimedOut,
}

impl<B: RequestBody> Prepared<B> {
    /// Encodes `req` (`Host` from its URI's authority when it has no `Host` header; the
    /// target in origin form) and takes the first piece of its body when it is ready now.
    ///
    /// Not async: a body that is not ready is polled again, with the sending task's waker, once
    /// the head is written (`Prepared::poll`); a buffered body (the gateway's) is always
    /// ready. Building it before any future keeps the request itself out of the sending
    /// future's state.
    pub fn new(req: Request<B>) -> Result<Self, PoolError> {
        let (parts, body) = req.into_parts();
        let framing = RequestFraming::choose(
            &parts.method,
            body.size_hint().exact(),
            parts.headers.contains_key(header::CONTENT_LENGTH),
        );
        let chunked = framing == RequestFraming::Chunked;
        let mut out = Outgoing::default();
        client::encode_head(
            &mut out.head,
            &parts.method,
            parts.uri.path_and_query().map_or("/", |p| p.as_str()),
            host(&parts.uri),
            &parts.headers,
            framing,
        );
        let mut prepared = Self {
            out,
            body,
            chunked,
            body_done: framing == RequestFraming::None,
            head_request: parts.method == Method::HEAD,
            scanned: 0,
            unflushed: false,
            deadline: None,
        };
        if !prepared.body_done {
            // A piece of body that is ready at once (all of a buffered one) goes out with
            // the head, in one write. If none is, the no-op waker registered here is replaced
            // by the task's own when `poll` asks again.
            let mut cx = Context::from_waker(Waker::noop());
            if let Poll::Ready(frame) = Pin::new(&mut prepared.body).poll_frame(&mut cx) {
                prepared.take(frame).map_err(body_failed)?;
            }
        }
        Ok(prepared)
    }

    /// The response head is due by `deadline`: past it (dialling, writing or waiting), the exchange
    /// fails with [`PoolErrorKind::FirstByteTimeout`](super::PoolErrorKind::FirstByteTimeout) and
    /// its connection is closed.
    #[must_use]
    pub fn within(mut self, deadline: Instant) -> Self {
        self.deadline = Some(deadline);
        self
    }

    /// Queues the body's next frame (`None`: its end) behind what is queued.
    fn take(&mut self, frame: Option<Result<Frame<Bytes>, B::Error>>) -> Result<(), BoxError> {
        match frame {
            Some(Ok(frame)) => {
                let last = self.body.is_end_stream();
                self.body_done = last;
                match frame.into_data() {
                    Ok(data) => self.out.push_body(data, self.chunked, last),
                    // Trailers are not forwarded.
                    Err(_) if last && self.chunked => self.out.push_body(Bytes::new(), true, true),
                    Err(_) => {}
                }
            }
            None => {
                self.body_done = true;
                if self.chunked {
                    self.out.push_body(Bytes::new(), true, true);
                }
            }
            Some(Err(e)) => return Err(e.into()),
        }
        Ok(())
    }

    /// Drives the exchange on `conn` until the response head, within the deadline if any.
    pub(super) fn poll(
        &mut self,
        cx: &mut Context<'_>,
        conn: &mut Conn,
    ) -> Poll<Result<ResponseHead, ExchangeError>> {
        let polled = self.poll_exchange(cx, conn);
        if polled.is_pending()
            && let Some(deadline) = self.deadline
        {
            ready!(conn.poll_deadline(cx, deadline));
            return Poll::Ready(Err(ExchangeError::TimedOut));
        }
        polled
    }

    fn poll_exchange(
        &mut self,
        cx: &mut Context<'_>,
        conn: &mut Conn,
    ) -> Poll<Result<ResponseHead, ExchangeError>> {
        loop {
            // The response head ends the exchange, also when it comes before the body was all
            // sent (an early error answer).
            match conn.poll_head(cx, &mut self.scanned, self.head_request) {
                Poll::Ready(Ok(head)) => return Poll::Ready(Ok(head)),
                Poll::Ready(Err(e)) if !self.out.sent => {
                    return Poll::Ready(Err(ExchangeError::Unsent(e.into())));
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Err(ExchangeError::Failed(e.into()))),
                Poll::Pending => {}
            }
            // Also when everything was taken but the flush was pending: the next poll must
            // flush again, or the last TLS records wait in rustls while the upstream waits for
            // them.
            if !self.out.is_empty() || self.unflushed {
                self.unflushed = true;
                match ready!(conn.poll_write_out(cx, &mut self.out)) {
                    Ok(()) => self.unflushed = false,
                    Err(e) if !self.out.sent => {
                        return Poll::Ready(Err(ExchangeError::Unsent(e.into())));
                    }
                    Err(e) => return Poll::Ready(Err(ExchangeError::Failed(e.into()))),
                }
            }
            if self.body_done {
                // Everything is out; the head's read is registered.
                return Poll::Pending;
            }
            let frame = ready!(Pin::new(&mut self.body).poll_frame(cx));
            if let Err(e) = self.take(frame) {
                return Poll::Ready(Err(ExchangeError::Body(e)));
            }
        }
    }
}
