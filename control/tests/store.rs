//! The store's contract, on SQLite and on a real PostgreSQL (a private cluster per test): writes,
//! constraint errors, revisions without holes, resumes and compaction; and, on PostgreSQL, what
//! several servers on one database must see: every change made through any of them, in revision
//! order, nothing skipped, also when a notification is lost.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;
use std::time::Duration;

use control::args;
use control::store::{Event, Kind, Store, StoreError};
use control_client::model::EventType;
use testkit::postgres::Postgres;

/// Where a test's stores live.
enum Db {
    Sqlite(tempfile::TempDir),
    Postgres(Postgres),
}

impl Db {
    fn sqlite() -> Self {
        Db::Sqlite(tempfile::tempdir().unwrap())
    }

    fn postgres() -> Self {
        Db::Postgres(Postgres::start().unwrap())
    }

    /// A store on this database (a second call on PostgreSQL is a second server).
    async fn open(&self, history: u64) -> Store {
        match self {
            Db::Sqlite(dir) => Store::open_with_history(&dir.path().join("s.db"), history)
                .await
                .unwrap(),
            Db::Postgres(pg) => Store::connect(&pg.url(), history).await.unwrap(),
        }
    }
}

/// Runs each contract on both engines.
macro_rules! on_both {
    ($($name:ident),* $(,)?) => {
        mod sqlite {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() { super::$name(super::Db::sqlite()).await })*
        }
        mod postgres {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() { super::$name(super::Db::postgres()).await })*
        }
    };
}

on_both!(
    events_are_recorded_and_resumable,
    pruned_history_falls_back_to_snapshot,
    unique_violations_are_told_apart_and_roll_back,
    a_failed_write_leaves_no_event_and_no_hole,
    a_list_and_a_watch_from_its_revision_miss_nothing,
);

const T: Duration = Duration::from_secs(10);

/// Inserts model `name` and its CREATED event.
async fn add_model(store: &Store, name: String) -> Result<i64, StoreError> {
    store
        .write(async move |tx| {
            let id = tx
                .sql()
                .insert(
                    "INSERT INTO models (name, data) VALUES ($1, '{}') RETURNING id",
                    args![name],
                )
                .await?;
            let data = serde_json::json!({"id": id, "name": name});
            tx.sql()
                .execute(
                    "UPDATE models SET data = $1 WHERE id = $2",
                    args![data.to_string(), id],
                )
                .await?;
            tx.emit(Kind::Models, EventType::Created, id, &data).await?;
            Ok(id)
        })
        .await
}

async fn next_live(live: &mut tokio::sync::broadcast::Receiver<Arc<Event>>) -> Arc<Event> {
    tokio::time::timeout(T, live.recv())
        .await
        .expect("no live event in time")
        .unwrap()
}

async fn events_are_recorded_and_resumable(db: Db) {
    let store = db.open(3).await;
    for i in 0..5 {
        add_model(&store, format!("m{i}")).await.unwrap();
    }
    assert_eq!(store.revision(), 5);
    let sub = store.subscribe(Kind::Models, Some(4)).await.unwrap();
    assert!(sub.resumed);
    assert_eq!(sub.initial.len(), 1);
    assert_eq!(sub.initial[0].revision, 5);
    let sub = store.subscribe(Kind::Models, Some(5)).await.unwrap();
    assert!(sub.resumed && sub.initial.is_empty());
    // A revision from the future falls back to a snapshot.
    let sub = store.subscribe(Kind::Models, Some(99)).await.unwrap();
    assert!(!sub.resumed);
    assert_eq!(sub.initial.len(), 5);
    // Another kind's history is not this kind's.
    let sub = store.subscribe(Kind::Workers, Some(4)).await.unwrap();
    assert!(sub.resumed && sub.initial.is_empty());
}

async fn pruned_history_falls_back_to_snapshot(db: Db) {
    let store = db.open(2).await;
    for i in 0..6 {
        add_model(&store, format!("m{i}")).await.unwrap();
    }
    let sub = store.subscribe(Kind::Models, Some(1)).await.unwrap();
    assert!(!sub.resumed, "revision 2 was compacted away");
    assert_eq!(sub.initial.len(), 6);
    assert!(sub.initial.iter().all(|e| e.revision == 6));
    let sub = store.subscribe(Kind::Models, Some(4)).await.unwrap();
    assert!(sub.resumed);
    assert_eq!(
        sub.initial.iter().map(|e| e.revision).collect::<Vec<_>>(),
        [5, 6]
    );
}

