//! The single owner of the mirrored state: applies changes, rebuilds and publishes snapshots.
//!
//! Resource tasks only send [`Message`]s; one task owns the maps, so nothing is locked. It drains
//! every pending message before rebuilding, so a burst (a re-list, a GPUStack stream opening
//! with every row) costs one [`RoutingSnapshot::build`], not one per event.

use std::collections::BTreeMap;
use std::sync::Arc;

use tokio::sync::{mpsc, watch};

use super::resource::{Change, Message, Resource, ResourceKind, Update};
use super::{Shared, SyncedObjects};
use crate::routing::RoutingSnapshot;

/// Messages applied at most per rebuild, so that a flood cannot postpone publishing forever.
const MAX_BATCH: usize = 1024;

/// Owns the mirrored collections and publishes what they route.
#[derive(Debug)]
pub(crate) struct Merger {
    objects: SyncedObjects,
    /// Which resources have been listed at least once (indexed by [`ResourceKind::index`]).
    listed: [bool; ResourceKind::ALL.len()],
    /// The last published snapshot, to skip publishing one that routes the same.
    published: Arc<RoutingSnapshot>,
    shared: Arc<Shared>,
    snapshots: watch::Sender<Arc<RoutingSnapshot>>,
    synced: watch::Sender<bool>,
}

impl Merger {
    pub(crate) fn new(
        shared: Arc<Shared>,
        snapshots: watch::Sender<Arc<RoutingSnapshot>>,
        synced: watch::Sender<bool>,
    ) -> Self {
        let published = Arc::clone(&snapshots.borrow());
        Self {
            objects: SyncedObjects::default(),
            listed: [false; ResourceKind::ALL.len()],
            published,
            shared,
            snapshots,
            synced,
        }
    }

    /// Applies messages until every resource task is gone (or the task is cancelled).
    pub(crate) async fn run(mut self, mut messages: mpsc::Receiver<Message>) {
        while let Some(first) = messages.recv().await {
            let mut changed = self.apply(first);
            for _ in 1..MAX_BATCH {
                let Ok(message) = messages.try_recv() else {
                    break;
                };
                changed |= self.apply(message);
            }
            if changed {
                self.publish();
            }
        }
    }

    /// Applies one change; `true` when it changed anything.
    pub(crate) fn apply(&mut self, message: Message) -> bool {
        let mut changed = false;
        if message.revision > self.objects.revision {
            self.objects.revision = message.revision;
            changed = true;
        }
        let objects = &mut self.objects;
        let (kind, applied) = match message.update {
            Update::Workers(c) => (ResourceKind::Workers, apply(&mut objects.workers, c)),
            Update::ModelInstances(c) => (
                ResourceKind::ModelInstances,
                apply(&mut objects.instances, c),
            ),
            Update::Models(c) => (ResourceKind::Models, apply(&mut objects.models, c)),
            Update::Credentials(c) => (
                ResourceKind::Credentials,
                apply(&mut objects.credentials, c),
            ),
        };
        changed |= applied.changed;
        if applied.listed && !self.listed[kind.index()] {
            self.listed[kind.index()] = true;
            changed = true;
        }
        changed
    }

    /// Whether every resource has been listed once.
    pub(crate) fn is_synced(&self) -> bool {
        self.listed.iter().all(|&listed| listed)
    }

    /// Publishes the objects, and once synced, the snapshot they route (if it routes anything
    /// differently), then the synced flag: a reader that sees `synced` also sees its snapshot.
    pub(crate) fn publish(&mut self) {
        self.shared.objects.store(Arc::new(self.objects.clone()));
        // Before every resource is listed a snapshot would be partial (instances without their
        // workers, no keys): keep the empty one until the first complete state.
        if !self.is_synced() {
            return;
        }
        let o = &self.objects;
        let snapshot = RoutingSnapshot::build(
            o.workers.values(),
            o.instances.values(),
            o.models.values(),
            o.credentials.values(),
            o.revision,
        );
        if !routes_alike(&snapshot, &self.published) {
            let snapshot = Arc::new(snapshot);
            self.shared.snapshot.store(Arc::clone(&snapshot));
            self.snapshots.send_replace(Arc::clone(&snapshot));
            self.published = snapshot;
        }
        self.synced
            .send_if_modified(|synced| !std::mem::replace(synced, true));
    }
}

