//! Moving every worker's tunnel away before this server stops (several servers on one
//! database): each faden-dialect tunnel gets the move ping ([`MoveSignal`]), its worker dials
//! the next server and, once that tunnel serves, leaves this one with a go-away after the open
//! streams, so that no request meets a closed tunnel. GPUStack's tunnel clients have no such
//! signal: their tunnels stay until the server closes them.

use super::{Link, TunnelServer};

impl TunnelServer {
    /// Takes no new tunnel from now on, and asks every faden-dialect worker to move its tunnel
    /// to another server ([`TunnelServer::moved`] says when they all left).
    pub fn ask_to_move(&self) {
        self.inner.moving.cancel();
        let sessions = self.inner.sessions.read();
        let mut asked = 0;
        for moves in sessions.values().filter_map(|s| s.moves.as_ref()) {
            moves.request();
            asked += 1;
        }
        tracing::info!(
            tunnels = asked,
            "asking every worker to move its tunnel to another server"
        );
    }

    /// Returns once no faden-dialect tunnel is left here (every worker that could move has
    /// moved, and its streams here have ended).
    pub async fn moved(&self) {
        loop {
            let ended = self.inner.ended.notified();
            let left = self
                .inner
                .sessions
                .read()
                .values()
                .filter(|s| matches!(s.link, Link::Mux(_)))
                .count();
            if left == 0 {
                return;
            }
            ended.await;
        }
    }

    /// Whether `worker_id` has a tunnel here that takes new streams (one up, and not going
    /// away: a worker moving to another server says so on its old tunnel).
    pub fn takes_streams(&self, worker_id: i64) -> bool {
        self.inner
            .sessions
            .read()
            .get(&worker_id)
            .is_some_and(|s| match &s.link {
                Link::Mux(handle) => !handle.is_going_away(),
                Link::GpuStack(_) => true,
            })
    }
}
