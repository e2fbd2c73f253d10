//! The immutable routing snapshot the data plane reads on every request.
//!
//! Built from the control plane's workers, model instances, models and credentials (by
//! `crate::sync` or in-process by the server) and published whole: readers never see a
//! half-applied change and never take a lock.

use std::collections::HashMap;
use std::sync::Arc;

use chrono::{DateTime, Utc};

use crate::model::{
    Credential, InstanceState, Model, ModelInstance, ProxyMode, RoutePolicy, Scope, Worker,
    WorkerState,
};
use crate::tokens;

/// The hasher of the snapshot's maps (and of the gateway's own): foldhash, with a random seed.
/// The gateway looks up two keys per request in them (the presented key's access id, the model
/// name), and SipHash, std's default, showed in the per-request profile (docs/performance.md).
/// The stored keys come from the control plane, never from clients: a client chooses only what
/// is looked up, which cannot make a probe longer than the stored keys do.
pub type SnapshotHasher = foldhash::fast::RandomState;

/// Everything the gateway needs to route and authenticate a request.
#[derive(Clone, Debug, Default)]
pub struct RoutingSnapshot {
    /// Model name (as clients send it) → its routable instances (possibly none).
    pub models: HashMap<String, Arc<ModelRoute>, SnapshotHasher>,
    /// Access id → key digest and scope.
    pub credentials: HashMap<String, CredentialEntry, SnapshotHasher>,
    /// The control-plane revision this snapshot reflects, when the source reports one.
    pub revision: Option<u64>,
}

impl RoutingSnapshot {
    /// A copy sharing no reference count with this one: each core of a gateway reads its own
    /// copy, so that the counts its requests take are written by that core alone.
    pub fn detached(&self) -> Self {
        Self {
            models: self
                .models
                .iter()
                .map(|(name, route)| (name.clone(), Arc::new(ModelRoute::clone(route))))
                .collect(),
            credentials: self.credentials.clone(),
            revision: self.revision,
        }
    }
}

/// A model and the instances that may take traffic now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelRoute {
    pub model_id: i64,
    pub name: String,
    /// The model's routing policy; `None`: the gateway's default.
    pub policy: Option<RoutePolicy>,
    /// Sorted by instance id, so that the order is stable across snapshots.
    pub endpoints: Vec<Endpoint>,
}

/// One routable instance with what it takes to reach it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoint {
    pub instance_id: i64,
    pub model_id: i64,
    pub worker_id: i64,
    pub worker_name: String,
    pub cluster_id: i64,
    /// The worker's `advertise_address`, else its `ip`.
    pub address: String,
    /// The instance's own port (the `direct` path).
    pub instance_port: u16,
    /// The worker's reverse-proxy port (the `worker` path).
    pub worker_port: u16,
    pub proxy_mode: ProxyMode,
    /// The server proxy that relays to this worker's tunnel (the `tunnel` path).
    pub proxy_address: Option<String>,
}

/// A key the data plane accepts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CredentialEntry {
    pub id: i64,
    pub digest: [u8; 32],
    pub scope: Scope,
    pub expires_at: Option<DateTime<Utc>>,
}

/// Why a presented key was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum KeyRejection {
    #[error("malformed API key")]
    Malformed,
    #[error("unknown or revoked API key")]
    Unknown,
    #[error("API key has expired")]
    Expired,
}

