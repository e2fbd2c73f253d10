#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::disallowed_methods
)]

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::Notify;

use super::*;

/// An authority whose answers the test sets, counting the checks it is asked, and that can
/// hold every check until released.
#[derive(Debug, Default)]
struct Fake {
    answers: parking_lot::Mutex<HashMap<(String, Option<String>), Answer>>,
    asked: AtomicUsize,
    hold: parking_lot::Mutex<Option<Arc<Notify>>>,
}

#[derive(Clone, Debug)]
enum Answer {
    Verdict(Verdict),
    Down,
}

impl Fake {
    fn set(&self, key: &str, model: Option<&str>, answer: Answer) {
        self.answers
            .lock()
            .insert((key.to_owned(), model.map(str::to_owned)), answer);
    }

    fn asked(&self) -> usize {
        self.asked.load(Ordering::SeqCst)
    }
}

impl KeyAuthority for Fake {
    fn verify<'a>(
        &'a self,
        key: &'a str,
        model: Option<&'a str>,
    ) -> BoxFuture<'a, Result<Verdict, Unreachable>> {
        Box::pin(async move {
            self.asked.fetch_add(1, Ordering::SeqCst);
            let hold = self.hold.lock().clone();
            if let Some(hold) = hold {
                hold.notified().await;
            }
            let answer = self
                .answers
                .lock()
                .get(&(key.to_owned(), model.map(str::to_owned)))
                .cloned()
                .unwrap_or(Answer::Verdict(Verdict::Unauthorized("unknown".into())));
            match answer {
                Answer::Verdict(v) => Ok(v),
                Answer::Down => Err(Unreachable("connection refused".into())),
            }
        })
    }
}

fn checker(config: KeyCheckConfig) -> (Arc<Fake>, KeyCheck) {
    let fake = Arc::new(Fake::default());
    let check = KeyCheck::new(fake.clone(), config);
    (fake, check)
}

const KEY: &str = "gpustack_0123456789abcdef_0123456789abcdef0123456789abcdef";

#[tokio::test(start_paused = true)]
async fn an_allowed_key_is_asked_again_only_after_its_lifetime() {
    let (fake, check) = checker(KeyCheckConfig::default());
    fake.set(KEY, Some("m"), Answer::Verdict(Verdict::Allowed));
    for _ in 0..10 {
        assert_eq!(check.check(KEY, Some("m")).await, Ok(()));
    }
    assert_eq!(fake.asked(), 1);
    tokio::time::advance(Duration::from_millis(4_900)).await;
    assert_eq!(check.check(KEY, Some("m")).await, Ok(()));
    assert_eq!(fake.asked(), 1);
    // Revoked in the server: refused on the first check after the lifetime.
    fake.set(
        KEY,
        Some("m"),
        Answer::Verdict(Verdict::Unauthorized("revoked".into())),
    );
    tokio::time::advance(Duration::from_millis(200)).await;
    assert_eq!(
        check.check(KEY, Some("m")).await,
        Err(CheckError::Unauthorized("revoked".into()))
    );
    assert_eq!(fake.asked(), 2);
}

#[tokio::test(start_paused = true)]
async fn verdicts_are_per_model() {
    let (fake, check) = checker(KeyCheckConfig::default());
    fake.set(KEY, Some("a"), Answer::Verdict(Verdict::Allowed));
    fake.set(
        KEY,
        Some("b"),
        Answer::Verdict(Verdict::Forbidden("not granted".into())),
    );
    assert_eq!(check.check(KEY, Some("a")).await, Ok(()));
    assert_eq!(
        check.check(KEY, Some("b")).await,
        Err(CheckError::Forbidden("not granted".into()))
    );
    assert_eq!(
        check.check(KEY, None).await,
        Err(CheckError::Unauthorized("unknown".into()))
    );
    assert_eq!(fake.asked(), 3);
    assert_eq!(check.len(), 3);
}

#[tokio::test(start_paused = true)]
async fn a_refusal_is_kept_for_the_refused_lifetime() {
    let (fake, check) = checker(KeyCheckConfig::default());
    for _ in 0..5 {
        assert!(matches!(
            check.check(KEY, Some("m")).await,
            Err(CheckError::Unauthorized(_))
        ));
    }
    assert_eq!(fake.asked(), 1);
    // Created in the server meanwhile: works once the refusal has expired.
    fake.set(KEY, Some("m"), Answer::Verdict(Verdict::Allowed));
    tokio::time::advance(Duration::from_secs(1)).await;
    assert_eq!(check.check(KEY, Some("m")).await, Ok(()));
    assert_eq!(fake.asked(), 2);
}