/// What applying one change did.
struct Applied {
    changed: bool,
    /// The change was a complete list.
    listed: bool,
}

fn apply<T: Resource>(map: &mut Arc<BTreeMap<i64, T>>, change: Change<T>) -> Applied {
    let (changed, listed) = match change {
        Change::Replace(items) => {
            let fresh: BTreeMap<i64, T> = items.into_iter().map(|t| (t.id(), t)).collect();
            let changed = **map != fresh;
            if changed {
                *map = Arc::new(fresh);
            }
            (changed, true)
        }
        Change::Upsert(item) => {
            // GPUStack streams open with every row again: skip the copy-on-write for those.
            let changed = map.get(&item.id()) != Some(&item);
            if changed {
                Arc::make_mut(map).insert(item.id(), item);
            }
            (changed, false)
        }
        Change::Delete(id) => {
            let changed = map.contains_key(&id);
            if changed {
                Arc::make_mut(map).remove(&id);
            }
            (changed, false)
        }
    };
    Applied { changed, listed }
}

/// Whether two snapshots route and authenticate the same way at the same revision.
fn routes_alike(a: &RoutingSnapshot, b: &RoutingSnapshot) -> bool {
    a.revision == b.revision && a.models == b.models && a.credentials == b.credentials
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{
        Credential, InstanceState, Model, ModelInstance, ProxyMode, Worker, WorkerState,
    };

    fn worker(id: i64, state: WorkerState) -> Worker {
        serde_json::from_value(serde_json::json!({
            "id": id, "name": format!("w{id}"), "cluster_id": 1, "ip": "10.0.0.1",
            "state": state, "proxy_mode": ProxyMode::Direct,
        }))
        .unwrap()
    }

    fn instance(id: i64, state: InstanceState) -> ModelInstance {
        serde_json::from_value(serde_json::json!({
            "id": id, "model_id": 1, "worker_id": 1, "port": 40000, "state": state,
        }))
        .unwrap()
    }

    fn model() -> Model {
        serde_json::from_value(serde_json::json!({"id": 1, "name": "m"})).unwrap()
    }

    fn message(update: Update, revision: Option<u64>) -> Message {
        Message { update, revision }
    }

    struct Harness {
        merger: Merger,
        shared: Arc<Shared>,
        snapshots: watch::Receiver<Arc<RoutingSnapshot>>,
        synced: watch::Receiver<bool>,
    }

    fn harness() -> Harness {
        let shared = Arc::new(Shared::new());
        let (snapshot_tx, snapshots) = watch::channel(shared.snapshot.load_full());
        let (synced_tx, synced) = watch::channel(false);
        let merger = Merger::new(Arc::clone(&shared), snapshot_tx, synced_tx);
        Harness {
            merger,
            shared,
            snapshots,
            synced,
        }
    }

    fn list_all(h: &mut Harness) {
        let updates = [
            Update::Workers(Change::Replace(vec![worker(1, WorkerState::Ready)])),
            Update::ModelInstances(Change::Replace(vec![instance(7, InstanceState::Running)])),
            Update::Models(Change::Replace(vec![model()])),
            Update::Credentials(Change::Replace(Vec::<Credential>::new())),
        ];
        for update in updates {
            h.merger.apply(message(update, None));
        }
    }

    #[test]
    fn publishes_nothing_partial_before_every_resource_is_listed() {
        let mut h = harness();
        h.merger.apply(message(
            Update::Workers(Change::Replace(vec![worker(1, WorkerState::Ready)])),
            None,
        ));
        h.merger.publish();
        assert!(!h.merger.is_synced());
        assert!(!h.snapshots.has_changed().unwrap());
        assert!(!*h.synced.borrow());
        assert_eq!(h.shared.objects.load().workers.len(), 1);

        list_all(&mut h);
        h.merger.publish();
        assert!(*h.synced.borrow());
        let snapshot = h.snapshots.borrow_and_update().clone();
        assert_eq!(snapshot.route("m").unwrap().endpoints[0].instance_id, 7);
        assert!(Arc::ptr_eq(&snapshot, &h.shared.snapshot.load_full()));
    }

    #[test]
    fn identical_changes_are_no_ops() {
        let mut h = harness();
        list_all(&mut h);
        h.merger.publish();
        h.snapshots.borrow_and_update();
        let again = message(
            Update::ModelInstances(Change::Upsert(instance(7, InstanceState::Running))),
            None,
        );
        assert!(!h.merger.apply(again));
        assert!(
            !h.merger
                .apply(message(Update::Models(Change::Delete(99)), None))
        );
        assert!(!h.merger.apply(message(
            Update::Models(Change::Replace(vec![model()])),
            None
        )));
    }

    #[test]
    fn revision_only_moves_forward_and_is_published() {
        let mut h = harness();
        list_all(&mut h);
        let upsert = |state, revision| {
            message(
                Update::ModelInstances(Change::Upsert(instance(7, state))),
                revision,
            )
        };
        assert!(h.merger.apply(upsert(InstanceState::Draining, Some(9))));
        assert!(h.merger.apply(upsert(InstanceState::Running, Some(5))));
        h.merger.publish();
        let snapshot = h.snapshots.borrow_and_update().clone();
        assert_eq!(snapshot.revision, Some(9));
        assert!(snapshot.route("m").is_some());
        assert_eq!(h.shared.objects.load().revision, Some(9));
    }

    #[test]
    fn unchanged_routes_are_not_republished() {
        let mut h = harness();
        list_all(&mut h);
        h.merger.publish();
        h.snapshots.borrow_and_update();
        // A label change alters the objects but not the routes.
        let mut w = worker(1, WorkerState::Ready);
        w.labels.insert("gpu".into(), "none".into());
        assert!(
            h.merger
                .apply(message(Update::Workers(Change::Upsert(w)), None))
        );
        h.merger.publish();
        assert!(!h.snapshots.has_changed().unwrap());
        assert_eq!(h.shared.objects.load().workers[&1].labels["gpu"], "none");
    }

    #[tokio::test]
    async fn run_coalesces_a_burst_into_one_publication() {
        let h = harness();
        let mut snapshots = h.snapshots.clone();
        let (tx, rx) = mpsc::channel(64);
        // Queue everything before the merger runs: one batch, one publication.
        for update in [
            Update::Workers(Change::Replace(vec![worker(1, WorkerState::Ready)])),
            Update::Models(Change::Replace(vec![model()])),
            Update::Credentials(Change::Replace(Vec::new())),
            Update::ModelInstances(Change::Replace(Vec::new())),
        ] {
            tx.send(message(update, None)).await.unwrap();
        }
        for id in 10..20 {
            let update =
                Update::ModelInstances(Change::Upsert(instance(id, InstanceState::Running)));
            tx.send(message(update, Some(id as u64))).await.unwrap();
        }
        tx.send(message(
            Update::ModelInstances(Change::Delete(10)),
            Some(20),
        ))
        .await
        .unwrap();
        drop(tx);
        h.merger.run(rx).await;
        let snapshot = snapshots.borrow_and_update().clone();
        assert_eq!(snapshot.revision, Some(20));
        assert_eq!(snapshot.route("m").unwrap().endpoints.len(), 9);
        // The merger ended with its input, and dropped the sender with it.
        assert!(snapshots.changed().await.is_err());
    }
}
