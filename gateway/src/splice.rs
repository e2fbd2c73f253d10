//! Byte relays for connections taken over by `CONNECT`, and their drain at shutdown: the
//! worker proxy's instance relay and the proxy port's relays share this.

use std::time::Duration;

use http::Request;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// The open relays of one listener. Cheap to clone; clones share.
#[derive(Clone, Debug, Default)]
pub struct Relays {
    tasks: TaskTracker,
    /// Ends the relays still open when the drain timeout is over.
    hard_stop: CancellationToken,
}

impl Relays {
    pub fn new() -> Self {
        Self::default()
    }

    /// Spawns the relay of `req`'s connection: once hyper hands it over (after the 200 answer
    /// went out), bytes are copied both ways between it and `far` through one 8 KiB buffer per
    /// direction. Each direction's end (EOF) becomes a shutdown of the other side's write half
    /// (half-close passed on); an error on either side (a reset: the peer went away) ends
    /// both, which closes `far`.
    pub fn spawn<B, T>(&self, req: &mut Request<B>, far: T)
    where
        T: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let on_upgrade = hyper::upgrade::on(req);
        let stop = self.hard_stop.clone();
        self.tasks.spawn(async move {
            let upgraded = match on_upgrade.await {
                Ok(u) => u,
                Err(e) => {
                    tracing::debug!(error = %e, "CONNECT: the connection was not handed over");
                    return;
                }
            };
            let mut near = TokioIo::new(upgraded);
            let mut far = far;
            tokio::select! {
                r = tokio::io::copy_bidirectional(&mut near, &mut far) => {
                    if let Err(e) = r {
                        tracing::debug!(error = %e, "CONNECT: relay ended with an error");
                    }
                }
                () = stop.cancelled() => {}
            }
        });
    }

    /// Refuses new relays, waits up to `timeout` for the open ones to end, then ends the rest.
    pub async fn drain(&self, timeout: Duration, listener: &str) {
        self.tasks.close();
        if tokio::time::timeout(timeout, self.tasks.wait())
            .await
            .is_err()
        {
            tracing::warn!(
                listener,
                "drain timeout: closing the remaining CONNECT relays"
            );
        }
        self.hard_stop.cancel();
        self.tasks.wait().await;
    }
}