async fn unique_violations_are_told_apart_and_roll_back(db: Db) {
    let store = db.open(100).await;
    add_model(&store, "taken".into()).await.unwrap();
    let err = add_model(&store, "taken".into()).await.unwrap_err();
    assert!(err.is_unique_violation(), "{err}");
    let other = store
        .write(async |tx| {
            tx.sql()
                .execute("INSERT INTO no_such_table (x) VALUES (1)", &[])
                .await
                .map(|_| ())
        })
        .await
        .unwrap_err();
    assert!(!other.is_unique_violation(), "{other}");
    // `execute` counts the rows it changed, on both engines.
    let changed = store
        .write(async |tx| {
            tx.sql()
                .execute(
                    "UPDATE models SET data = data WHERE name = $1",
                    args!["taken"],
                )
                .await
        })
        .await
        .unwrap();
    assert_eq!(changed, 1);
    let names = store
        .read(async |sql| {
            sql.query("SELECT name FROM models ORDER BY id", &[])
                .await?
                .iter()
                .map(|r| r.get::<String>(0))
                .collect::<Result<Vec<_>, _>>()
        })
        .await
        .unwrap();
    assert_eq!(names, ["taken"]);
}

async fn a_failed_write_leaves_no_event_and_no_hole(db: Db) {
    let store = db.open(100).await;
    add_model(&store, "a".into()).await.unwrap();
    // Emits, then fails: the event and its revision roll back with everything else.
    let failed = store
        .write(async |tx| -> Result<(), StoreError> {
            tx.emit(Kind::Models, EventType::Updated, 1, &"x").await?;
            Err(StoreError::Decode("refused".into()))
        })
        .await;
    assert!(failed.is_err());
    assert_eq!(store.revision(), 1);
    add_model(&store, "b".into()).await.unwrap();
    let sub = store.subscribe(Kind::Models, Some(0)).await.unwrap();
    let revisions: Vec<u64> = sub.initial.iter().map(|e| e.revision).collect();
    assert_eq!(revisions, [1, 2]);
}

async fn a_list_and_a_watch_from_its_revision_miss_nothing(db: Db) {
    let store = db.open(1000).await;
    add_model(&store, "before".into()).await.unwrap();
    let (names, revision) = store
        .read_at_revision(async |sql, rev| {
            let rows = sql.query("SELECT name FROM models", &[]).await?;
            Ok((rows.len(), rev))
        })
        .await
        .unwrap();
    assert_eq!((names, revision), (1, 1));
    add_model(&store, "after".into()).await.unwrap();
    let mut sub = store.subscribe(Kind::Models, Some(revision)).await.unwrap();
    assert!(sub.resumed);
    assert_eq!(sub.initial.len(), 1);
    assert_eq!(sub.initial[0].revision, 2);
    add_model(&store, "live".into()).await.unwrap();
    let live = next_live(&mut sub.live).await;
    assert_eq!(live.revision, 3);
}

/// Two servers on one database: a change through either reaches the other's watchers, and
/// concurrent writers through both produce one gapless, ordered stream on a third.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn servers_on_one_database_see_every_change_in_order() {
    let db = Db::postgres();
    let (a, b, c) = (
        db.open(10_000).await,
        db.open(10_000).await,
        db.open(10_000).await,
    );
    assert!(a.is_shared());
    // The writers' own watchers too: their own events and the other's, interleaved.
    let mut watches = Vec::new();
    for store in [&a, &b, &c] {
        let sub = store.subscribe(Kind::Models, None).await.unwrap();
        assert!(sub.initial.is_empty());
        watches.push(sub);
    }
    add_model(&a, "from-a".into()).await.unwrap();
    for watch in &mut watches {
        let seen = next_live(&mut watch.live).await;
        assert_eq!((seen.revision, seen.object_id), (1, 1));
    }

    const EACH: usize = 100;
    let mut writers = tokio::task::JoinSet::new();
    for (server, store) in [("a", a.clone()), ("b", b.clone())] {
        for w in 0..4 {
            let store = store.clone();
            writers.spawn(async move {
                for i in 0..EACH / 4 {
                    add_model(&store, format!("{server}-{w}-{i}"))
                        .await
                        .unwrap();
                }
            });
        }
    }
    while let Some(done) = writers.join_next().await {
        done.unwrap();
    }
    for watch in &mut watches {
        let mut last = 1;
        while last < 1 + 2 * EACH as u64 {
            let event = next_live(&mut watch.live).await;
            assert_eq!(event.revision, last + 1, "skipped or reordered");
            last = event.revision;
        }
    }
    // Every server's feed reached the end, and a resume from anywhere on any server agrees.
    for store in [&a, &b, &c] {
        let sub = store.subscribe(Kind::Models, Some(150)).await.unwrap();
        assert!(sub.resumed);
        let revisions: Vec<u64> = sub.initial.iter().map(|e| e.revision).collect();
        assert_eq!(revisions, (151..=201).collect::<Vec<_>>());
    }
}