#[tokio::test(start_paused = true)]
async fn a_thousand_concurrent_requests_with_a_new_key_make_one_check() {
    let (fake, check) = checker(KeyCheckConfig::default());
    fake.set(KEY, Some("m"), Answer::Verdict(Verdict::Allowed));
    let gate = Arc::new(Notify::new());
    *fake.hold.lock() = Some(gate.clone());
    let mut requests = tokio::task::JoinSet::new();
    for _ in 0..1000 {
        let check = check.clone();
        requests.spawn(async move { check.check(KEY, Some("m")).await });
    }
    // Every request is waiting: on the check, or for the check's lock.
    while fake.asked() == 0 {
        tokio::task::yield_now().await;
    }
    for _ in 0..100 {
        tokio::task::yield_now().await;
    }
    assert_eq!(fake.asked(), 1);
    *fake.hold.lock() = None;
    gate.notify_one();
    while let Some(answer) = requests.join_next().await {
        assert_eq!(answer.unwrap(), Ok(()));
    }
    assert_eq!(fake.asked(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_check_whose_request_went_away_is_taken_over() {
    let (fake, check) = checker(KeyCheckConfig::default());
    fake.set(KEY, Some("m"), Answer::Verdict(Verdict::Allowed));
    let gate = Arc::new(Notify::new());
    *fake.hold.lock() = Some(gate.clone());
    let first = tokio::spawn({
        let check = check.clone();
        async move { check.check(KEY, Some("m")).await }
    });
    while fake.asked() == 0 {
        tokio::task::yield_now().await;
    }
    let second = tokio::spawn({
        let check = check.clone();
        async move { check.check(KEY, Some("m")).await }
    });
    tokio::task::yield_now().await;
    first.abort();
    assert!(first.await.unwrap_err().is_cancelled());
    // The second request now asks itself.
    while fake.asked() < 2 {
        tokio::task::yield_now().await;
    }
    *fake.hold.lock() = None;
    gate.notify_one();
    assert_eq!(second.await.unwrap(), Ok(()));
}

#[tokio::test(start_paused = true)]
async fn during_an_outage_recent_keys_serve_and_unknown_ones_are_unavailable() {
    let config = KeyCheckConfig::default();
    let grace = config.outage_grace;
    let (fake, check) = checker(config);
    fake.set(KEY, Some("m"), Answer::Verdict(Verdict::Allowed));
    assert_eq!(check.check(KEY, Some("m")).await, Ok(()));
    fake.set(KEY, Some("m"), Answer::Down);
    fake.set("other", Some("m"), Answer::Down);
    tokio::time::advance(Duration::from_secs(10)).await;
    assert_eq!(check.check(KEY, Some("m")).await, Ok(()));
    assert_eq!(
        check.check("other", Some("m")).await,
        Err(CheckError::Unavailable("connection refused".into()))
    );
    // While the server is down, one check a refused lifetime per pair, not one per request.
    let asked = fake.asked();
    for _ in 0..10 {
        assert_eq!(check.check(KEY, Some("m")).await, Ok(()));
        assert!(check.check("other", Some("m")).await.is_err());
    }
    assert_eq!(fake.asked(), asked);
    // The grace counts from the server's last yes, not from the last request.
    tokio::time::advance(grace - Duration::from_secs(10)).await;
    assert_eq!(
        check.check(KEY, Some("m")).await,
        Err(CheckError::Unavailable("connection refused".into()))
    );
}

#[tokio::test(start_paused = true)]
async fn a_key_refused_before_an_outage_stays_refused_during_it() {
    let (fake, check) = checker(KeyCheckConfig::default());
    fake.set(KEY, Some("m"), Answer::Verdict(Verdict::Allowed));
    assert_eq!(check.check(KEY, Some("m")).await, Ok(()));
    fake.set(
        KEY,
        Some("m"),
        Answer::Verdict(Verdict::Unauthorized("revoked".into())),
    );
    tokio::time::advance(Duration::from_secs(6)).await;
    assert!(check.check(KEY, Some("m")).await.is_err());
    fake.set(KEY, Some("m"), Answer::Down);
    tokio::time::advance(Duration::from_secs(2)).await;
    assert!(matches!(
        check.check(KEY, Some("m")).await,
        Err(CheckError::Unavailable(_))
    ));
}

#[tokio::test(start_paused = true)]
async fn the_cache_stays_within_its_bound() {
    let (fake, check) = checker(KeyCheckConfig {
        max_entries: 4,
        ..KeyCheckConfig::default()
    });
    for i in 0..4 {
        assert!(check.check(&format!("k{i}"), Some("m")).await.is_err());
    }
    assert_eq!(check.len(), 4);
    // Full of live refusals: a fifth key is still checked, without being kept.
    assert!(check.check("k4", Some("m")).await.is_err());
    assert_eq!(check.len(), 4);
    assert_eq!(fake.asked(), 5);
    // Once the refusals expired, they make room.
    tokio::time::advance(Duration::from_secs(2)).await;
    assert!(check.check("k5", Some("m")).await.is_err());
    assert_eq!(check.len(), 1);
}

#[test]
fn pairs_are_told_apart_by_key_and_model() {
    assert_ne!(pair_id("k", None), pair_id("k", Some("")));
    assert_ne!(pair_id("k", Some("m")), pair_id("k", Some("n")));
    assert_ne!(pair_id("k", Some("m")), pair_id("l", Some("m")));
    assert_eq!(pair_id("k", Some("m")), pair_id("k", Some("m")));
}