impl RoutingSnapshot {
    /// Builds a snapshot. Only `running` instances with a port, on `ready` workers with an
    /// address, are routable; `tunnel` workers also need a `proxy_address` (their tunnel is up).
    /// An instance on a draining worker is routable only while no instance of its model on
    /// another worker is: the model's traffic moves once another one runs.
    pub fn build<'a>(
        workers: impl IntoIterator<Item = &'a Worker>,
        instances: impl IntoIterator<Item = &'a ModelInstance>,
        models: impl IntoIterator<Item = &'a Model>,
        credentials: impl IntoIterator<Item = &'a Credential>,
        revision: Option<u64>,
    ) -> Self {
        let workers: HashMap<i64, &Worker> = workers.into_iter().map(|w| (w.id, w)).collect();
        let model_names: HashMap<i64, (&str, Option<RoutePolicy>)> = models
            .into_iter()
            .map(|m| (m.id, (m.name.as_str(), m.route_policy)))
            .collect();

        // Every known model has a route, possibly without endpoints: the gateway answers
        // "no routable instance" (503) for those, and "unknown model" (404) only for the rest.
        let mut routes: HashMap<&str, ModelRoute> = model_names
            .iter()
            .map(|(&id, &(name, policy))| {
                let route = ModelRoute {
                    model_id: id,
                    name: name.to_owned(),
                    policy,
                    endpoints: Vec::new(),
                };
                (name, route)
            })
            .collect();
        // Endpoints on draining workers, kept apart until every model's others are known.
        let mut draining: Vec<(&str, Endpoint)> = Vec::new();
        for inst in instances {
            let Some(endpoint) = endpoint_of(inst, &workers) else {
                continue;
            };
            let Some(name) = model_names
                .get(&inst.model_id)
                .map(|(name, _)| *name)
                .or(inst.model_name.as_deref())
            else {
                continue;
            };
            if workers
                .get(&endpoint.worker_id)
                .is_some_and(|w| w.is_draining())
            {
                draining.push((name, endpoint));
                continue;
            }
            route_of(&mut routes, name, inst.model_id)
                .endpoints
                .push(endpoint);
        }
        for (name, endpoint) in draining {
            let route = route_of(&mut routes, name, endpoint.model_id);
            // Only where nothing else serves the model: a drain never stops a model early.
            let others = route
                .endpoints
                .iter()
                .any(|e| workers.get(&e.worker_id).is_some_and(|w| !w.is_draining()));
            if !others {
                route.endpoints.push(endpoint);
            }
        }
        let models = routes
            .into_iter()
            .map(|(name, mut route)| {
                route.endpoints.sort_unstable_by_key(|e| e.instance_id);
                (name.to_owned(), Arc::new(route))
            })
            .collect();

        let credentials = credentials
            .into_iter()
            .filter_map(|c| {
                let digest = tokens::digest_from_hex(&c.secret_digest)?;
                let entry = CredentialEntry {
                    id: c.id,
                    digest,
                    scope: c.scope,
                    expires_at: c.expires_at.map(|t| t.0),
                };
                Some((c.access_id.clone(), entry))
            })
            .collect();

        Self {
            models,
            credentials,
            revision,
        }
    }

    /// The route of a model, if the model is known (its endpoints may be empty).
    pub fn route(&self, model: &str) -> Option<&Arc<ModelRoute>> {
        self.models.get(model)
    }

    /// The route of a model only when it has at least one routable endpoint.
    pub fn routable(&self, model: &str) -> Option<&Arc<ModelRoute>> {
        self.models.get(model).filter(|r| !r.endpoints.is_empty())
    }

    /// Verifies a presented key against the synced digests.
    pub fn verify_key(&self, key: &str, now: DateTime<Utc>) -> Result<Scope, KeyRejection> {
        self.verify_key_lazily(key, || now)
    }

    /// [`verify_key`](Self::verify_key) with the time read only for a key that expires: most
    /// keys never do, and the gateway checks one per request.
    pub fn verify_key_lazily(
        &self,
        key: &str,
        now: impl FnOnce() -> DateTime<Utc>,
    ) -> Result<Scope, KeyRejection> {
        let parts = tokens::parse(key).ok_or(KeyRejection::Malformed)?;
        let entry = self
            .credentials
            .get(parts.access_id)
            .ok_or(KeyRejection::Unknown)?;
        if !tokens::verify(parts.secret, &entry.digest) {
            return Err(KeyRejection::Unknown);
        }
        if entry.expires_at.is_some_and(|t| t <= now()) {
            return Err(KeyRejection::Expired);
        }
        Ok(entry.scope)
    }
}

/// The route of model `name`, made (no policy, no endpoints) for a model the snapshot's model
/// list does not hold (an orphan's name).
fn route_of<'r, 'n>(
    routes: &'r mut HashMap<&'n str, ModelRoute>,
    name: &'n str,
    model_id: i64,
) -> &'r mut ModelRoute {
    routes.entry(name).or_insert_with(|| ModelRoute {
        model_id,
        name: name.to_owned(),
        policy: None,
        endpoints: Vec::new(),
    })
}