/// NOTIFY is not delivered to a listener that lost its connection: the tailer reconnects,
/// catches up, and a watcher misses nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_listener_connection_loses_no_event() {
    let db = Db::postgres();
    let (a, b) = (db.open(10_000).await, db.open(10_000).await);
    let mut watch_b = b.subscribe(Kind::Models, None).await.unwrap();
    add_model(&a, "first".into()).await.unwrap();
    assert_eq!(next_live(&mut watch_b.live).await.revision, 1);

    let killed = a
        .read(async |sql| {
            Ok(sql
                .query(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                     WHERE query LIKE 'LISTEN%' AND pid <> pg_backend_pid()",
                    &[],
                )
                .await?
                .len())
        })
        .await
        .unwrap();
    assert_eq!(killed, 2, "one listener per server");
    for i in 0..20 {
        add_model(&a, format!("while-away-{i}")).await.unwrap();
    }
    for want in 2..=21 {
        assert_eq!(next_live(&mut watch_b.live).await.revision, want);
    }
}

/// A write acknowledged by one server survives that server's store being dropped mid-flight of
/// others, and a server started later sees the whole history.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_server_starts_from_the_committed_state() {
    let db = Db::postgres();
    let a = db.open(10_000).await;
    for i in 0..10 {
        add_model(&a, format!("m{i}")).await.unwrap();
    }
    drop(a);
    let b = db.open(10_000).await;
    assert_eq!(b.revision(), 10);
    let sub = b.subscribe(Kind::Models, None).await.unwrap();
    assert_eq!(sub.initial.len(), 10);
    assert_eq!(sub.revision, 10);
}

/// Each worker's name, state and whether it has a heartbeat time, in order.
async fn liveness(store: &Store) -> Vec<(String, String, bool)> {
    let rows = store
        .read(async |sql| {
            sql.query(
                "SELECT name, state, heartbeat_at IS NOT NULL FROM workers ORDER BY id",
                &[],
            )
            .await
        })
        .await
        .unwrap();
    rows.iter()
        .map(|r| {
            (
                r.get(0).unwrap(),
                r.get(1).unwrap(),
                r.get::<i64>(2).unwrap() != 0,
            )
        })
        .collect()
}

/// A database a previous faden left at schema version 2 (before the workers' liveness columns)
/// is migrated on open: its rows kept, each worker's state copied to its column, and a ready
/// worker given a heartbeat time to be counted from.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_2_database_is_migrated_on_both_engines() {
    const WORKERS: &str = "INSERT INTO clusters (name, reg_access_id, data) VALUES ('c', 'r', '{}');
         INSERT INTO workers (cluster_id, name, data) VALUES (1, 'up', '{\"state\":\"ready\"}');
         INSERT INTO workers (cluster_id, name, data) VALUES (1, 'down', '{\"state\":\"not_ready\"}');";
    let want = [
        ("up".to_owned(), "ready".to_owned(), true),
        ("down".to_owned(), "not_ready".to_owned(), false),
    ];

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.db");
    {
        let options = sqlx::sqlite::SqliteConnectOptions::new()
            .filename(&path)
            .create_if_missing(true);
        let pool = sqlx::SqlitePool::connect_with(options).await.unwrap();
        for sql in [
            include_str!("../migrations/sqlite/0001_initial.sql"),
            include_str!("../migrations/sqlite/0002_orphan_instances.sql"),
            WORKERS,
            "PRAGMA user_version = 2",
        ] {
            sqlx::raw_sql(sql).execute(&pool).await.unwrap();
        }
        pool.close().await;
    }
    let store = Store::open(&path).await.unwrap();
    assert_eq!(liveness(&store).await, want, "sqlite");

    let pg = Postgres::start().unwrap();
    {
        let pool = sqlx::PgPool::connect(&pg.url()).await.unwrap();
        for sql in [
            include_str!("../migrations/postgres/0001_initial.sql"),
            include_str!("../migrations/postgres/0002_orphan_instances.sql"),
            WORKERS,
            "CREATE TABLE faden_schema (version BIGINT NOT NULL);
             INSERT INTO faden_schema (version) VALUES (2);",
        ] {
            sqlx::raw_sql(sql).execute(&pool).await.unwrap();
        }
        pool.close().await;
    }
    let store = Store::connect(&pg.url(), 100).await.unwrap();
    assert_eq!(liveness(&store).await, want, "postgres");
}
