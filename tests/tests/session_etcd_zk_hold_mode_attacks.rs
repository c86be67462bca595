//! Attacks on semaphores and read-write locks in the SQL session modes
//! (PostgreSQL advisory locks, MySQL `GET_LOCK`), on etcd and on
//! ZooKeeper: a share attempt stalled behind a proxy while it holds its
//! key's gate, a waiting writer stalled between two slices, a crowd of
//! mixed modes from several processes, a stream of readers against a
//! waiting writer, a waiting writer's connection ended under it, a reader's
//! connection ended mid-hold, a plain lock and a permit racing, another
//! permit count asked by a second deployment while the first holds,
//! acquisitions dropped beside `tokio::select!` siblings, many names,
//! holders partitioned from their server beside a healthy process, a
//! waiter whose etcd session lease or ZooKeeper session ends while it
//! waits, an etcd permit whose entry or slot claim an operator deletes, and
//! tokens across a revocation.
#![cfg(any(
    feature = "postgres",
    feature = "mysql",
    feature = "etcd",
    feature = "zookeeper"
))]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dlock_runtime::{LockError, LockGuard, Registry};
use dlock_tests::unique_key;

/// The token of a guard.
fn token(guard: &LockGuard) -> u64 {
    guard.fencing_token().expect("a token").get()
}

