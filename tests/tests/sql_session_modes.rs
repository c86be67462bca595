//! Semaphores (and, on PostgreSQL, read locks) in the SQL session modes:
//! slot locks never meet plain keys, two permit counts asked at once are
//! never both granted, a holder whose connection is killed frees only its
//! own permit, and `inspect`/`list` show each permit holder with its slot.
#![cfg(any(feature = "postgres", feature = "mysql"))]

use std::time::{Duration, Instant};

use dlock_runtime::{LockError, Registry};
use dlock_tests::sql_db::SqlDb;
use dlock_tests::sql_support::SqlMode;
use dlock_tests::unique_key;

const LEASE: Duration = Duration::from_secs(30);

/// A registry whose default backend is `db` in session mode, on
/// connections of its own.
async fn session(db: SqlDb) -> Registry {
    db.connect(SqlMode::Session.query()).await.registry()
}

/// The server connection holding slot `slot` of the semaphore `stored_key`
/// (its slot lock, found through the slot's counter row).
async fn slot_holder(db: SqlDb, stored_key: &str, slot: u32) -> i64 {
    use sqlx::Connection as _;
    let url = db.url();
    match db {
        #[cfg(feature = "postgres")]
        SqlDb::Postgres => {
            let mut conn = sqlx::PgConnection::connect(&url).await.expect("connect");
            let pid: i32 = sqlx::query_scalar(
                "SELECT l.pid FROM dlock_leases_fence f JOIN pg_locks l \
                   ON l.locktype = 'advisory' AND l.granted AND l.objsubid = 1 \
                  AND l.mode = 'ExclusiveLock' \
                  AND ((l.classid::bigint << 32) | l.objid::bigint) = f.k \
                 WHERE f.name = $1 AND f.slot = $2",
            )
            .bind(stored_key)
            .bind(slot as i32)
            .fetch_one(&mut conn)
            .await
            .expect("the slot's holder");
            i64::from(pid)
        }
        #[cfg(feature = "mysql")]
        SqlDb::Mysql => {
            let mut conn = sqlx::MySqlConnection::connect(&url).await.expect("connect");
            sqlx::query_scalar(
                "SELECT CAST(IS_USED_LOCK(CONCAT('dlock:', LPAD(LOWER(HEX(k)), 16, '0'))) \
                        AS SIGNED) \
                 FROM dlock_leases_fence WHERE name = ? AND slot = ?",
            )
            .bind(stored_key.as_bytes())
            .bind(slot as i32)
            .fetch_one(&mut conn)
            .await
            .expect("the slot's holder")
        }
        #[allow(unreachable_patterns)]
        _ => unreachable!("session mode exists on PostgreSQL and MySQL only"),
    }
}

/// Ends server connection `id` from another one.
async fn kill(db: SqlDb, id: i64) {
    use sqlx::Connection as _;
    let url = db.url();
    match db {
        #[cfg(feature = "postgres")]
        SqlDb::Postgres => {
            let mut conn = sqlx::PgConnection::connect(&url).await.expect("connect");
            sqlx::query("SELECT pg_terminate_backend($1)")
                .bind(id as i32)
                .execute(&mut conn)
                .await
                .expect("pg_terminate_backend");
        }
        #[cfg(feature = "mysql")]
        SqlDb::Mysql => {
            let mut conn = sqlx::MySqlConnection::connect(&url).await.expect("connect");
            sqlx::raw_sql(sqlx::AssertSqlSafe(format!("KILL {id}")))
                .execute(&mut conn)
                .await
                .expect("KILL");
        }
        #[allow(unreachable_patterns)]
        _ => unreachable!("session mode exists on PostgreSQL and MySQL only"),
    }
}

