//! Keys the snapshot does not hold, left to the management server (GPUStack's `/token-auth`):
//! the gateway's answers for each verdict, when it asks, and what it never sends upstream. The
//! server is a fake [`KeyAuthority`]; tests/gpustack/ runs the same against a real GPUStack.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::disallowed_methods
)]

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use common::*;
use control_client::key_check::{
    BoxFuture, KeyAuthority, KeyCheck, KeyCheckConfig, Unreachable, Verdict,
};
use gateway::{Gateway, GatewayConfig, RemoteKeys};
use http::Request;
use http_body_util::Full;
use mock_engine::{MockEngine, MockEngineConfig};
use parking_lot::Mutex;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

const GOOD: &str = "gpustack_0123456789abcdef_0123456789abcdef0123456789abcdef";
const LIMITED: &str = "gpustack_1123456789abcdef_0123456789abcdef0123456789abcdef";

/// Verdicts by (key, model); every other pair is unknown. `down` makes it unreachable.
#[derive(Debug, Default)]
struct Authority {
    verdicts: HashMap<(&'static str, Option<&'static str>), Verdict>,
    down: Mutex<bool>,
    asked: AtomicUsize,
}

impl KeyAuthority for Authority {
    fn verify<'a>(
        &'a self,
        key: &'a str,
        model: Option<&'a str>,
    ) -> BoxFuture<'a, Result<Verdict, Unreachable>> {
        Box::pin(async move {
            self.asked.fetch_add(1, Ordering::SeqCst);
            if *self.down.lock() {
                return Err(Unreachable("connection refused".into()));
            }
            let found = self
                .verdicts
                .iter()
                .find(|((k, m), _)| *k == key && *m == model)
                .map(|(_, v)| v.clone());
            Ok(found.unwrap_or(Verdict::Unauthorized("Missing authentication token".into())))
        })
    }
}

struct Setup {
    addr: std::net::SocketAddr,
    authority: Arc<Authority>,
    _shutdown: tokio_util::sync::DropGuard,
}

async fn start(engine_port: u16) -> Setup {
    let mut authority = Authority::default();
    for key in [GOOD, LIMITED] {
        authority.verdicts.insert((key, None), Verdict::Allowed);
    }
    authority
        .verdicts
        .insert((GOOD, Some(MODEL)), Verdict::Allowed);
    authority.verdicts.insert(
        (LIMITED, Some(MODEL)),
        Verdict::Forbidden(format!("Not allowed to access model {MODEL}")),
    );
    let authority = Arc::new(authority);
    // A snapshot without credentials, as synced from GPUStack.
    let (_tx, rx) = watch::channel(Arc::new(snapshot(&[Inst::direct(1, engine_port)], &[])));
    let check = KeyCheck::new(authority.clone(), KeyCheckConfig::default());
    let gateway = Gateway::builder(GatewayConfig::default(), rx)
        .remote_keys(RemoteKeys {
            check,
            active: Arc::new(|| true),
        })
        .build()
        .unwrap();
    let listener = TcpListener::bind(("127.0.0.1", 0)).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let shutdown = CancellationToken::new();
    let s = shutdown.clone();
    tokio::spawn(async move {
        let _keep = _tx;
        gateway.serve(listener, s).await
    });
    Setup {
        addr,
        authority,
        _shutdown: shutdown.drop_guard(),
    }
}

fn chat(addr: std::net::SocketAddr, key: &str) -> Request<Full<bytes::Bytes>> {
    Request::post(format!("http://{addr}/v1/chat/completions"))
        .header("authorization", format!("Bearer {key}"))
        .header("content-type", "application/json")
        .body(Full::new(bytes::Bytes::from(format!(
            r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"hi"}}]}}"#
        ))))
        .unwrap()
}

fn models(addr: std::net::SocketAddr, key: &str) -> Request<Full<bytes::Bytes>> {
    Request::get(format!("http://{addr}/v1/models"))
        .header("authorization", format!("Bearer {key}"))
        .body(Full::new(bytes::Bytes::new()))
        .unwrap()
}

#[tokio::test]
async fn verdicts_become_401_403_and_503_and_a_good_key_is_served() {
    let engine = MockEngine::start(MockEngineConfig::default())
        .await
        .unwrap();
    let s = start(engine.port()).await;

    let resp = send(s.addr, chat(s.addr, GOOD)).await;
    assert_eq!(resp.status(), 200);
    // Asked twice: is it a key at all (before the body is read), then for the model.
    assert_eq!(s.authority.asked.load(Ordering::SeqCst), 2);
    // Cached: no more checks.
    assert_eq!(send(s.addr, chat(s.addr, GOOD)).await.status(), 200);
    assert_eq!(s.authority.asked.load(Ordering::SeqCst), 2);

    let unknown = "gpustack_2123456789abcdef_0123456789abcdef0123456789abcdef";
    assert_error(
        send(s.addr, chat(s.addr, unknown)).await,
        401,
        "invalid_api_key",
    )
    .await;
    assert_error(
        send(s.addr, chat(s.addr, "free-form")).await,
        401,
        "invalid_api_key",
    )
    .await;
    assert_error(
        send(s.addr, chat(s.addr, LIMITED)).await,
        403,
        "model_not_allowed",
    )
    .await;

    // /v1/models lists only what the key may call.
    let listed = json(send(s.addr, models(s.addr, GOOD)).await).await;
    assert_eq!(listed["data"][0]["id"], MODEL);
    let listed = json(send(s.addr, models(s.addr, LIMITED)).await).await;
    assert_eq!(listed["data"], serde_json::json!([]));
    assert_error(
        send(s.addr, models(s.addr, unknown)).await,
        401,
        "invalid_api_key",
    )
    .await;

    // The server goes away: the key it allowed keeps working, a new one gets 503.
    *s.authority.down.lock() = true;
    assert_eq!(send(s.addr, chat(s.addr, GOOD)).await.status(), 200);
    let new = "gpustack_3123456789abcdef_0123456789abcdef0123456789abcdef";
    assert_error(
        send(s.addr, chat(s.addr, new)).await,
        503,
        "auth_unavailable",
    )
    .await;
}

#[tokio::test]
async fn the_key_never_reaches_the_engine() {
    let engine = MockEngine::start(MockEngineConfig::default())
        .await
        .unwrap();
    let s = start(engine.port()).await;
    let mut req = chat(s.addr, GOOD);
    // Neither may come from a client: GPUStack 2.3's token-auth honours this marker pair.
    req.headers_mut()
        .insert("x-gpustack-auth-cache", "marker".parse().unwrap());
    req.headers_mut()
        .insert("x-gpustack-downstream-conn", "1.2.3.4:5".parse().unwrap());
    assert_eq!(send(s.addr, req).await.status(), 200);
    let seen = engine.stats.last_request().unwrap();
    for name in [
        "authorization",
        "x-gpustack-auth-cache",
        "x-gpustack-downstream-conn",
    ] {
        assert!(!seen.headers.contains_key(name), "{name} leaked upstream");
    }
    assert!(
        !seen.headers.values().any(|v| v
            .as_bytes()
            .windows(GOOD.len())
            .any(|w| w == GOOD.as_bytes())),
        "client key leaked"
    );
}
