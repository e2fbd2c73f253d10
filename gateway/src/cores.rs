//! A gateway of several cores ([`net::cores`]): one [`Gateway`] per core, each serving the
//! connections its own listening socket accepts, with its own balancer, upstream pools and
//! counts, and its own copy of each routing snapshot.
//!
//! How exact what the cores share or split needs to be:
//! - requests in flight are counted per core: each core balances its own share of the
//!   traffic by them (power of two choices, the load bound); the engines' load readings,
//!   shared, carry what all cores sent;
//! - failures and ejection are shared ([`crate::balance::HealthTable`]), and a success writes
//!   them only when it changes something: an instance is ejected after the same number of
//!   failures whichever cores saw them;
//! - queued prefill and the prefix index are shared too, and written only by requests whose
//!   prompt has at least a block (language-model traffic, hundreds a second, not the plain
//!   API calls of a proxy benchmark): a prefix goes to the same instance from every core;
//! - the failed-authentication table, the pending- and open-connection caps and the draining
//!   flag are shared (written per failure, per connection, once);
//! - metrics are per core and summed when scraped.

use std::sync::Arc;

use arc_swap::ArcSwap;
use control_client::routing::RoutingSnapshot;
use net::cores::Cores;
use net::listener::SharedCaps;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::{Gateway, SnapshotSource, metrics};

/// The cores of one gateway.
#[derive(Debug)]
pub struct GatewayGroup {
    gateways: Vec<Gateway>,
    /// Each core's snapshot cell, in core order.
    cells: Vec<Arc<ArcSwap<RoutingSnapshot>>>,
    source: SnapshotSource,
    caps: SharedCaps,
}

impl GatewayGroup {
    pub(crate) fn new(
        gateways: Vec<Gateway>,
        cells: Vec<Arc<ArcSwap<RoutingSnapshot>>>,
        source: SnapshotSource,
        caps: SharedCaps,
    ) -> Self {
        Self {
            gateways,
            cells,
            source,
            caps,
        }
    }

    /// Each core's gateway.
    pub fn cores(&self) -> &[Gateway] {
        &self.gateways
    }

    /// Serves on `listeners` (one per core, [`net::cores::bind_reuseport`]) on `cores` until
    /// `shutdown` fires, then drains every core and returns. Snapshots are handed to the cores
    /// from the runtime this runs on.
    pub async fn serve(
        &self,
        listeners: Vec<std::net::TcpListener>,
        cores: &Cores,
        shutdown: CancellationToken,
    ) {
        self.publish();
        let fan_out = self.fan_out(shutdown.clone());
        let served = cores.spawn_with(listeners, |i, listener| {
            let gateway = self.gateways[i % self.gateways.len()].clone();
            let (shutdown, caps) = (shutdown.clone(), self.caps.clone());
            // Registered with the core's own event loop: made on the core.
            async move {
                match tokio::net::TcpListener::from_std(listener) {
                    Ok(listener) => {
                        gateway
                            .serve_with_caps(listener, shutdown, Some(caps))
                            .await
                    }
                    Err(e) => tracing::error!(error = %e, core = i, "cannot listen on this core"),
                }
            }
        });
        for core in served {
            let _ = core.await;
        }
        if let Some(task) = fan_out {
            task.abort();
        }
    }

    /// Copies the current snapshot to every core and forgets state of instances gone from it.
    fn publish(&self) {
        let snapshot = self.source.load();
        for (cell, gateway) in self.cells.iter().zip(&self.gateways) {
            cell.store(Arc::new(snapshot.detached()));
            gateway.inner.balancer.prune(&snapshot);
        }
    }

    /// Follows the source's snapshots until `shutdown` (a source without a channel is read once).
    fn fan_out(&self, shutdown: CancellationToken) -> Option<tokio::task::JoinHandle<()>> {
        let mut rx: watch::Receiver<Arc<RoutingSnapshot>> = match &self.source {
            SnapshotSource::Sync(sync) => sync.snapshots(),
            SnapshotSource::Watch(rx) => rx.clone(),
            SnapshotSource::Swap(_) => return None,
        };
        let group = Self {
            gateways: self.gateways.clone(),
            cells: self.cells.clone(),
            source: self.source.clone(),
            caps: self.caps.clone(),
        };
        // Ends at `shutdown` or with the source; `serve` aborts it when the cores are done.
        Some(net::task::spawn(async move {
            loop {
                tokio::select! {
                    () = shutdown.cancelled() => break,
                    changed = rx.changed() => {
                        if changed.is_err() {
                            break;
                        }
                        rx.borrow_and_update();
                        group.publish();
                    }
                }
            }
        }))
    }

    /// Marks every core draining (`/readyz` 503) without stopping them.
    pub fn set_draining(&self, draining: bool) {
        // The flag is shared: one store is enough.
        if let Some(g) = self.gateways.first() {
            g.set_draining(draining);
        }
    }

    /// Whether `/readyz` answers 200.
    pub fn is_ready(&self) -> bool {
        self.gateways.first().is_some_and(Gateway::is_ready)
    }

    /// The Prometheus text of all cores together.
    pub fn metrics_text(&self) -> String {
        metrics_of(&self.gateways)
    }
}

/// The metrics of `gateways`, the cores of one gateway, summed (`/metrics` of any core says the
/// same).
pub(crate) fn metrics_of(gateways: &[Gateway]) -> String {
    let mut out = metrics::Metrics::sum(gateways.iter().map(|g| &*g.inner.metrics)).render();
    crate::balance::Balancer::render_all(gateways.iter().map(|g| &g.inner.balancer), &mut out);
    if let Some(first) = gateways.first() {
        if let Some(loads) = &first.inner.engine_loads {
            out.push_str(&metrics::engine_loads(loads));
        }
        if let Some(probe) = &first.inner.staleness {
            out.push_str(&metrics::snapshot_age(probe()));
        }
        if let Some(telemetry) = &first.inner.telemetry {
            telemetry.render(&mut out);
        }
    }
    out
}
