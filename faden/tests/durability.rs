//! Acknowledged writes survive `kill -9` of the server process: writers run while the process is
//! killed mid-flight, then every write that got a 2xx answer must be there after a restart.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::disallowed_methods
)]

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use testkit::Client;
use testkit::process::start_faden_server;

fn bin() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_faden"))
}

#[tokio::test]
async fn acknowledged_writes_survive_kill_9() {
    let dir = tempfile::tempdir().unwrap();
    let mut server = start_faden_server(bin(), dir.path(), [0; 3], &[], &[]).await;
    let client = server.admin.clone();
    let acked = Arc::new(tokio::sync::Mutex::new(Vec::<String>::new()));

    // Four writers create models as fast as they can; each records what was acknowledged.
    let mut writers = Vec::new();
    for w in 0..4 {
        let (client, acked) = (client.clone(), acked.clone());
        writers.push(tokio::spawn(async move {
            for i in 0..10_000 {
                let name = format!("m-{w}-{i}");
                let Ok(r) = tokio::time::timeout(
                    Duration::from_secs(10),
                    client.try_post("/v2/models", &json!({"name": name})),
                )
                .await
                else {
                    return;
                };
                match r {
                    Some(r) if r.status == 200 => acked.lock().await.push(name),
                    // Connection refused/reset once the process is gone.
                    _ => return,
                }
            }
        }));
    }
    // Let some writes land, then kill -9 while requests are in flight.
    testkit::wait_until_async(Duration::from_secs(10), "200 acknowledged writes", || {
        let acked = acked.clone();
        async move { acked.lock().await.len() >= 200 }
    })
    .await;
    server.kill().await;
    for w in writers {
        w.await.unwrap();
    }
    let acked = std::mem::take(&mut *acked.lock().await);
    eprintln!("acknowledged before kill -9: {}", acked.len());
    assert!(
        acked.len() > 20,
        "too few writes were acknowledged to prove anything: {}",
        acked.len()
    );

    let mut again = start_faden_server(bin(), dir.path(), [0; 3], &[], &[]).await;
    let client = again.admin.clone();
    let list = client.get("/v2/models?perPage=-1").await.expect(200).json();
    let stored: std::collections::HashSet<String> = list["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["name"].as_str().unwrap().to_owned())
        .collect();
    let lost: Vec<&String> = acked.iter().filter(|n| !stored.contains(*n)).collect();
    assert!(
        lost.is_empty(),
        "{} acknowledged writes lost, e.g. {:?}",
        lost.len(),
        &lost[..lost.len().min(5)]
    );
    // The watch history survived too: revisions keep increasing after the restart.
    let rev: u64 = list_revision(&client).await;
    client
        .post("/v2/models", &json!({"name": "after-restart"}))
        .await
        .expect(200);
    assert!(list_revision(&client).await > rev);
    again.running.child.start_kill().unwrap();
    let _ = again.running.child.wait().await;
}

async fn list_revision(client: &Client) -> u64 {
    let r = client.get("/v2/models").await.expect(200);
    r.headers["x-faden-revision"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap()
}
