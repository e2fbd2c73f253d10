//! Routing-snapshot benchmarks: building a snapshot from 10k instances, and looking up a route
//! and verifying a key in it (the per-request reads of the gateway).

// Benchmark setup: failing loudly is right.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::hint::black_box;

use control_client::model::{
    Credential, InstanceState, Model, ModelInstance, ProxyMode, Scope, Worker, WorkerState,
};
use control_client::routing::RoutingSnapshot;
use control_client::tokens;
use criterion::{Criterion, criterion_group, criterion_main};

/// 1,000 workers, 100 models, 10,000 instances (9,000 running), 1,000 keys.
pub fn fleet() -> (
    Vec<Worker>,
    Vec<ModelInstance>,
    Vec<Model>,
    Vec<Credential>,
    String,
) {
    let workers: Vec<Worker> = (1..=1000)
        .map(|id| Worker {
            id,
            name: format!("w{id}"),
            labels: Default::default(),
            cluster_id: 1,
            hostname: format!("w{id}"),
            ip: format!("10.0.{}.{}", id / 250, id % 250),
            ifname: None,
            advertise_address: None,
            port: 10150,
            metrics_port: control_client::model::MetricsPort::Port(10151),
            worker_uuid: String::new(),
            state: if id % 50 == 0 {
                WorkerState::NotReady
            } else {
                WorkerState::Ready
            },
            state_message: None,
            heartbeat_time: None,
            proxy_mode: [ProxyMode::Direct, ProxyMode::Worker, ProxyMode::Tunnel][id as usize % 3],
            proxy_address: Some("http://10.9.9.9:30079".to_owned()),
            maintenance: None,
            created_at: None,
            updated_at: None,
        })
        .collect();
    let models: Vec<Model> = (1..=100)
        .map(|id| Model {
            id,
            name: format!("model-{id}"),
            cluster_id: Some(1),
            description: None,
            replicas: None,
            ready_replicas: None,
            route_policy: None,
            created_at: None,
            updated_at: None,
        })
        .collect();
    let instances: Vec<ModelInstance> = (1..=10_000)
        .map(|id| ModelInstance {
            id,
            name: String::new(),
            model_id: id % 100 + 1,
            model_name: None,
            worker_id: Some(id % 1000 + 1),
            port: Some(40000 + (id % 64) as u16),
            state: if id % 10 == 0 {
                InstanceState::Starting
            } else {
                InstanceState::Running
            },
            state_message: None,
            cluster_id: Some(1),
            created_at: None,
            updated_at: None,
        })
        .collect();
    let mut sample_key = String::new();
    let credentials: Vec<Credential> = (1..=1000)
        .map(|id| {
            let key = tokens::generate(tokens::API_KEY_PREFIX);
            if id == 500 {
                sample_key = key.value.clone();
            }
            Credential {
                id,
                access_id: key.access_id,
                secret_digest: hex_digest(&key.digest),
                scope: Scope::Inference,
                expires_at: None,
            }
        })
        .collect();
    (workers, instances, models, credentials, sample_key)
}

fn hex_digest(d: &[u8; 32]) -> String {
    d.iter().map(|b| format!("{b:02x}")).collect()
}

fn bench(c: &mut Criterion) {
    let (workers, instances, models, credentials, key) = fleet();
    c.bench_function("snapshot_build_10k_instances", |b| {
        b.iter(|| {
            RoutingSnapshot::build(
                black_box(&workers),
                black_box(&instances),
                black_box(&models),
                black_box(&credentials),
                Some(1),
            )
        })
    });
    let snapshot = RoutingSnapshot::build(&workers, &instances, &models, &credentials, None);
    c.bench_function("snapshot_route_lookup", |b| {
        b.iter(|| {
            snapshot
                .route(black_box("model-42"))
                .map(|r| r.endpoints.len())
        })
    });
    let now = chrono::Utc::now();
    c.bench_function("snapshot_verify_key", |b| {
        b.iter(|| snapshot.verify_key(black_box(&key), now))
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
