//! The `prefix` scenario: its generator (determinism, Zipf shape, conversation growth), its file
//! format, and several targets spread round-robin or by tenant affinity.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::disallowed_methods
)]

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

use faden_loadtest::scenario::{BYTES_PER_TOKEN, parse_scenario, zipf_cdf};
use faden_loadtest::{
    ClientRoute, LoadModel, PrefixGenerator, PrefixScenario, Report, RunConfig, Scenario,
};
use mock_engine::{MockEngine, MockEngineConfig, MockEngineHandle};
use serde_json::Value;

const HANG: Duration = Duration::from_secs(60);

fn small() -> PrefixScenario {
    PrefixScenario {
        tenants: 10,
        system_tokens_min: 100,
        system_tokens_max: 300,
        turns: 3,
        conversations_per_tenant: 2,
        turn_bytes: 64,
        answer_bytes: 32,
        ..PrefixScenario::default()
    }
}

fn bodies(g: &mut PrefixGenerator, n: usize) -> Vec<bytes::Bytes> {
    (0..n).map(|_| g.next_request().unwrap().body).collect()
}

fn messages(body: &[u8]) -> Vec<(String, String)> {
    let v: Value = serde_json::from_slice(body).unwrap();
    v["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            (
                m["role"].as_str().unwrap().to_owned(),
                m["content"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

#[test]
fn the_same_seed_gives_the_same_requests() {
    let s = small();
    let a = bodies(&mut PrefixGenerator::new(&s, "m", 7).unwrap(), 300);
    let b = bodies(&mut PrefixGenerator::new(&s, "m", 7).unwrap(), 300);
    assert_eq!(a, b);
    let c = bodies(&mut PrefixGenerator::new(&s, "m", 8).unwrap(), 300);
    assert_ne!(a, c);
}

#[test]
fn tenants_follow_the_zipf_law() {
    let cdf = zipf_cdf(4, 1.0);
    let h = 1.0 + 1.0 / 2.0 + 1.0 / 3.0 + 1.0 / 4.0;
    let expected = [1.0 / h, 1.5 / h, (1.5 + 1.0 / 3.0) / h, 1.0];
    for (got, want) in cdf.iter().zip(expected) {
        assert!((got - want).abs() < 1e-12, "{cdf:?}");
    }

    let s = PrefixScenario {
        tenants: 20,
        zipf_s: 1.0,
        ..small()
    };
    let mut g = PrefixGenerator::new(&s, "m", 1).unwrap();
    let n = 20_000;
    let mut counts = [0u32; 20];
    for _ in 0..n {
        counts[g.next_request().unwrap().tenant as usize] += 1;
    }
    let h: f64 = (1..=20).map(|k| 1.0 / f64::from(k)).sum();
    for k in [0usize, 1, 4, 19] {
        let want = 1.0 / ((k + 1) as f64 * h);
        let got = f64::from(counts[k]) / f64::from(n);
        assert!(
            (got - want).abs() < 0.15 * want + 0.002,
            "tenant {k}: {got:.4} of requests, Zipf says {want:.4}"
        );
    }

    // s = 0: every tenant alike.
    let mut g = PrefixGenerator::new(&PrefixScenario { zipf_s: 0.0, ..s }, "m", 1).unwrap();
    let mut counts = [0u32; 20];
    for _ in 0..n {
        counts[g.next_request().unwrap().tenant as usize] += 1;
    }
    let (lo, hi) = (counts.iter().min().unwrap(), counts.iter().max().unwrap());
    assert!(f64::from(*hi) / f64::from(*lo) < 1.25, "{counts:?}");
}

#[test]
fn conversations_grow_turn_by_turn_on_their_tenants_system_prompt() {
    let s = PrefixScenario {
        session_hint: true,
        ..small()
    };
    let mut g = PrefixGenerator::new(&s, "m", 3).unwrap();
    // Conversation id -> (tenant, messages of its last turn).
    let mut convs: HashMap<u64, (u32, Vec<(String, String)>)> = HashMap::new();
    let mut finished = 0;
    for _ in 0..2000 {
        let d = g.next_request().unwrap();
        let body: Value = serde_json::from_slice(&d.body).unwrap();
        assert_eq!(body["model"], "m");
        assert_eq!(body["stream"], true);
        assert_eq!(body["stream_options"]["include_usage"], true);
        assert_eq!(body["max_tokens"], s.max_tokens);
        assert_eq!(
            body["user"].as_str().unwrap(),
            format!("t{}-c{}", d.tenant, d.conversation)
        );
        let msgs = messages(&d.body);
        // system, then user/assistant pairs, then the new user message.
        assert_eq!(msgs.len(), 2 * d.turn as usize + 2);
        assert_eq!(msgs[0].0, "system");
        assert_eq!(msgs[0].1, g.system_prompt(d.tenant).unwrap());
        let sys = msgs[0].1.len();
        assert!(
            (s.system_tokens_min as usize * BYTES_PER_TOKEN
                ..=s.system_tokens_max as usize * BYTES_PER_TOKEN)
                .contains(&sys),
            "system prompt of {sys} bytes"
        );
        for (i, (role, content)) in msgs.iter().enumerate().skip(1) {
            let user = i % 2 == 1;
            assert_eq!(role, if user { "user" } else { "assistant" });
            assert_eq!(
                content.len(),
                if user { s.turn_bytes } else { s.answer_bytes }
            );
        }
        assert_eq!(d.text_bytes, msgs.iter().map(|m| m.1.len()).sum::<usize>());
        assert!(d.turn < s.turns);
        match convs.get(&d.conversation) {
            None => assert_eq!(d.turn, 0, "a conversation starts at turn 0"),
            Some((tenant, last)) => {
                assert_eq!(*tenant, d.tenant);
                assert_eq!(last.len() + 2, msgs.len(), "one turn more than the last");
                assert_eq!(&msgs[..last.len()], &last[..], "the last turn is a prefix");
            }
        }
        if d.turn + 1 == s.turns {
            finished += 1;
        }
        convs.insert(d.conversation, (d.tenant, msgs));
    }
    assert!(finished > 100, "conversations end after {} turns", s.turns);
    // Two tenants never share a system prompt.
    let prompts: BTreeSet<&str> = (0..s.tenants)
        .map(|t| g.system_prompt(t).unwrap())
        .collect();
    assert_eq!(prompts.len(), s.tenants as usize);
}

#[test]
fn scenario_files_reject_unknown_keys_and_bad_bounds() {
    let s = parse_scenario("prefix: {tenants: 5, zipf_s: 1.2, session_hint: true}").unwrap();
    let Scenario::Prefix(p) = s;
    assert_eq!((p.tenants, p.zipf_s, p.session_hint), (5, 1.2, true));
    assert_eq!(p.turns, PrefixScenario::default().turns);
    let s = parse_scenario(r#"{"prefix": {"turns": 2}}"#).unwrap();
    let Scenario::Prefix(p) = s;
    assert_eq!(p.turns, 2);
    for (text, want) in [
        ("prefix: {tenant: 5}", "unknown field"),
        ("suffix: {}", "unknown field `suffix`"),
        ("{}", "names no kind"),
        ("prefix: {tenants: 0}", "tenants"),
        (
            "prefix: {system_tokens_min: 10, system_tokens_max: 5}",
            "system_tokens_min",
        ),
        ("prefix: {zipf_s: -1}", "zipf_s"),
        ("prefix: {turns: 0}", "turns"),
    ] {
        let e = format!("{:#}", parse_scenario(text).unwrap_err());
        assert!(e.contains(want), "{text}: {e}");
    }
}

async fn run(c: RunConfig) -> Report {
    tokio::time::timeout(HANG, faden_loadtest::run(c))
        .await
        .expect("run hung")
        .unwrap()
}

async fn engines(n: usize) -> Vec<MockEngineHandle> {
    let mut out = Vec::new();
    for _ in 0..n {
        out.push(
            MockEngine::start(MockEngineConfig {
                tokens: 2,
                record_limit: 10_000,
                ..Default::default()
            })
            .await
            .unwrap(),
        );
    }
    out
}

fn spread(es: &[MockEngineHandle], route: ClientRoute, scenario: Option<Scenario>) -> RunConfig {
    let urls: Vec<String> = es.iter().map(|e| format!("http://{}/v1", e.addr)).collect();
    let mut c = RunConfig::new(urls[0].clone(), "mock-model");
    c.more_urls = urls[1..].to_vec();
    c.route = route;
    c.scenario = scenario;
    c.load = LoadModel::Closed { concurrency: 3 };
    c.requests = Some(300);
    c
}

/// The tenant of a recorded prefix-scenario request, from its system prompt.
fn tenant_of(body: &[u8]) -> u32 {
    let msgs = messages(body);
    let rest = msgs[0]
        .1
        .strip_prefix("You are the assistant of tenant ")
        .unwrap();
    rest.split('.').next().unwrap().parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_targets_round_robin_and_by_tenant_affinity() {
    let es = engines(3).await;
    let r = run(spread(&es, ClientRoute::RoundRobin, None)).await;
    assert_eq!(r.ok, 300, "{}", r.to_text());
    for e in &es {
        assert_eq!(e.stats.requests(), 100);
    }
    assert_eq!(r.targets.len(), 3);
    assert!(r.targets.iter().all(|t| t.ok == 100));
    assert_eq!(r.route.as_deref(), Some("round-robin"));

    let es = engines(3).await;
    let scenario = Scenario::Prefix(PrefixScenario {
        tenants: 12,
        ..small()
    });
    let r = run(spread(&es, ClientRoute::Affinity, Some(scenario))).await;
    assert_eq!(r.ok, 300, "{}", r.to_text());
    assert!(r.ttft.is_some(), "the scenario streams");
    // Each tenant on exactly one engine.
    let mut home: BTreeMap<u32, usize> = BTreeMap::new();
    for (i, e) in es.iter().enumerate() {
        for seen in e.stats.seen() {
            let t = tenant_of(&seen.body);
            assert_eq!(*home.entry(t).or_insert(i), i, "tenant {t} on two engines");
        }
    }
    assert!(home.len() > 6, "{home:?}");
    assert!(
        home.values().collect::<BTreeSet<_>>().len() > 1,
        "the tenants spread over the engines: {home:?}"
    );

    // Affinity without a scenario has no tenant to route by.
    let e = spread(&es, ClientRoute::Affinity, None)
        .validate()
        .unwrap_err();
    assert!(format!("{e}").contains("--scenario"), "{e}");
}
