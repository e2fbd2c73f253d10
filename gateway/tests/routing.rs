//! The cache-aware routing policy against mock engines with the prefix-cache model: prefixes
//! go back where they are cached, tenants spread, a hot tenant stays within the load bound,
//! instances come and go without a failed request, and the engines' load readings steer
//! traffic while they are fresh.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use common::{Harness, Inst, MODEL, T, body_bytes, credential, send, snapshot};
use control_client::engine_load::{EngineLoad, EngineLoads, Reading};
use control_client::model::Scope;
use control_client::tokens;
use gateway::{Gateway, GatewayConfig};
use mock_engine::{MockEngine, MockEngineConfig, MockEngineHandle, PerfModel};
use tokio::sync::watch;

/// An engine with a prefix cache large enough for the test's tenants.
async fn engine(name: &str) -> MockEngineHandle {
    MockEngine::start(MockEngineConfig {
        model: format!("engine-{name}"),
        tokens: 2,
        perf: Some(PerfModel {
            kv_blocks: 4096,
            prefill_per_token: Duration::from_micros(2),
            ..PerfModel::default()
        }),
        ..Default::default()
    })
    .await
    .unwrap()
}

/// A chat request body of `tenant`: a 3,000-byte system prompt of its own, then `turn`.
fn chat(tenant: usize, turn: &str) -> String {
    let system: String = format!("tenant {tenant} ").repeat(400);
    serde_json::json!({
        "model": MODEL,
        "stream": true,
        "stream_options": {"include_usage": true},
        "messages": [
            {"role": "system", "content": &system[..3000]},
            {"role": "user", "content": turn},
        ],
    })
    .to_string()
}

/// Sends one request; the engine that answered (from its model name) and the cached tokens it
/// reported.
async fn ask(h: &Harness, body: String) -> (char, u64) {
    let resp = send(h.addr, h.post("/v1/chat/completions", body)).await;
    assert_eq!(resp.status(), 200);
    let text = String::from_utf8(body_bytes(resp).await.to_vec()).unwrap();
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    let at = text.find("\"model\":\"engine-").unwrap() + "\"model\":\"engine-".len();
    let engine = text[at..].chars().next().unwrap();
    let cached = text
        .find("\"cached_tokens\":")
        .map(|i| {
            text[i + 16..]
                .chars()
                .take_while(char::is_ascii_digit)
                .collect::<String>()
                .parse()
                .unwrap()
        })
        .unwrap_or(0);
    (engine, cached)
}

async fn four_engines() -> (Vec<MockEngineHandle>, Vec<Inst>) {
    let mut engines = Vec::new();
    let mut instances = Vec::new();
    for (i, name) in ["a", "b", "c", "d"].into_iter().enumerate() {
        let e = engine(name).await;
        instances.push(Inst::direct(i as i64 + 1, e.port()));
        engines.push(e);
    }
    (engines, instances)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefixes_go_back_where_they_are_cached_and_tenants_spread() {
    let (_engines, instances) = four_engines().await;
    let h = Harness::start(GatewayConfig::default(), &instances).await;
    let mut home: HashMap<usize, char> = HashMap::new();
    let mut cached_after_first = 0;
    for round in 0..4 {
        for tenant in 0..8 {
            let (engine, cached) = ask(&h, chat(tenant, &format!("question {round}"))).await;
            let first = *home.entry(tenant).or_insert(engine);
            assert_eq!(engine, first, "tenant {tenant} moved");
            if round > 0 {
                assert!(cached >= 512, "tenant {tenant} round {round}: {cached}");
                cached_after_first += 1;
            }
        }
    }
    assert_eq!(cached_after_first, 24);
    let used: HashSet<char> = home.values().copied().collect();
    assert!(used.len() >= 3, "8 tenants over {used:?}");
    let text = h.gateway.metrics_text();
    assert!(
        text.contains(&format!(
            "faden_route_decisions_total{{model=\"{MODEL}\",reason=\"cache_hit\"}} 24"
        )),
        "{text}"
    );
    h.stop().await;
}

/// One tenant sends half the requests, all at once: no instance takes more than the bound
/// (max(1.5 × the mean load, the mean + 8) + 1) when it is chosen, and the tenant's requests
/// still hit. 64 requests: the hot tenant's home reaches the bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hot_tenant_stays_within_the_load_bound() {
    let (engines, instances) = four_engines().await;
    let h = Arc::new(Harness::start(GatewayConfig::default(), &instances).await);
    // Streams that stay open until released: the load builds up.
    for e in &engines {
        e.stall();
    }
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..64usize {
        let tenant = if i % 2 == 0 { 0 } else { 1 + i % 7 };
        let client = h.clone();
        tasks.spawn(async move { ask(&client, chat(tenant, &format!("q{i}"))).await });
        // One at a time into the gateway, so each choice sees the ones before it.
        testkit::wait::wait_until(T, "the request is in flight", || {
            in_flight(&h.gateway).values().sum::<u64>() == i as u64 + 1
        })
        .await;
        let loads = in_flight(&h.gateway);
        let total: u64 = loads.values().sum();
        let mean = total as f64 / 4.0;
        for (instance, n) in &loads {
            // The last choice was made at a mean of (total - 1) / 4 with the chosen instance
            // one lower: below the bound then, so at most this.
            let before = (total - 1) as f64 / 4.0;
            let bound = (1.5 * before).max(before + 8.0) + 2.0;
            assert!(
                (*n as f64) < bound,
                "instance {instance}: {n} in flight, mean {mean}: {loads:?}"
            );
        }
    }
    for e in &engines {
        e.resume();
    }
    while let Some(r) = tasks.join_next().await {
        r.unwrap();
    }
}

