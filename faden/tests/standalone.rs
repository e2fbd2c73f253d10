//! A standalone `faden gateway`, given only the server's URL and a data-plane key, reaches the
//! workers of every proxy mode: `direct` (it dials the engine), `worker` (the worker proxy takes
//! the cluster's worker proxy credential, which the gateway reads with its key) and `tunnel`
//! (through the server's proxy port, with its key).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::{
    T, bin, chat, drain_body, engine, provision, standalone_gateway, start_worker, worker_args,
};
use testkit::process::start_faden_server;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standalone_gateway_reaches_every_proxy_mode_with_only_its_key() {
    let dir = tempfile::tempdir().unwrap();
    let server = start_faden_server(bin(), &dir.path().join("server"), [0, 0, 0], &[], &[]).await;
    let (reg, key) = provision(&server.admin).await;
    let mut engines = Vec::new();
    let mut workers = Vec::new();
    for mode in ["direct", "worker", "tunnel"] {
        let engine = engine(3, 0, 0).await;
        let mut args = worker_args(
            &server.api_url(),
            &reg,
            mode,
            engine.port(),
            &dir.path().join(mode),
        );
        args.extend(["--name".to_owned(), format!("worker-{mode}")]);
        workers.push(start_worker(&args).await.0);
        engines.push((mode, engine));
    }
    let (_gateway, gw) = standalone_gateway(&server.admin, &server.api_url(), &[]).await;
    // Until every engine has answered once (the workers come up and their routes and
    // credentials reach the gateway meanwhile)...
    let mut last = (0, String::new());
    let served = || {
        engines
            .iter()
            .map(|(m, e)| (*m, e.stats.completed()))
            .collect::<Vec<_>>()
    };
    let waited = tokio::time::timeout(T, async {
        while served().iter().any(|(_, n)| *n == 0) {
            last = request(gw, &key).await;
        }
    })
    .await;
    assert!(
        waited.is_ok(),
        "not every mode served: {:?}; last answer {:?}",
        served(),
        last
    );
    // ...then no request fails, whichever mode it goes to.
    let before: u64 = engines.iter().map(|(_, e)| e.stats.completed()).sum();
    for _ in 0..30 {
        let (status, text) = request(gw, &key).await;
        assert_eq!(status, 200, "{text}");
        assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    }
    let after: u64 = engines.iter().map(|(_, e)| e.stats.completed()).sum();
    assert_eq!(after - before, 30);
    drop(workers);
}

/// A short streamed chat through `gw`: its status and body.
async fn request(gw: std::net::SocketAddr, key: &str) -> (u16, String) {
    let Some(resp) = chat(gw, key, true, Some(2)).await else {
        return (0, String::new());
    };
    let status = resp.status().as_u16();
    let mut text = String::new();
    drain_body(&mut resp.into_body(), &mut text).await;
    (status, text)
}
