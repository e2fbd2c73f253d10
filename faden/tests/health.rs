//! Health and errors with the real binaries: a worker with a wrong token says so once and
//! backs off; a tunnel worker whose server restarts says once why it cannot reconnect, dials
//! again with growing pauses, and checks in and checks its instances at once on return.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::disallowed_methods
)]

mod common;

use common::*;

use std::time::Duration;

use testkit::process::{start, start_faden_server};
use testkit::{free_port, wait_until};

fn count(running: &testkit::process::Running, marker: &str) -> usize {
    running.log.iter().filter(|l| l.contains(marker)).count()
        + running
            .later
            .lock()
            .iter()
            .filter(|l| l.contains(marker))
            .count()
}

/// The `retry_in=` values of the lines containing `marker`, in seconds.
fn delays(running: &testkit::process::Running, marker: &str) -> Vec<f64> {
    let later = running.later.lock().clone();
    running
        .log
        .iter()
        .chain(later.iter())
        .filter(|l| l.contains(marker))
        .filter_map(|l| {
            l.split("retry_in=")
                .nth(1)?
                .split_whitespace()
                .next()
                .map(str::to_owned)
        })
        .filter_map(|d| seconds(&d))
        .collect()
}

/// A `Duration`'s debug form (`734.1ms`, `1.2s`) in seconds.
fn seconds(text: &str) -> Option<f64> {
    for (unit, scale) in [("ms", 1e-3), ("µs", 1e-6), ("ns", 1e-9), ("s", 1.0)] {
        if let Some(n) = text.strip_suffix(unit) {
            return n.parse::<f64>().ok().map(|n| n * scale);
        }
    }
    None
}

const REFUSED: &str = "the server refused the registration token";
const AGAIN: &str = "registration failed again";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_with_a_wrong_token_says_so_once_and_backs_off() {
    let dir = tempfile::tempdir().unwrap();
    let mut server = start_faden_server(bin(), &dir.path().join("server"), [0; 3], &[], &[]).await;
    let (reg, _) = provision(&server.admin).await;
    // Same shape, wrong secret.
    let wrong = format!("{}{}", &reg[..reg.len() - 4], "0000");
    assert_ne!(wrong, reg);
    let args = worker_args(
        &server.api_url(),
        &wrong,
        "tunnel",
        9,
        &dir.path().join("w"),
    );
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (mut worker, _) = start(
        bin(),
        &args,
        &[("FADEN_LOG", "info,faden=debug")],
        REFUSED,
        "retry_in",
    )
    .await;
    wait_until(Duration::from_secs(20), "two more refused attempts", || {
        count(&worker, AGAIN) >= 2
    })
    .await;
    assert_eq!(count(&worker, REFUSED), 1, "the refusal is said once");
    assert!(
        worker.child.try_wait().unwrap().is_none(),
        "the worker gave up"
    );
    // Growing pauses, never a tight loop: at least half of a ceiling that doubles from 1 s.
    let mut all = delays(&worker, REFUSED);
    all.extend(delays(&worker, AGAIN));
    assert!(all[0] >= 0.5 && all[1] >= 1.0 && all[2] >= 2.0, "{all:?}");
    eprintln!("wrong token: retry pauses {all:?} s");
    stop(&mut worker).await;
    server.kill().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tunnel_worker_is_checked_at_once_when_its_restarted_server_returns() {
    let dir = tempfile::tempdir().unwrap();
    let ports = [free_port(), free_port(), free_port()];
    let data = dir.path().join("server");
    let mut server = start_faden_server(bin(), &data, ports, &[], &[]).await;
    let (reg, key) = provision(&server.admin).await;
    let engine = engine(2, 1, 0).await;
    let mut args = worker_args(
        &server.api_url(),
        &reg,
        "tunnel",
        engine.port(),
        &dir.path().join("w"),
    );
    // Only the reconnect may bring the check: the timers are far away.
    let at = args.iter().position(|a| a == "--probe-interval").unwrap();
    args[at + 1] = "1h".to_owned();
    args.extend(["--heartbeat-interval", "1h"].map(str::to_owned));
    let (mut worker, _) = start_worker(&args).await;
    wait_serving(server.gateway, &key, T)
        .await
        .expect("never served");

    server.kill().await;
    wait_until(T, "the worker says why it cannot reconnect", || {
        worker.printed("tunnel connect failed; retrying")
    })
    .await;
    let mut server = start_faden_server(bin(), &data, ports, &[], &[]).await;
    wait_until(T, "checked at once on return", || {
        worker.printed("reconnected: checking in and checking every instance now")
    })
    .await;
    wait_serving(server.gateway, &key, T)
        .await
        .expect("never served again");
    assert_eq!(count(&worker, "tunnel connect failed; retrying"), 1);
    // Its instance is probed and reported again at once, not at the next (hour-long) tick.
    wait_until(T, "the instance reported again on return", || {
        count(&worker, "instance state") >= 2
    })
    .await;
    stop(&mut worker).await;
    server.kill().await;
}