fn in_flight(g: &Gateway) -> HashMap<String, u64> {
    g.metrics_text()
        .lines()
        .filter_map(|l| l.strip_prefix("faden_gateway_instance_requests_in_flight{instance=\""))
        .filter_map(|l| {
            let (id, rest) = l.split_once("\"} ")?;
            Some((id.to_owned(), rest.parse().ok()?))
        })
        .collect()
}

/// Instances leave and join the routing snapshot while streams run: no request fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_added_and_removed_fail_no_request() {
    let (_engines, instances) = four_engines().await;
    let h = Arc::new(Harness::start(GatewayConfig::default(), &instances[..2]).await);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut clients = tokio::task::JoinSet::new();
    for c in 0..4usize {
        let (h, stop) = (h.clone(), stop.clone());
        clients.spawn(async move {
            let mut n = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                ask(&h, chat(c * 3 + n % 3, "again")).await;
                n += 1;
            }
            n
        });
    }
    // Each change waits for requests to have gone through the snapshot before it.
    let changes: [&[Inst]; 4] = [
        &instances[..3],
        &instances[1..3],
        &instances[1..],
        &instances[..],
    ];
    for set in changes {
        let before = decisions(&h.gateway);
        h.publish(set, std::slice::from_ref(&h.cred));
        testkit::wait::wait_until(T, "requests routed after the change", || {
            decisions(&h.gateway) >= before + 8
        })
        .await;
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut served = 0;
    while let Some(n) = clients.join_next().await {
        served += n.unwrap();
    }
    assert!(served >= 32, "{served}");
}

fn decisions(g: &Gateway) -> u64 {
    g.metrics_text()
        .lines()
        .filter(|l| l.starts_with("faden_route_decisions_total{"))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<u64>().ok())
        .sum()
}

/// A fresh reading of a long queue keeps new work away from that engine, its cached tenant
/// included; once the reading is stale the tenant goes home again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_engine_gets_no_new_work_while_its_reading_is_fresh() {
    let (_engines, instances) = four_engines().await;
    let key = tokens::generate(tokens::API_KEY_PREFIX);
    let cred = credential(1, &key, Scope::Inference, None);
    let snap = snapshot(&instances, std::slice::from_ref(&cred));
    let loads = EngineLoads::new();
    let (tx, rx) = watch::channel(Arc::new(snap));
    let gateway = Gateway::builder(GatewayConfig::default(), rx)
        .engine_loads(loads.clone())
        .build()
        .unwrap();
    let h = Harness::serve(gateway, tx, key, cred).await;
    let (home, _) = ask(&h, chat(5, "first")).await;
    assert_eq!(ask(&h, chat(5, "second")).await.0, home);
    let home_id = i64::from(home as u8 - b'a') + 1;
    let queued = EngineLoad {
        waiting: 20,
        running: 32,
        ..EngineLoad::default()
    };
    let now = tokio::time::Instant::now();
    loads.update(
        [(
            home_id,
            Reading {
                load: queued,
                taken: now,
            },
        )],
        now,
    );
    for i in 0..8 {
        let (engine, _) = ask(&h, chat(5, &format!("while queued {i}"))).await;
        assert_ne!(engine, home, "the queued engine took request {i}");
    }
    let text = h.gateway.metrics_text();
    assert!(text.contains(&format!(
        "faden_engine_requests_waiting{{instance=\"{home_id}\"}} 20"
    )));
    // The same reading, old: ignored.
    let old = now - control_client::engine_load::MAX_AGE - Duration::from_millis(1);
    loads.update(
        [(
            home_id,
            Reading {
                load: queued,
                taken: old,
            },
        )],
        now,
    );
    assert_eq!(ask(&h, chat(5, "back home")).await.0, home);
}