fn endpoint_of(inst: &ModelInstance, workers: &HashMap<i64, &Worker>) -> Option<Endpoint> {
    if inst.state != InstanceState::Running {
        return None;
    }
    let worker = workers.get(&inst.worker_id?)?;
    if worker.state != WorkerState::Ready || worker.address().is_empty() {
        return None;
    }
    let proxy_address = worker.proxy_address.clone().filter(|a| !a.is_empty());
    if worker.proxy_mode == ProxyMode::Tunnel && proxy_address.is_none() {
        return None;
    }
    Some(Endpoint {
        instance_id: inst.id,
        model_id: inst.model_id,
        worker_id: worker.id,
        worker_name: worker.name.clone(),
        cluster_id: worker.cluster_id,
        address: worker.address().to_owned(),
        instance_port: inst.port?,
        worker_port: worker.port,
        proxy_mode: worker.proxy_mode,
        proxy_address,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The instance ids the snapshot routes `model` to, in order.
    fn endpoint_ids(snap: &RoutingSnapshot, model: &str) -> Vec<i64> {
        snap.route(model)
            .unwrap()
            .endpoints
            .iter()
            .map(|e| e.instance_id)
            .collect()
    }

    fn worker(id: i64, state: WorkerState, mode: ProxyMode, proxy: Option<&str>) -> Worker {
        serde_json::from_value(serde_json::json!({
            "id": id, "name": format!("w{id}"), "cluster_id": 1, "ip": "10.0.0.1",
            "state": state, "proxy_mode": mode, "proxy_address": proxy,
        }))
        .unwrap()
    }

    fn instance(id: i64, worker_id: i64, state: InstanceState) -> ModelInstance {
        serde_json::from_value(serde_json::json!({
            "id": id, "model_id": 1, "worker_id": worker_id, "port": 40000, "state": state,
        }))
        .unwrap()
    }

    #[test]
    fn only_running_instances_on_ready_reachable_workers_are_routable() {
        let workers = [
            worker(1, WorkerState::Ready, ProxyMode::Direct, None),
            worker(2, WorkerState::NotReady, ProxyMode::Direct, None),
            worker(3, WorkerState::Ready, ProxyMode::Tunnel, None),
            worker(
                4,
                WorkerState::Ready,
                ProxyMode::Tunnel,
                Some("http://10.0.0.9:30079"),
            ),
        ];
        let instances = [
            instance(10, 1, InstanceState::Running),
            instance(11, 1, InstanceState::Draining),
            instance(12, 1, InstanceState::Starting),
            instance(13, 2, InstanceState::Running),
            instance(14, 3, InstanceState::Running),
            instance(15, 4, InstanceState::Running),
        ];
        let models: [Model; 2] = [
            serde_json::from_value(serde_json::json!({"id": 1, "name": "m"})).unwrap(),
            serde_json::from_value(serde_json::json!({"id": 2, "name": "idle"})).unwrap(),
        ];
        let snap = RoutingSnapshot::build(&workers, &instances, &models, &[], Some(7));
        let ids = endpoint_ids(&snap, "m");
        assert_eq!(ids, [10, 15]);
        // A known model without endpoints stays known (503), an unknown one is absent (404).
        assert!(snap.route("idle").unwrap().endpoints.is_empty());
        assert!(snap.routable("idle").is_none());
        assert!(snap.route("nope").is_none());
        assert_eq!(snap.revision, Some(7));
    }

    #[test]
    fn a_draining_workers_instances_are_routed_only_where_nothing_else_serves_the_model() {
        let mut draining = worker(2, WorkerState::Ready, ProxyMode::Direct, None);
        draining.maintenance = Some(Box::new(crate::model::Maintenance {
            enabled: true,
            ..Default::default()
        }));
        let workers = [
            worker(1, WorkerState::Ready, ProxyMode::Direct, None),
            draining,
        ];
        let mut alone = instance(21, 2, InstanceState::Running);
        alone.model_id = 2;
        let instances = [
            instance(10, 1, InstanceState::Running),
            instance(20, 2, InstanceState::Running),
            alone,
        ];
        let models: [Model; 2] = [
            serde_json::from_value(serde_json::json!({"id": 1, "name": "m"})).unwrap(),
            serde_json::from_value(serde_json::json!({"id": 2, "name": "only"})).unwrap(),
        ];
        let snap = RoutingSnapshot::build(&workers, &instances, &models, &[], None);
        let ids = |model: &str| endpoint_ids(&snap, model);
        // Model m moved to worker 1; model "only" keeps its one instance on the draining worker.
        assert_eq!(ids("m"), [10]);
        assert_eq!(ids("only"), [21]);
        // Once worker 1 is gone too, m is served by the draining worker again.
        let snap = RoutingSnapshot::build(&workers[1..], &instances, &models, &[], None);
        assert_eq!(snap.route("m").unwrap().endpoints[0].instance_id, 20);
    }

    #[test]
    fn a_gpustack_worker_in_maintenance_is_drained_the_same_way() {
        let read = |maintenance: serde_json::Value| -> Worker {
            serde_json::from_value(serde_json::json!({
                "id": 2, "name": "w2", "cluster_id": 1, "ip": "10.0.0.2", "state": "ready",
                "proxy_mode": "direct", "maintenance": maintenance,
            }))
            .unwrap()
        };
        // GPUStack 2.3's shape.
        let on = read(serde_json::json!({"enabled": true, "message": "disk swap"}));
        assert!(on.is_draining());
        assert!(!read(serde_json::json!(null)).is_draining());
        assert!(!read(serde_json::json!({"enabled": false})).is_draining());
        // A shape faden does not know reads as no maintenance, not as an unreadable worker.
        assert!(!read(serde_json::json!("yes")).is_draining());
        let workers = [worker(1, WorkerState::Ready, ProxyMode::Direct, None), on];
        let instances = [
            instance(10, 1, InstanceState::Running),
            instance(20, 2, InstanceState::Running),
        ];
        let models: [Model; 1] =
            [serde_json::from_value(serde_json::json!({"id": 1, "name": "m"})).unwrap()];
        let snap = RoutingSnapshot::build(&workers, &instances, &models, &[], None);
        let ids = endpoint_ids(&snap, "m");
        assert_eq!(ids, [10]);
    }

    #[test]
    fn keys_verify_against_digests_with_expiry() {
        let key = tokens::generate(tokens::API_KEY_PREFIX);
        let cred = |expires: Option<DateTime<Utc>>| Credential {
            id: 1,
            access_id: key.access_id.clone(),
            secret_digest: hex::encode(key.digest),
            scope: Scope::Inference,
            expires_at: expires.map(crate::model::Timestamp),
        };
        let now = Utc::now();
        let snap = RoutingSnapshot::build(&[], &[], &[], &[cred(None)], None);
        assert_eq!(snap.verify_key(&key.value, now), Ok(Scope::Inference));
        assert_eq!(snap.verify_key("fdn_x", now), Err(KeyRejection::Malformed));
        let other = tokens::generate(tokens::API_KEY_PREFIX);
        assert_eq!(
            snap.verify_key(&other.value, now),
            Err(KeyRejection::Unknown)
        );
        let wrong_secret = format!("fdn_{}_{}", key.access_id, "0".repeat(32));
        assert_eq!(
            snap.verify_key(&wrong_secret, now),
            Err(KeyRejection::Unknown)
        );
        let expired = RoutingSnapshot::build(&[], &[], &[], &[cred(Some(now))], None);
        assert_eq!(
            expired.verify_key(&key.value, now),
            Err(KeyRejection::Expired)
        );

        // The clock is read only for a key that has an expiry, and then once.
        let reads = std::cell::Cell::new(0);
        let clock = || {
            reads.set(reads.get() + 1);
            now
        };
        assert_eq!(
            snap.verify_key_lazily(&key.value, clock),
            Ok(Scope::Inference)
        );
        assert_eq!(reads.get(), 0);
        assert_eq!(
            expired.verify_key_lazily(&key.value, clock),
            Err(KeyRejection::Expired)
        );
        assert_eq!(reads.get(), 1);
        let later = RoutingSnapshot::build(
            &[],
            &[],
            &[],
            &[cred(Some(now + chrono::Duration::seconds(60)))],
            None,
        );
        assert_eq!(
            later.verify_key_lazily(&key.value, clock),
            Ok(Scope::Inference)
        );
        assert_eq!(reads.get(), 2);
    }
}