/// Readers that keep overlapping (one always inside) while a writer waits:
/// answers how long the writer waited (it must get in).
async fn writer_wait_under_reader_churn(
    readers: [Registry; 2],
    writer: Registry,
    case: &str,
) -> Duration {
    let key = unique_key(case);
    let stop = Arc::new(AtomicBool::new(false));
    let tasks: Vec<_> = (0..4)
        .map(|i| {
            let (locks, key, stop) = (readers[i % 2].clone(), key.clone(), stop.clone());
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(25 * i as u64)).await;
                while !stop.load(Ordering::SeqCst) {
                    let g = locks
                        .lock(&key)
                        .read()
                        .wait(Duration::from_secs(30))
                        .acquire()
                        .await
                        .expect("a reader within its wait");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    g.release().await.expect("release");
                }
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let started = Instant::now();
    let granted = writer
        .lock(&key)
        .wait(Duration::from_secs(15))
        .acquire()
        .await;
    let took = started.elapsed();
    stop.store(true, Ordering::SeqCst);
    let granted = granted.unwrap_or_else(|e| panic!("the writer never got in: {e}"));
    granted.release().await.expect("release");
    for task in tasks {
        task.await.expect("task");
    }
    took
}

/// What the crowd saw: holders inside now, by slot, and every error.
#[derive(Default)]
struct Crowd {
    /// Permit holders inside now (their slots).
    inside: Vec<u32>,
    /// The highest token each slot was granted so far.
    last_token: std::collections::HashMap<u32, u64>,
    /// Readers and writers inside the read-write key now.
    readers: usize,
    writers: usize,
    /// What went wrong.
    violations: Vec<String>,
}

/// `tasks` tasks on each of `registries`, each taking permits of a
/// semaphore of 2 (and, when `rw`, readers and writers of another key) with
/// waits for `run`: never more than 2 permit holders, never two on one
/// slot, each slot's tokens strictly increasing in grant order, never a
/// writer beside anyone, and no error but a retryable one (busy at the end
/// of a wait, an attempt left unanswered at its deadline on a loaded
/// machine): no mismatch, no permanent failure. Answers the violations and
/// how many grants there were.
async fn crowd(
    registries: &[Registry],
    rw: bool,
    run: Duration,
    case: &str,
) -> (Vec<String>, usize) {
    let sem_key = unique_key(&format!("{case}-sem"));
    let rw_key = unique_key(&format!("{case}-rw"));
    let seen = Arc::new(Mutex::new(Crowd::default()));
    let grants = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let deadline = Instant::now() + run;
    let mut tasks = Vec::new();
    for (r, registry) in registries.iter().enumerate() {
        for t in 0..3usize {
            let (registry, seen, grants) = (registry.clone(), seen.clone(), grants.clone());
            let (sem_key, rw_key) = (sem_key.clone(), rw_key.clone());
            tasks.push(tokio::spawn(async move {
                let mut round = 0usize;
                while Instant::now() < deadline {
                    round += 1;
                    let pick = (r + t + round) % if rw { 3 } else { 1 };
                    let builder = match pick {
                        0 => registry.lock(&sem_key).permits(2),
                        1 => registry.lock(&rw_key).read(),
                        _ => registry.lock(&rw_key).write(),
                    };
                    let guard = match builder
                        .wait(Duration::from_secs(10))
                        .lease(Duration::from_secs(10))
                        .acquire()
                        .await
                    {
                        Ok(guard) => guard,
                        // Busy at the end of a wait, or (a loaded machine)
                        // its last attempt unanswered at the deadline.
                        Err(e) if e.is_retryable() => continue,
                        Err(e) => {
                            seen.lock()
                                .unwrap()
                                .violations
                                .push(format!("pick {pick}: {e}"));
                            continue;
                        }
                    };
                    grants.fetch_add(1, Ordering::SeqCst);
                    {
                        let mut s = seen.lock().unwrap();
                        match pick {
                            0 => {
                                let slot = guard.permit().expect("a permit has a slot");
                                let tok = token(&guard);
                                if s.inside.contains(&slot) {
                                    s.violations.push(format!("two holders of slot {slot}"));
                                }
                                s.inside.push(slot);
                                if s.inside.len() > 2 {
                                    let inside = s.inside.clone();
                                    s.violations.push(format!("permit holders {inside:?}"));
                                }
                                if slot >= 2 {
                                    s.violations.push(format!("slot {slot} of 2 permits"));
                                }
                                if let Some(&last) = s.last_token.get(&slot)
                                    && tok <= last
                                {
                                    s.violations
                                        .push(format!("slot {slot}: token {tok} after {last}"));
                                }
                                s.last_token.insert(slot, tok);
                            }
                            1 => {
                                s.readers += 1;
                                if s.writers > 0 {
                                    s.violations.push("a reader beside a writer".into());
                                }
                            }
                            _ => {
                                s.writers += 1;
                                if s.writers > 1 || s.readers > 0 {
                                    let (w, rd) = (s.writers, s.readers);
                                    s.violations
                                        .push(format!("a writer beside {w} writers, {rd} readers"));
                                }
                            }
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(5 + (round % 4) as u64 * 10)).await;
                    {
                        let mut s = seen.lock().unwrap();
                        match pick {
                            0 => {
                                let slot = guard.permit().expect("slot");
                                s.inside.retain(|&x| x != slot);
                            }
                            1 => s.readers -= 1,
                            _ => s.writers -= 1,
                        }
                    }
                    if let Err(e) = guard.release().await {
                        seen.lock()
                            .unwrap()
                            .violations
                            .push(format!("release: {e}"));
                    }
                }
            }));
        }
    }
    for task in tasks {
        task.await.expect("task");
    }
    let violations = std::mem::take(&mut seen.lock().unwrap().violations);
    (violations, grants.load(Ordering::SeqCst))
}

/// `holder` (whose only way to its server is cut by `cut`) holds both
/// permits of a semaphore of 2 with `lease`; `other` waits for one. Each
/// of the holder's permits hears of its loss before `other` is granted one,
/// and the slot's next token is larger.
async fn a_partitioned_permit_holder_hears_before_anyone_is_granted(
    holder: Registry,
    other: Registry,
    cut: impl FnOnce(),
    lease: Duration,
    case: &str,
) {
    a_partitioned_holder_hears_before_anyone_is_granted(holder, other, cut, lease, false, case)
        .await;
}

/// As [`a_partitioned_permit_holder_hears_before_anyone_is_granted`], for
/// two readers and a waiting writer (`read`), or two permits of 2 and a
/// third permit.
async fn a_partitioned_holder_hears_before_anyone_is_granted(
    holder: Registry,
    other: Registry,
    cut: impl FnOnce(),
    lease: Duration,
    read: bool,
    case: &str,
) {
    let key = unique_key(case);
    let take = |r: &Registry| {
        if read {
            r.lock(&key).read().lease(lease)
        } else {
            r.lock(&key).permits(2).lease(lease)
        }
    };
    // A wait: a loaded machine may need more than one attempt.
    let hold = |r: &Registry| take(r).wait(Duration::from_secs(20)).acquire();
    let held = [
        hold(&holder).await.expect("first"),
        hold(&holder).await.expect("second"),
    ];
    let waiter = tokio::spawn({
        let builder = if read {
            other.lock(&key).write().lease(lease)
        } else {
            take(&other)
        }
        .wait(Duration::from_secs(40));
        async move {
            let next = builder.acquire().await;
            (next, Instant::now())
        }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    // The premise: both holds are the holder's, at once. A holder whose
    // session was lost between them (its keep-alives starved for most of
    // its TTL) was told so, and its second hold may reuse the first one's
    // slot: that is not the partition this test is about.
    assert!(
        held.iter().all(|g| !g.is_lost()),
        "{case}: a hold was lost before the partition"
    );
    assert!(
        read || held[0].permit() != held[1].permit(),
        "{case}: both holds have slot {:?}",
        held[0].permit()
    );
    assert!(!waiter.is_finished(), "{case}: both permits are held");
    cut();
    let mut lost_at = Vec::new();
    for g in &held {
        tokio::time::timeout(Duration::from_secs(30), g.lost())
            .await
            .unwrap_or_else(|_| panic!("{case}: the holder never heard of its loss"));
        lost_at.push(Instant::now());
    }
    let (next, granted_at) = tokio::time::timeout(Duration::from_secs(40), waiter)
        .await
        .unwrap_or_else(|_| panic!("{case}: the waiter was never served"))
        .expect("task");
    let next = next.unwrap_or_else(|e| panic!("{case}: {e}"));
    let first_lost = lost_at.iter().min().copied().expect("two");
    assert!(
        first_lost < granted_at,
        "{case}: granted {:?} before a holder heard of its loss",
        first_lost - granted_at
    );
    let before = if read {
        held.iter().map(token).max().expect("two")
    } else {
        held.iter()
            .find(|g| g.permit() == next.permit())
            .map(token)
            .expect("the freed slot was one of the holder's")
    };
    assert!(
        token(&next) > before,
        "{case}: token {} after {before}",
        token(&next)
    );
    next.release().await.expect("release");
}

/// A second deployment asking for another number of permits while the
/// first one's holders are there is refused at once (even with a long
/// wait), naming both numbers; once every permit is free it is granted.
async fn another_permit_count_from_a_second_deployment(
    first: Registry,
    second: Registry,
    db: &str,
) {
    let key = unique_key(&format!("{db}-redeploy"));
    let held = first
        .lock(&key)
        .permits(2)
        .lease(Duration::from_secs(30))
        .wait(Duration::from_secs(20))
        .acquire()
        .await
        .expect("first deployment");
    let started = Instant::now();
    let refused = second
        .lock(&key)
        .permits(3)
        .wait(Duration::from_secs(10))
        .acquire()
        .await;
    match &refused {
        Err(LockError::Config { .. }) => {
            let text = refused.as_ref().err().unwrap().to_string();
            assert!(text.contains('2') && text.contains('3'), "{db}: {text}");
        }
        other => panic!("{db}: {:?}", other.as_ref().map(|g| g.permit())),
    }
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{db}: refused only after {:?}",
        started.elapsed()
    );
    held.release().await.expect("release");
    let now = second
        .lock(&key)
        .permits(3)
        .wait(Duration::from_secs(5))
        .acquire()
        .await
        .unwrap_or_else(|e| panic!("{db}: every permit was free: {e}"));
    now.release().await.expect("release");
}

#[cfg(any(feature = "postgres", feature = "mysql"))]
mod sql {
    use super::*;
    use dlock_tests::sql_db::SqlDb;
    use dlock_tests::sql_support::{Fault, SqlMode, proxy_to, via};

    /// A registry in session mode on connections of its own, with `options`
    /// (`&a=b…`).
    pub(super) async fn session(db: SqlDb, options: &str) -> Registry {
        db.connect(&SqlMode::Session.query_with(options))
            .await
            .registry()
    }

    /// A share attempt whose slot walk stalls on the wire while it holds its
    /// key's gate — its process frozen, or cut off behind a proxy that keeps
    /// the sockets open, its cancel and end connections stalled too — keeps
    /// the other processes out of the key's free permits no longer than the
    /// attempt's bound (`timeout`, 1 s here; the lease is 30 s): the server
    /// ends the stalled session, and its gate with it.
    async fn a_share_attempt_stalled_holding_the_gate(db: SqlDb, needle: &[u8]) {
        let proxy = proxy_to(&db.host_port()).await;
        let stalled_url = format!("{}?mode=session&timeout=1s", via(&db.url(), proxy.addr()));
        let stalled = db
            .connect_url(&stalled_url)
            .await
            .expect("connect")
            .registry();
        let healthy = session(db, "").await;
        let key = unique_key(&format!("sql-session-stalled-gate-{db:?}"));
        proxy.hold_next(&[needle], Duration::from_secs(600));
        let attempt = tokio::spawn({
            let key = key.clone();
            async move {
                stalled
                    .lock(&key)
                    .permits(2)
                    .lease(Duration::from_secs(30))
                    .acquire()
                    .await
            }
        });
        let trapped = Instant::now();
        while proxy.held_on().is_none() {
            assert!(
                trapped.elapsed() < Duration::from_secs(10),
                "the slot walk never ran"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // Everything of that process stalls from now on.
        proxy.set(Fault::Hold);
        let started = Instant::now();
        let granted = healthy
            .lock(&key)
            .permits(2)
            .lease(Duration::from_secs(10))
            .wait(Duration::from_secs(20))
            .acquire()
            .await;
        let took = started.elapsed();
        let out = match granted {
            Ok(guard) => {
                let slot = guard.permit();
                guard.release().await.expect("release");
                Ok((slot, took))
            }
            Err(e) => Err(e),
        };
        proxy.set(Fault::Pass);
        drop(proxy);
        let _ = tokio::time::timeout(Duration::from_secs(10), attempt).await;
        match out {
            Ok((slot, took)) => {
                assert_eq!(slot, Some(0), "{db:?}");
                assert!(took < Duration::from_secs(10), "{db:?}: waited {took:?}");
            }
            Err(e) => panic!(
                "{db:?}: no free permit of two within 20 s while another process stalled \
                 mid-attempt ({took:?}): {e}"
            ),
        }
    }

    #[cfg(feature = "postgres")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_a_share_attempt_stalled_holding_the_gate_frees_it_within_its_bound() {
        a_share_attempt_stalled_holding_the_gate(SqlDb::Postgres, b"END::bigint").await;
    }

    #[cfg(feature = "mysql")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn mysql_a_share_attempt_stalled_holding_the_gate_frees_it_within_its_bound() {
        a_share_attempt_stalled_holding_the_gate(SqlDb::Mysql, b"', 0) = 1 THEN 0 ").await;
    }

    /// Four processes of three tasks each on permits of 2 (and, on
    /// PostgreSQL, readers and writers): see [`crowd`].
    async fn a_crowd_of_processes(db: SqlDb, rw: bool) {
        let mut registries = Vec::new();
        for _ in 0..4 {
            registries.push(session(db, "").await);
        }
        let (violations, grants) = crowd(
            &registries,
            rw,
            Duration::from_secs(8),
            &format!("sql-session-crowd-{db:?}"),
        )
        .await;
        assert!(violations.is_empty(), "{db:?}: {violations:#?}");
        assert!(grants >= 20, "{db:?}: only {grants} grants");
    }

    #[cfg(feature = "postgres")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_session_crowd_of_permits_readers_and_writers_keeps_every_invariant() {
        a_crowd_of_processes(SqlDb::Postgres, true).await;
    }

    #[cfg(feature = "mysql")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn mysql_session_crowd_of_permits_keeps_every_invariant() {
        a_crowd_of_processes(SqlDb::Mysql, false).await;
    }

    #[cfg(feature = "postgres")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_session_a_stream_of_readers_never_starves_a_waiting_writer() {
        let readers = [
            session(SqlDb::Postgres, "").await,
            session(SqlDb::Postgres, "").await,
        ];
        let writer = session(SqlDb::Postgres, "").await;
        let took =
            writer_wait_under_reader_churn(readers, writer, "pg-session-reader-stream").await;
        assert!(took < Duration::from_secs(8), "the writer waited {took:?}");
    }

    /// The server processes waiting for the advisory lock of `stored_key`.
    #[cfg(feature = "postgres")]
    async fn pg_waiting_for(stored_key: &str) -> Vec<i32> {
        use sqlx::Connection as _;
        let mut conn = sqlx::PgConnection::connect(&SqlDb::Postgres.url())
            .await
            .expect("connect");
        let k = dlock_tests::sql_support::session_hash(stored_key) as i64;
        sqlx::query_scalar(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND NOT granted \
             AND objsubid = 1 AND ((classid::bigint << 32) | objid::bigint) = $1",
        )
        .bind(k)
        .fetch_all(&mut conn)
        .await
        .expect("pg_locks")
    }

    #[cfg(feature = "postgres")]
    async fn pg_terminate(pids: &[i32]) {
        use sqlx::Connection as _;
        let mut conn = sqlx::PgConnection::connect(&SqlDb::Postgres.url())
            .await
            .expect("connect");
        for pid in pids {
            sqlx::query("SELECT pg_terminate_backend($1)")
                .bind(pid)
                .execute(&mut conn)
                .await
                .expect("terminate");
        }
    }

    /// A writer waiting behind a reader whose server connection is ended
    /// (`pg_terminate_backend`) goes on waiting on a new one and is still
    /// preferred: a new reader stays out, and the writer gets the key when
    /// the first reader leaves, with a larger token.
    #[cfg(feature = "postgres")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_session_a_waiting_writer_whose_connection_is_ended_stays_preferred() {
        let holding = session(SqlDb::Postgres, "").await;
        let waiting = session(SqlDb::Postgres, "").await;
        let key = unique_key("pg-session-writer-ended");
        let stored = format!("dlock:{key}");
        let reader = holding
            .lock(&key)
            .read()
            .lease(Duration::from_secs(30))
            .acquire()
            .await
            .expect("reader");
        let writer = tokio::spawn({
            let key = key.clone();
            async move {
                waiting
                    .lock(&key)
                    .lease(Duration::from_secs(30))
                    .wait(Duration::from_secs(30))
                    .acquire()
                    .await
            }
        });
        let started = Instant::now();
        let pids = loop {
            let pids = pg_waiting_for(&stored).await;
            if !pids.is_empty() {
                break pids;
            }
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "the writer never waited"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        pg_terminate(&pids).await;
        // On a new connection, the writer waits again (and holds its mark).
        let started = Instant::now();
        while pg_waiting_for(&stored).await.is_empty() {
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "the writer gave up waiting: {:?}",
                writer.is_finished()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        for _ in 0..5 {
            let late = holding.lock(&key).read().acquire().await;
            assert!(
                matches!(late, Err(LockError::Busy { .. })),
                "a new reader beside a waiting writer: {:?}",
                late.as_ref().map(|g| g.fencing_token())
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let reader_token = token(&reader);
        reader.release().await.expect("release");
        let writer = tokio::time::timeout(Duration::from_secs(10), writer)
            .await
            .expect("the writer is granted once the reader left")
            .expect("task")
            .expect("the writer's grant");
        assert!(token(&writer) > reader_token);
        writer.release().await.expect("release");
    }

    /// A writer waiting behind a reader whose process stalls (cut off behind
    /// a proxy that keeps its sockets open) between two slices of its wait
    /// — holding its waiting-writer mark — keeps new readers out no longer
    /// than its lease (3 s): once the first reader has left, a new reader
    /// gets in.
    #[cfg(feature = "postgres")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_session_a_stalled_waiting_writer_keeps_readers_out_no_longer_than_its_lease()
    {
        let proxy = proxy_to(&SqlDb::Postgres.host_port()).await;
        let stalled_url = format!(
            "{}?mode=session&timeout=1s",
            via(&SqlDb::Postgres.url(), proxy.addr())
        );
        let stalled = SqlDb::Postgres
            .connect_url(&stalled_url)
            .await
            .expect("connect")
            .registry();
        let healthy = session(SqlDb::Postgres, "").await;
        let key = unique_key("pg-session-stalled-writer");
        let stored = format!("dlock:{key}");
        let reader = healthy
            .lock(&key)
            .read()
            .lease(Duration::from_secs(30))
            .acquire()
            .await
            .expect("reader");
        let writer = tokio::spawn({
            let key = key.clone();
            async move {
                stalled
                    .lock(&key)
                    .lease(Duration::from_secs(3))
                    .wait(Duration::from_secs(60))
                    .acquire()
                    .await
            }
        });
        let started = Instant::now();
        while pg_waiting_for(&stored).await.is_empty() {
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "the writer never waited"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        proxy.set(Fault::Hold);
        // Its slice (a third of its lease) ends on the server meanwhile.
        tokio::time::sleep(Duration::from_secs(2)).await;
        reader.release().await.expect("release");
        let started = Instant::now();
        let next = healthy
            .lock(&key)
            .read()
            .wait(Duration::from_secs(20))
            .acquire()
            .await;
        let took = started.elapsed();
        proxy.set(Fault::Pass);
        drop(proxy);
        writer.abort();
        let next = next.unwrap_or_else(|e| panic!("no reader within 20 s ({took:?}): {e}"));
        next.release().await.expect("release");
        assert!(
            took < Duration::from_secs(10),
            "a new reader waited {took:?}"
        );
    }

    /// A reader whose connection is ended mid-hold hears of the loss at
    /// once; the other reader keeps its share; a writer waiting behind both
    /// enters once the other reader leaves, with a token above both.
    #[cfg(feature = "postgres")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_session_a_reader_ended_mid_hold_loses_only_its_share() {
        use sqlx::Connection as _;
        let one = session(SqlDb::Postgres, "").await;
        let two = session(SqlDb::Postgres, "").await;
        let writer_side = session(SqlDb::Postgres, "").await;
        let key = unique_key("pg-session-reader-ended");
        let stored = format!("dlock:{key}");
        let take = |r: &Registry| r.lock(&key).read().lease(Duration::from_secs(30)).acquire();
        let ended = take(&one).await.expect("first reader");
        let kept = take(&two).await.expect("second reader");
        let writer = tokio::spawn({
            let key = key.clone();
            async move {
                writer_side
                    .lock(&key)
                    .lease(Duration::from_secs(30))
                    .wait(Duration::from_secs(30))
                    .acquire()
                    .await
            }
        });
        tokio::time::sleep(Duration::from_millis(300)).await;
        // The first reader's server process: the holder of its reader slot.
        let mut conn = sqlx::PgConnection::connect(&SqlDb::Postgres.url())
            .await
            .expect("connect");
        let pid: i32 = sqlx::query_scalar(
            "SELECT l.pid FROM dlock_leases_fence f JOIN pg_locks l \
               ON l.locktype = 'advisory' AND l.granted AND l.objsubid = 1 \
              AND l.mode = 'ExclusiveLock' \
              AND ((l.classid::bigint << 32) | l.objid::bigint) = f.k \
             WHERE f.name = $1 AND f.slot IS NOT NULL AND f.token = $2",
        )
        .bind(&stored)
        .bind(token(&ended) as i64)
        .fetch_one(&mut conn)
        .await
        .expect("the first reader's process");
        pg_terminate(&[pid]).await;
        tokio::time::timeout(Duration::from_secs(5), ended.lost())
            .await
            .expect("the ended reader hears of its loss");
        assert!(
            tokio::time::timeout(Duration::from_millis(500), kept.lost())
                .await
                .is_err(),
            "the other reader keeps its share"
        );
        assert!(!writer.is_finished(), "a writer beside a reader");
        let top = token(&ended).max(token(&kept));
        kept.release().await.expect("release");
        let writer = tokio::time::timeout(Duration::from_secs(10), writer)
            .await
            .expect("the writer enters")
            .expect("task")
            .expect("grant");
        assert!(token(&writer) > top);
        writer.release().await.expect("release");
        let _ = ended.release().await;
    }

    #[cfg(feature = "postgres")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_session_another_permit_count_from_a_second_deployment_is_refused_at_once() {
        another_permit_count_from_a_second_deployment(
            session(SqlDb::Postgres, "").await,
            session(SqlDb::Postgres, "").await,
            "pg-session",
        )
        .await;
    }

    #[cfg(feature = "mysql")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn mysql_session_another_permit_count_from_a_second_deployment_is_refused_at_once() {
        another_permit_count_from_a_second_deployment(
            session(SqlDb::Mysql, "").await,
            session(SqlDb::Mysql, "").await,
            "my-session",
        )
        .await;
    }

    #[cfg(feature = "postgres")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_session_tokens_grow_across_a_revocation_of_permits_and_readers() {
        tokens_grow_across_a_revocation(
            session(SqlDb::Postgres, "").await,
            session(SqlDb::Postgres, "").await,
            true,
            "pg-session",
        )
        .await;
    }

    #[cfg(feature = "mysql")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn mysql_session_tokens_grow_across_a_revocation_of_permits() {
        tokens_grow_across_a_revocation(
            session(SqlDb::Mysql, "").await,
            session(SqlDb::Mysql, "").await,
            false,
            "my-session",
        )
        .await;
    }

    /// 150 names, each taken as a share that is granted, refused at the end
    /// of a short wait, and dropped mid-wait: afterwards the asking backend
    /// remembers no owner, and every name's permits are free.
    async fn many_names_leave_no_local_or_server_state(db: SqlDb, rw: bool) {
        let asking = db.connect(SqlMode::Session.query()).await;
        let asker = asking.registry();
        let holder = session(db, "").await;
        let case = unique_key(&format!("sql-session-names-{db:?}"));
        for i in 0..150u64 {
            let key = format!("{case}-{i}");
            let take = |r: &Registry| {
                if rw && i % 2 == 1 {
                    r.lock(&key).read()
                } else {
                    r.lock(&key).permits(2)
                }
            };
            take(&asker)
                .acquire()
                .await
                .expect("granted")
                .release()
                .await
                .expect("release");
            let blockers = if rw && i % 2 == 1 {
                vec![holder.lock(&key).write().acquire().await.expect("writer")]
            } else {
                vec![
                    take(&holder).acquire().await.expect("first"),
                    take(&holder).acquire().await.expect("second"),
                ]
            };
            // Busy — or, on a loaded machine, an attempt not answered
            // within so short a wait: never a grant beside the blockers.
            let refused = take(&asker).wait(Duration::from_millis(30)).acquire().await;
            assert!(
                matches!(
                    refused,
                    Err(LockError::Busy { .. } | LockError::Backend { .. })
                ),
                "{db:?} {i}: {:?}",
                refused.map(|g| g.permit())
            );
            let dropped = tokio::time::timeout(
                Duration::from_millis(i % 40),
                take(&asker).wait(Duration::from_secs(10)).acquire(),
            )
            .await;
            assert!(dropped.is_err(), "{db:?} {i}: granted beside its blockers");
            for g in blockers {
                g.release().await.expect("release");
            }
        }
        let started = Instant::now();
        loop {
            let debug = format!("{asking:?}");
            if debug.contains("sessions: Some(0)") {
                break;
            }
            assert!(
                started.elapsed() < Duration::from_secs(5),
                "{db:?}: {debug}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        for i in (0..150u64).step_by(7) {
            let key = format!("{case}-{i}");
            let a = holder
                .lock(&key)
                .permits(2)
                .wait(Duration::from_secs(3))
                .acquire()
                .await;
            let b = holder
                .lock(&key)
                .permits(2)
                .wait(Duration::from_secs(3))
                .acquire()
                .await;
            match (a, b) {
                (Ok(a), Ok(b)) => {
                    a.release().await.expect("release");
                    b.release().await.expect("release");
                }
                (a, b) => panic!(
                    "{db:?} {i}: {:?} {:?}",
                    a.map(|g| g.permit()),
                    b.map(|g| g.permit())
                ),
            }
        }
    }

    #[cfg(feature = "postgres")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_session_many_names_leave_no_local_or_server_state() {
        many_names_leave_no_local_or_server_state(SqlDb::Postgres, true).await;
    }

    #[cfg(feature = "mysql")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn mysql_session_many_names_leave_no_local_or_server_state() {
        many_names_leave_no_local_or_server_state(SqlDb::Mysql, false).await;
    }

    /// See [`a_partitioned_permit_holder_hears_before_anyone_is_granted`]:
    /// the holder's server ends its session at its idle limit (the lease,
    /// 6 s).
    async fn a_partitioned_session_permit_holder(db: SqlDb) {
        let proxy = proxy_to(&db.host_port()).await;
        let cut_url = format!("{}?mode=session&timeout=1s", via(&db.url(), proxy.addr()));
        let holder = db.connect_url(&cut_url).await.expect("connect").registry();
        a_partitioned_permit_holder_hears_before_anyone_is_granted(
            holder,
            session(db, "").await,
            || proxy.set(Fault::Hold),
            Duration::from_secs(6),
            &format!("sql-session-partitioned-{db:?}"),
        )
        .await;
        proxy.set(Fault::Pass);
    }

    #[cfg(feature = "postgres")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_session_a_partitioned_permit_holder_hears_before_anyone_is_granted() {
        a_partitioned_session_permit_holder(SqlDb::Postgres).await;
    }

    #[cfg(feature = "postgres")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_session_partitioned_readers_hear_before_a_writer_is_granted() {
        let db = SqlDb::Postgres;
        let proxy = proxy_to(&db.host_port()).await;
        let cut_url = format!("{}?mode=session&timeout=1s", via(&db.url(), proxy.addr()));
        let holder = db.connect_url(&cut_url).await.expect("connect").registry();
        a_partitioned_holder_hears_before_anyone_is_granted(
            holder,
            session(db, "").await,
            || proxy.set(Fault::Hold),
            Duration::from_secs(6),
            true,
            "pg-session-partitioned-readers",
        )
        .await;
        proxy.set(Fault::Pass);
    }

    #[cfg(feature = "mysql")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn mysql_session_a_partitioned_permit_holder_hears_before_anyone_is_granted() {
        a_partitioned_session_permit_holder(SqlDb::Mysql).await;
    }

    /// A plain lock and a permit asked for at the same instant from two
    /// processes, on 60 fresh keys: never both granted.
    async fn a_plain_lock_and_a_permit_racing(db: SqlDb) {
        let (one, two) = (session(db, "").await, session(db, "").await);
        let case = unique_key(&format!("sql-session-plain-permit-race-{db:?}"));
        let mut both = Vec::new();
        for i in 0..60 {
            let key = format!("{case}-{i}");
            let (plain, permit) = tokio::join!(
                one.lock(&key).acquire(),
                two.lock(&key).permits(2).acquire()
            );
            if plain.is_ok() && permit.is_ok() {
                both.push(i);
            }
            for g in [plain, permit].into_iter().flatten() {
                g.release().await.expect("release");
            }
        }
        assert!(both.is_empty(), "{db:?}: both granted on keys {both:?}");
    }

    #[cfg(feature = "postgres")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_session_a_plain_lock_and_a_permit_racing_are_never_both_granted() {
        a_plain_lock_and_a_permit_racing(SqlDb::Postgres).await;
    }

    #[cfg(feature = "mysql")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn mysql_session_a_plain_lock_and_a_permit_racing_are_never_both_granted() {
        a_plain_lock_and_a_permit_racing(SqlDb::Mysql).await;
    }

    /// Share acquisitions dropped beside a sibling of a `tokio::select!` at
    /// 0–40 ms steps while both permits are taken and freed by another
    /// process leave nothing: afterwards both permits are free at once.
    async fn select_siblings_dropping_share_acquisitions(db: SqlDb) {
        let holder = session(db, "").await;
        let asker = session(db, "").await;
        let key = unique_key(&format!("sql-session-select-{db:?}"));
        for step in 0..40u64 {
            let a = holder.lock(&key).permits(2).acquire().await.expect("first");
            let b = holder
                .lock(&key)
                .permits(2)
                .acquire()
                .await
                .expect("second");
            let freeing = tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(step / 2)).await;
                a.release().await.expect("release");
                b.release().await.expect("release");
            });
            tokio::select! {
                got = asker.lock(&key).permits(2).wait(Duration::from_secs(5)).acquire() => {
                    got.expect("a permit").release().await.expect("release");
                }
                () = tokio::time::sleep(Duration::from_millis(step)) => {}
            }
            freeing.await.expect("task");
            let both = async {
                let x = holder
                    .lock(&key)
                    .permits(2)
                    .wait(Duration::from_secs(3))
                    .acquire()
                    .await;
                let y = holder
                    .lock(&key)
                    .permits(2)
                    .wait(Duration::from_secs(3))
                    .acquire()
                    .await;
                (x, y)
            };
            let (x, y) = both.await;
            match (x, y) {
                (Ok(x), Ok(y)) => {
                    assert_ne!(x.permit(), y.permit());
                    x.release().await.expect("release");
                    y.release().await.expect("release");
                }
                (x, y) => panic!(
                    "{db:?}: after a drop at {step} ms a permit stayed taken: {:?} {:?}",
                    x.map(|g| g.permit()),
                    y.map(|g| g.permit())
                ),
            }
        }
    }

    #[cfg(feature = "postgres")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_session_share_acquisitions_dropped_beside_select_siblings_leave_nothing() {
        select_siblings_dropping_share_acquisitions(SqlDb::Postgres).await;
    }

    #[cfg(feature = "mysql")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn mysql_session_share_acquisitions_dropped_beside_select_siblings_leave_nothing() {
        select_siblings_dropping_share_acquisitions(SqlDb::Mysql).await;
    }
}

