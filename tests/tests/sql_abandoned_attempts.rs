//! Lease mode on PostgreSQL and MySQL: a caller that gives up while its
//! acquire statement is still on its way to the server. The server runs the
//! statement anyway when it arrives; the clean-up release goes out only once
//! the server has answered it (on the same connection, in order), so a key
//! granted to the gone caller is released within a round trip — not held
//! until the runtime's backstop release, let alone for the lease.
#![cfg(any(feature = "postgres", feature = "mysql"))]

use std::time::{Duration, Instant};

use dlock_tests::sql_db::SqlDb;
use dlock_tests::sql_support::{SqlMode, proxy_to};
use dlock_tests::unique_key;

/// How long the proxy holds the acquire statement back.
const HELD_BACK: Duration = Duration::from_millis(800);

async fn a_late_grant_is_released_within_a_round_trip(db: SqlDb) {
    let proxy = proxy_to(&db.host_port()).await;
    let url = db.url().replace(&db.host_port(), &proxy.addr().to_string());
    let registry = db.connect_url(&url).await.expect("connect").registry();
    let faults = db.faults(SqlMode::Lease);
    // Connections open and statements prepared: the acquire below is one
    // chunk, carrying its key.
    for i in 0..3 {
        let warm = unique_key(&format!("late-grant-warm-{i}"));
        let g = registry.lock(&warm).acquire().await.expect("warm up");
        g.release().await.expect("release");
    }
    let key = unique_key("late-grant");
    let stored = format!("{}{key}", registry.key_prefix());
    proxy.hold_next(&[key.as_bytes()], HELD_BACK);
    let gave_up = tokio::time::timeout(
        Duration::from_millis(200),
        registry.lock(&key).lease(Duration::from_secs(60)).acquire(),
    )
    .await;
    assert!(gave_up.is_err(), "the caller gave up before the answer");
    assert!(proxy.held_on().is_some(), "the acquire was held back");

    // Watch the key until well past the runtime's backstop (3 s).
    let left = Instant::now();
    let mut held: Option<(Duration, Duration)> = None;
    while left.elapsed() < Duration::from_secs(5) {
        if faults.is_held(&stored).await {
            let at = left.elapsed();
            held = Some(held.map_or((at, at), |(first, _)| (first, at)));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    if let Some((first, last)) = held {
        assert!(
            last - first < Duration::from_secs(1),
            "{db:?}: the late grant was held from {first:?} to {last:?} after the caller left \
             (the clean-up release went out before the acquire it undoes)"
        );
    }
    let again = registry.lock(&key).wait(Duration::ZERO).acquire().await;
    again
        .expect("the key is free")
        .release()
        .await
        .expect("release");
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_late_grant_is_released_within_a_round_trip() {
    a_late_grant_is_released_within_a_round_trip(SqlDb::Postgres).await;
}

#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_a_late_grant_is_released_within_a_round_trip() {
    a_late_grant_is_released_within_a_round_trip(SqlDb::Mysql).await;
}