/// Every permit of a semaphore held, plain locks of names that look like
/// its slots are free; those names held as plain locks, the semaphore's
/// permits are all free.
async fn slot_locks_never_meet_plain_keys(db: SqlDb) {
    let registry = session(db).await;
    let key = unique_key("session-slot-names");
    let look_alikes: Vec<String> = (0..3)
        .flat_map(|s| {
            [
                format!("{key}:{s}"),
                format!("{key}#{s}"),
                format!("{key}/slot/{s}"),
                format!("{key}\u{FF}p{s}"),
                format!("{key}{s}"),
            ]
        })
        .collect();
    let mut permits = Vec::new();
    for _ in 0..3 {
        permits.push(
            registry
                .lock(&key)
                .permits(3)
                .lease(LEASE)
                .acquire()
                .await
                .expect("a free permit"),
        );
    }
    for name in &look_alikes {
        let plain = registry
            .lock(name)
            .lease(LEASE)
            .acquire()
            .await
            .unwrap_or_else(|e| panic!("`{name}` met the semaphore's slots: {e:?}"));
        plain.release().await.expect("release");
    }
    for permit in permits {
        permit.release().await.expect("release");
    }
    let mut plains = Vec::new();
    for name in &look_alikes {
        plains.push(
            registry
                .lock(name)
                .lease(LEASE)
                .acquire()
                .await
                .expect("plain"),
        );
    }
    let mut slots = Vec::new();
    for _ in 0..3 {
        let permit = registry
            .lock(&key)
            .permits(3)
            .lease(LEASE)
            .acquire()
            .await
            .expect("the plain look-alikes hold no slot");
        slots.push(permit.permit());
        permit.release().await.expect("release");
    }
    assert_eq!(slots, vec![Some(0); 3], "the lowest free slot each time");
    for plain in plains {
        plain.release().await.expect("release");
    }
}

/// Two processes asking for 2 and 3 permits of a free key at the same
/// instant: never both granted, 50 times over.
async fn two_permit_counts_at_once_are_never_both_granted(db: SqlDb) {
    let (a, b) = (session(db).await, session(db).await);
    let mut both_refused = 0;
    for round in 0..50 {
        let key = unique_key(&format!("session-mismatch-race-{round}"));
        let (two, three) = tokio::join!(
            a.lock(&key).permits(2).lease(LEASE).acquire(),
            b.lock(&key).permits(3).lease(LEASE).acquire(),
        );
        match (&two, &three) {
            (Ok(_), Ok(_)) => panic!("round {round}: 2 and 3 permits of one key granted at once"),
            (Ok(_), Err(e)) | (Err(e), Ok(_)) => assert!(
                matches!(e, LockError::Config { message } if message.contains('2') && message.contains('3')),
                "round {round}: the refused one is not a mismatch naming both: {e:?}"
            ),
            (Err(_), Err(_)) => both_refused += 1,
        }
        for guard in [two, three].into_iter().flatten() {
            guard.release().await.expect("release");
        }
    }
    assert!(
        both_refused < 50,
        "no round granted either count: {both_refused} of 50"
    );
}