#[cfg(feature = "etcd")]
mod etcd {
    use super::*;
    use dlock_tests::etcd_support::{admin, backend, registry, url};

    /// A backend on `url`, trying to connect again for up to 30 s (a loaded
    /// machine may not get its session's lease in one request bound).
    async fn backend_eventually(url: &str) -> dlock_runtime::EtcdBackend {
        let started = Instant::now();
        loop {
            match dlock_runtime::EtcdBackend::connect(url).await {
                Ok(backend) => return backend,
                Err(e) if started.elapsed() < Duration::from_secs(30) => {
                    eprintln!("connecting to {url}: {e}; again");
                }
                Err(e) => panic!("connect to {url}: {e}"),
            }
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn etcd_a_stream_of_readers_never_starves_a_waiting_writer() {
        let readers = [
            registry(&backend(&url()).await),
            registry(&backend(&url()).await),
        ];
        let writer = registry(&backend(&url()).await);
        let took = writer_wait_under_reader_churn(readers, writer, "etcd-reader-stream").await;
        assert!(took < Duration::from_secs(8), "the writer waited {took:?}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn etcd_crowd_of_permits_readers_and_writers_keeps_every_invariant() {
        let mut registries = Vec::new();
        for _ in 0..4 {
            registries.push(registry(&backend(&url()).await));
        }
        let (violations, grants) =
            crowd(&registries, true, Duration::from_secs(8), "etcd-crowd").await;
        assert!(violations.is_empty(), "{violations:#?}");
        assert!(grants >= 20, "only {grants} grants");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn etcd_a_partitioned_permit_holder_hears_before_anyone_is_granted() {
        let member = dlock_tests::etcd_support::endpoints(&url())[0].clone();
        let proxy = dlock_testkit::FaultProxy::start(member)
            .await
            .expect("proxy");
        let cut_url = dlock_tests::etcd_support::url_to(
            &[format!("127.0.0.1:{}", proxy.port())],
            "?session_ttl=6s",
        );
        a_partitioned_permit_holder_hears_before_anyone_is_granted(
            registry(&backend_eventually(&cut_url).await),
            registry(&backend(&url()).await),
            || proxy.set(dlock_testkit::Fault::Hold),
            Duration::from_secs(30),
            "etcd-partitioned-permits",
        )
        .await;
        proxy.set(dlock_testkit::Fault::Pass);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn etcd_partitioned_readers_hear_before_a_writer_is_granted() {
        let member = dlock_tests::etcd_support::endpoints(&url())[0].clone();
        let proxy = dlock_testkit::FaultProxy::start(member)
            .await
            .expect("proxy");
        let cut_url = dlock_tests::etcd_support::url_to(
            &[format!("127.0.0.1:{}", proxy.port())],
            "?session_ttl=6s",
        );
        a_partitioned_holder_hears_before_anyone_is_granted(
            registry(&backend_eventually(&cut_url).await),
            registry(&backend(&url()).await),
            || proxy.set(dlock_testkit::Fault::Hold),
            Duration::from_secs(30),
            true,
            "etcd-partitioned-readers",
        )
        .await;
        proxy.set(dlock_testkit::Fault::Pass);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn etcd_another_permit_count_from_a_second_deployment_is_refused_at_once() {
        another_permit_count_from_a_second_deployment(
            registry(&backend(&url()).await),
            registry(&backend(&url()).await),
            "etcd",
        )
        .await;
    }

    /// A permit holder whose entry (or slot claim) an operator deletes
    /// hears of its loss; from then on its slot is free for others, even
    /// while the lost holder's body has not returned yet (its guard alive).
    async fn a_permit_partly_deleted_frees_its_slot_at_the_loss(claim: bool) {
        let holding_etcd = backend(&url()).await;
        let holding = registry(&holding_etcd);
        let other = registry(&backend(&url()).await);
        let key = unique_key(if claim {
            "etcd-claim-deleted"
        } else {
            "etcd-entry-deleted"
        });
        let stored = format!("dlock:{key}");
        let take = |r: &Registry| r.lock(&key).permits(2).lease(Duration::from_secs(6));
        let gone = take(&holding).acquire().await.expect("first");
        let kept = take(&holding).acquire().await.expect("second");
        let [queue, slots, _] = dlock_tests::etcd_support::kept_under(&holding_etcd, &stored);
        let mut client = admin(&url()).await;
        let under = if claim { slots } else { queue };
        // The first entry, or the claim of slot 0: the first holder's.
        let first = dlock_tests::etcd_support::entries(&client, &under)
            .await
            .into_iter()
            .next()
            .expect("an entry")
            .0;
        client.delete(first, None).await.expect("delete");
        tokio::time::timeout(Duration::from_secs(10), gone.lost())
            .await
            .expect("the holder hears of its loss");
        let started = Instant::now();
        let next = take(&other).wait(Duration::from_secs(10)).acquire().await;
        let took = started.elapsed();
        let slot = gone.permit();
        let _ = gone.release().await;
        let next = next.unwrap_or_else(|e| {
            panic!("no permit while the lost holder's guard lived ({took:?}): {e}")
        });
        assert_eq!(next.permit(), slot);
        next.release().await.expect("release");
        kept.release().await.expect("release");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn etcd_a_permit_whose_entry_was_deleted_frees_its_slot_at_the_loss() {
        a_permit_partly_deleted_frees_its_slot_at_the_loss(false).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn etcd_a_permit_whose_slot_claim_was_deleted_frees_its_place_at_the_loss() {
        a_permit_partly_deleted_frees_its_slot_at_the_loss(true).await;
    }

    /// A permit waiter whose session's etcd lease ends while it waits (its
    /// queued entry goes with it) is still served when a permit frees — on
    /// a new session — and never beside two holders.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn etcd_a_permit_waiter_whose_session_lease_ends_is_still_served() {
        let holding = registry(&backend(&url()).await);
        let waiting_etcd = backend(&url()).await;
        let waiting = registry(&waiting_etcd);
        let key = unique_key("etcd-waiter-lease-ends");
        let take = |r: &Registry| r.lock(&key).permits(2).lease(Duration::from_secs(30));
        let a = take(&holding).acquire().await.expect("first");
        let b = take(&holding).acquire().await.expect("second");
        let waiter = tokio::spawn({
            let builder = take(&waiting).wait(Duration::from_secs(30));
            async move { builder.acquire().await }
        });
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(!waiter.is_finished(), "the waiter queues");
        let lease = waiting_etcd.session_lease_for_tests().expect("a session");
        admin(&url())
            .await
            .lease_revoke(lease)
            .await
            .expect("revoke");
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(
            !waiter.is_finished(),
            "both permits are still held: {:?}",
            waiter.is_finished()
        );
        let slot = a.permit();
        a.release().await.expect("release");
        let next = tokio::time::timeout(Duration::from_secs(10), waiter)
            .await
            .expect("the waiter is served")
            .expect("task")
            .expect("the waiter gets the freed permit");
        assert_eq!(next.permit(), slot);
        next.release().await.expect("release");
        b.release().await.expect("release");
    }

    /// A permit waiter that finds a slot claim with its own owner token
    /// under a lease not its session's — what an earlier attempt leaves
    /// when its claim's answer was lost and its session ended before the
    /// retry — is not granted on it (the lease takes the claim, and the
    /// slot, with it): it deletes the claim and goes on waiting beside the
    /// two holders, then gets the permit the first one frees.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn etcd_a_permit_waiter_is_never_granted_on_a_claim_of_an_ended_session() {
        let holding = registry(&backend(&url()).await);
        // A short session TTL: the waiter reads the queue again that often.
        let waiting_etcd = backend(&dlock_tests::etcd_support::url_to(
            &dlock_tests::etcd_support::endpoints(&url()),
            "?session_ttl=3s",
        ))
        .await;
        let waiting = registry(&waiting_etcd);
        let key = unique_key("etcd-stale-claim");
        let stored = format!("dlock:{key}");
        let take = |r: &Registry| r.lock(&key).permits(2).lease(Duration::from_secs(30));
        let a = take(&holding).acquire().await.expect("first");
        let b = take(&holding).acquire().await.expect("second");
        let waiter = tokio::spawn({
            let builder = take(&waiting).wait(Duration::from_secs(60));
            async move { builder.acquire().await }
        });
        let [queue, slots, _] = dlock_tests::etcd_support::kept_under(&waiting_etcd, &stored);
        let mut client = admin(&url()).await;
        let started = Instant::now();
        let entry = loop {
            let entries = dlock_tests::etcd_support::entries(&client, &format!("{queue}/")).await;
            if entries.len() == 3 {
                break entries[2].0.clone();
            }
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "the waiter never queued: {entries:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        // `{queue}/%P2:{owner}`: owner tokens need no escaping.
        let owner = entry
            .rsplit_once('/')
            .and_then(|(_, name)| name.split_once(':'))
            .map(|(_, owner)| owner.to_owned())
            .expect("a permit entry's name");
        let other_lease = client.lease_grant(60, None).await.expect("lease").id();
        let stale = format!("{slots}/7");
        client
            .put(
                stale.as_str(),
                owner,
                Some(etcd_client::PutOptions::new().with_lease(other_lease)),
            )
            .await
            .expect("put");
        let started = Instant::now();
        while !dlock_tests::etcd_support::entries(&client, &stale)
            .await
            .is_empty()
        {
            assert!(
                !waiter.is_finished(),
                "a permit granted beside two holders of two"
            );
            assert!(
                started.elapsed() < Duration::from_secs(15),
                "the waiter never read the slots again"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(
            !waiter.is_finished(),
            "a permit granted beside two holders of two"
        );
        let slot = a.permit();
        a.release().await.expect("release");
        let next = tokio::time::timeout(Duration::from_secs(15), waiter)
            .await
            .expect("the waiter is served")
            .expect("task")
            .expect("the waiter gets the freed permit");
        assert_eq!(next.permit(), slot);
        next.release().await.expect("release");
        b.release().await.expect("release");
        let _ = client.lease_revoke(other_lease).await;
    }

    /// After a revocation of a semaphore's holders and of a key's readers,
    /// the next grant of each slot, and the next reader, has a larger token.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn etcd_tokens_grow_across_a_revocation_of_permits_and_readers() {
        tokens_grow_across_a_revocation(
            registry(&backend(&url()).await),
            registry(&backend(&url()).await),
            true,
            "etcd",
        )
        .await;
    }
}

/// `holding` takes both permits of a semaphore (and, when `rw`, two readers
/// of another key); each key is revoked from `other`; the holders hear of
/// it, and the next grants (the same slots, a reader, a writer) have larger
/// tokens.
async fn tokens_grow_across_a_revocation(holding: Registry, other: Registry, rw: bool, case: &str) {
    let sem = unique_key(&format!("{case}-revoke-sem"));
    let rw_key = unique_key(&format!("{case}-revoke-rw"));
    let lease = Duration::from_secs(30);
    let p0 = holding
        .lock(&sem)
        .permits(2)
        .lease(lease)
        .acquire()
        .await
        .expect("p0");
    let p1 = holding
        .lock(&sem)
        .permits(2)
        .lease(lease)
        .acquire()
        .await
        .expect("p1");
    let readers = if rw {
        vec![
            holding
                .lock(&rw_key)
                .read()
                .lease(lease)
                .acquire()
                .await
                .expect("r0"),
            holding
                .lock(&rw_key)
                .read()
                .lease(lease)
                .acquire()
                .await
                .expect("r1"),
        ]
    } else {
        Vec::new()
    };
    let by_slot: std::collections::HashMap<_, _> =
        [(p0.permit(), token(&p0)), (p1.permit(), token(&p1))].into();
    let readers_top = readers.iter().map(token).max().unwrap_or(0);
    assert_eq!(other.revoke(&sem).await.expect("revoke").len(), 2);
    if rw {
        assert_eq!(other.revoke(&rw_key).await.expect("revoke").len(), 2);
    }
    for g in [&p0, &p1].into_iter().chain(&readers) {
        tokio::time::timeout(Duration::from_secs(20), g.lost())
            .await
            .expect("a revoked holder hears of it");
    }
    let n0 = other
        .lock(&sem)
        .permits(2)
        .wait(Duration::from_secs(5))
        .acquire()
        .await
        .expect("n0");
    let n1 = other
        .lock(&sem)
        .permits(2)
        .wait(Duration::from_secs(5))
        .acquire()
        .await
        .expect("n1");
    for n in [&n0, &n1] {
        let before = by_slot[&n.permit()];
        assert!(
            token(n) > before,
            "slot {:?}: {} after {before}",
            n.permit(),
            token(n)
        );
    }
    if rw {
        let reader = other
            .lock(&rw_key)
            .read()
            .wait(Duration::from_secs(5))
            .acquire()
            .await
            .expect("reader");
        assert!(token(&reader) > readers_top);
        reader.release().await.expect("release");
        let writer = other
            .lock(&rw_key)
            .wait(Duration::from_secs(5))
            .acquire()
            .await
            .expect("writer");
        assert!(token(&writer) > readers_top);
        writer.release().await.expect("release");
    }
    n0.release().await.expect("release");
    n1.release().await.expect("release");
    for g in [p0, p1].into_iter().chain(readers) {
        let _ = g.release().await;
    }
}

#[cfg(feature = "zookeeper")]
mod zookeeper {
    use super::*;
    use dlock_runtime::ZooKeeperBackend;
    use dlock_tests::zk_support::{ProxiedZk, url};

    async fn backend() -> ZooKeeperBackend {
        ZooKeeperBackend::connect(&url()).await.expect("connect")
    }

    fn registry(backend: &ZooKeeperBackend) -> Registry {
        Registry::builder().default_backend(backend.clone()).build()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn zookeeper_crowd_of_permits_readers_and_writers_keeps_every_invariant() {
        let mut registries = Vec::new();
        for _ in 0..4 {
            registries.push(registry(&backend().await));
        }
        let (violations, grants) =
            crowd(&registries, true, Duration::from_secs(8), "zk-crowd").await;
        assert!(violations.is_empty(), "{violations:#?}");
        assert!(grants >= 20, "only {grants} grants");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn zookeeper_a_partitioned_permit_holder_hears_before_anyone_is_granted() {
        let cut = ProxiedZk::connect().await;
        a_partitioned_permit_holder_hears_before_anyone_is_granted(
            registry(&cut.backend),
            registry(&backend().await),
            || cut.proxy.set(dlock_testkit::Fault::Hold),
            Duration::from_secs(30),
            "zk-partitioned-permits",
        )
        .await;
        cut.proxy.set(dlock_testkit::Fault::Pass);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn zookeeper_partitioned_readers_hear_before_a_writer_is_granted() {
        let cut = ProxiedZk::connect().await;
        a_partitioned_holder_hears_before_anyone_is_granted(
            registry(&cut.backend),
            registry(&backend().await),
            || cut.proxy.set(dlock_testkit::Fault::Hold),
            Duration::from_secs(30),
            true,
            "zk-partitioned-readers",
        )
        .await;
        cut.proxy.set(dlock_testkit::Fault::Pass);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn zookeeper_another_permit_count_from_a_second_deployment_is_refused_at_once() {
        another_permit_count_from_a_second_deployment(
            registry(&backend().await),
            registry(&backend().await),
            "zk",
        )
        .await;
    }

    /// A permit waiter queued in the semaphore's `locks` mutex whose session
    /// ends while it waits is told so within its wait, or served on a new
    /// session; either way a waiter of another process queued behind it is
    /// served as soon as a permit frees, and never beside two holders.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn zookeeper_a_permit_waiter_whose_session_ends_does_not_block_the_queue() {
        let holding = registry(&backend().await);
        let gone = ProxiedZk::connect().await;
        let behind = registry(&backend().await);
        let key = unique_key("zk-waiter-session-ends");
        let take = |r: &Registry| r.lock(&key).permits(2).lease(Duration::from_secs(30));
        let a = take(&holding).acquire().await.expect("first");
        let b = take(&holding).acquire().await.expect("second");
        let first_waiter = tokio::spawn({
            let builder = take(&registry(&gone.backend)).wait(Duration::from_secs(30));
            async move { builder.acquire().await }
        });
        tokio::time::sleep(Duration::from_millis(500)).await;
        let second_waiter = tokio::spawn({
            let builder = take(&behind).wait(Duration::from_secs(30));
            async move { builder.acquire().await }
        });
        tokio::time::sleep(Duration::from_millis(500)).await;
        gone.end_session().await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(!second_waiter.is_finished(), "both permits are held");
        let slot = a.permit();
        a.release().await.expect("release");
        // One permit is free: one of the waiters (the first if it queued
        // again on a new session before the second, else the second) gets
        // it at once, the other waits for the next one.
        let started = Instant::now();
        loop {
            if first_waiter.is_finished() || second_waiter.is_finished() {
                break;
            }
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "a permit is free and no waiter was served"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        b.release().await.expect("release");
        for (name, waiter) in [("first", first_waiter), ("second", second_waiter)] {
            match tokio::time::timeout(Duration::from_secs(10), waiter)
                .await
                .unwrap_or_else(|_| panic!("the {name} waiter never answered"))
                .expect("task")
            {
                Ok(g) => {
                    assert!(g.permit().is_some());
                    g.release().await.expect("release");
                }
                Err(e) => assert!(name == "first", "the {name} waiter: {e}"),
            }
        }
        let _ = slot;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn zookeeper_tokens_grow_across_a_revocation_of_permits_and_readers() {
        tokens_grow_across_a_revocation(
            registry(&backend().await),
            registry(&backend().await),
            true,
            "zk",
        )
        .await;
    }
}