/// A permit holder whose server connection is killed loses its permit, and
/// only its slot comes free: the other holders keep theirs.
async fn a_killed_holder_frees_only_its_permit(db: SqlDb) {
    let registry = session(db).await;
    let key = unique_key("session-killed-permit");
    let stored = format!("{}{key}", registry.key_prefix());
    let mut guards = Vec::new();
    for _ in 0..3 {
        guards.push(
            registry
                .lock(&key)
                .permits(3)
                .lease(Duration::from_secs(3))
                .acquire()
                .await
                .expect("a free permit"),
        );
    }
    let victim = guards.remove(1);
    assert_eq!(victim.permit(), Some(1));
    kill(db, slot_holder(db, &stored, 1).await).await;
    let started = Instant::now();
    let next = registry
        .lock(&key)
        .permits(3)
        .wait(Duration::from_secs(10))
        .lease(LEASE)
        .acquire()
        .await
        .expect("the killed holder's permit");
    assert_eq!(next.permit(), Some(1), "the killed holder's slot");
    assert!(started.elapsed() < Duration::from_secs(5));
    let until = Instant::now() + Duration::from_secs(5);
    while !victim.is_lost() {
        assert!(Instant::now() < until, "the killed holder was not told");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let fourth = registry.lock(&key).permits(3).lease(LEASE).acquire().await;
    assert!(
        matches!(fourth, Err(LockError::Busy { .. })),
        "the other holders keep their permits: {fourth:?}"
    );
    for guard in &guards {
        assert!(!guard.is_lost(), "a holder beside the killed one lost");
    }
    let _ = victim.release().await;
    next.release().await.expect("release");
    for guard in guards {
        guard.release().await.expect("release");
    }
}

/// `inspect` shows each permit holder with its slot and token, and `list`
/// shows the semaphore once under its own key (its slot locks are not
/// other keys).
async fn inspect_and_list_show_permit_slots(db: SqlDb) {
    let registry = session(db).await;
    let prefix = unique_key("session-inspect-slots");
    let key = format!("{prefix}:sem");
    let mut guards = Vec::new();
    for _ in 0..3 {
        guards.push(
            registry
                .lock(&key)
                .permits(4)
                .lease(LEASE)
                .acquire()
                .await
                .expect("a free permit"),
        );
    }
    let info = registry
        .inspect(&key)
        .await
        .expect("inspect")
        .expect("a held semaphore is shown");
    let shown: Vec<_> = info
        .holders()
        .iter()
        .map(|h| {
            assert!(!h.is_reader(), "{h:?}");
            (h.slot(), h.token())
        })
        .collect();
    let granted: Vec<_> = guards
        .iter()
        .map(|g| (g.permit(), g.fencing_token()))
        .collect();
    assert_eq!(shown, granted, "each permit with its slot and token");
    let listed = registry.list(&prefix, 10).await.expect("list");
    let keys: Vec<_> = listed.iter().map(|k| k.key().to_owned()).collect();
    assert_eq!(
        keys,
        vec![key.clone()],
        "the semaphore once, by its own key"
    );
    assert_eq!(listed[0].holders().len(), 3);
    for guard in guards {
        guard.release().await.expect("release");
    }
    assert!(
        registry.inspect(&key).await.expect("inspect").is_none(),
        "a free semaphore is not shown"
    );
}

/// Two readers and a writer waiting on PostgreSQL: `inspect` shows the
/// readers as readers, each with its own token.
#[cfg(feature = "postgres")]
async fn inspect_shows_each_reader_with_its_token(db: SqlDb) {
    let registry = session(db).await;
    let key = unique_key("session-inspect-readers");
    let a = registry
        .lock(&key)
        .read()
        .lease(LEASE)
        .acquire()
        .await
        .expect("read");
    let b = registry
        .lock(&key)
        .read()
        .lease(LEASE)
        .acquire()
        .await
        .expect("read");
    let info = registry
        .inspect(&key)
        .await
        .expect("inspect")
        .expect("held");
    let mut shown: Vec<_> = info
        .holders()
        .iter()
        .map(|h| {
            assert!(h.is_reader(), "{h:?}");
            h.token()
        })
        .collect();
    shown.sort();
    let mut granted = vec![a.fencing_token(), b.fencing_token()];
    granted.sort();
    assert_eq!(shown, granted);
    assert_ne!(a.fencing_token(), b.fencing_token());
    a.release().await.expect("release");
    b.release().await.expect("release");
}

/// One test per case on `$db`, in module `$module`.
macro_rules! on {
    ($module:ident, $db:ident, $feature:literal: $($case:ident),+ $(,)?) => {
        #[cfg(feature = $feature)]
        mod $module {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    super::$case(dlock_tests::sql_db::SqlDb::$db).await;
                }
            )+
        }
    };
}

on!(postgres, Postgres, "postgres":
    slot_locks_never_meet_plain_keys,
    two_permit_counts_at_once_are_never_both_granted,
    a_killed_holder_frees_only_its_permit,
    inspect_and_list_show_permit_slots,
    inspect_shows_each_reader_with_its_token,
);

on!(mysql, Mysql, "mysql":
    slot_locks_never_meet_plain_keys,
    two_permit_counts_at_once_are_never_both_granted,
    a_killed_holder_frees_only_its_permit,
    inspect_and_list_show_permit_slots,
);
