//! Connections that end before the server could have granted anything (a
//! proxy or failover resetting them, an operator's `KILL`) are retried on
//! another connection, in both modes and on both SQL databases — also for a
//! caller that does not wait (`wait = 0`): a dead pooled connection never
//! reaches the caller as a failure of the lock.
#![cfg(any(feature = "postgres", feature = "mysql"))]

use std::time::Duration;

use dlock_runtime::Registry;
use dlock_tests::sql_db::SqlDb;
use dlock_tests::sql_support::{SqlMode, proxy_to};
use dlock_tests::unique_key;

/// More connections than any retry count the backend could have chosen by
/// luck, and than the lease pool's default size.
const CONNECTIONS: usize = 12;

/// Holds `n` keys at once (so `n` connections are open), then releases them:
/// afterwards the connections sit in the backend's pools for reuse.
async fn warm(registry: &Registry, key: &str, n: usize) -> Vec<String> {
    let keys: Vec<String> = (0..n).map(|i| format!("{key}:{i}")).collect();
    let guards =
        futures_util::future::join_all(keys.iter().map(|k| registry.lock(k).acquire())).await;
    for g in guards {
        g.expect("acquire while warming")
            .release()
            .await
            .expect("release");
    }
    keys
}

/// Every key of `keys` taken one after the other without waiting: each
/// acquisition finds dead connections first.
async fn take_each_without_waiting(registry: &Registry, keys: &[String], what: &str) {
    for key in keys {
        let got = registry.lock(key).wait(Duration::ZERO).acquire().await;
        match got {
            Ok(g) => g.release().await.expect("release"),
            Err(e) => panic!("{what}: acquiring {key} with wait = 0 failed: {e:?}"),
        }
    }
}

/// A proxy between the backend and the server resets every connection (a
/// load balancer's failover, a NAT timeout): the pooled connections are dead,
/// and the next acquisitions open new ones.
async fn connections_reset_under_the_pool_are_replaced(db: SqlDb, mode: SqlMode) {
    let proxy = proxy_to(&db.host_port()).await;
    let url = db.url().replace(&db.host_port(), &proxy.addr().to_string()) + &mode.query_with("");
    let registry = db.connect_url(&url).await.expect("connect").registry();
    let keys = warm(&registry, &unique_key("sql-reset"), CONNECTIONS).await;
    proxy.reset_all();
    // Let the resets reach the client sockets.
    tokio::time::sleep(Duration::from_millis(300)).await;
    take_each_without_waiting(&registry, &keys, &format!("{db:?} {mode:?} after a reset")).await;
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_lease_connections_reset_under_the_pool_are_replaced() {
    connections_reset_under_the_pool_are_replaced(SqlDb::Postgres, SqlMode::Lease).await;
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_session_connections_reset_under_the_pool_are_replaced() {
    connections_reset_under_the_pool_are_replaced(SqlDb::Postgres, SqlMode::Session).await;
}

#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_lease_connections_reset_under_the_pool_are_replaced() {
    connections_reset_under_the_pool_are_replaced(SqlDb::Mysql, SqlMode::Lease).await;
}

#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_session_connections_reset_under_the_pool_are_replaced() {
    connections_reset_under_the_pool_are_replaced(SqlDb::Mysql, SqlMode::Session).await;
}

/// MySQL session mode keeps clean connections for reuse: the server's `KILL`
/// of several of them (an operator, a failover) leaves the pool with more than
/// one dead connection, and an acquisition that does not wait still succeeds.
#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_session_kept_connections_killed_by_the_server_are_replaced() {
    use dlock_tests::sql_support::MyFaults;

    let db = SqlDb::Mysql;
    let faults = MyFaults {
        url: db.url(),
        mode: SqlMode::Session,
    };
    let registry = db
        .connect_url(&format!("{}{}", db.url(), SqlMode::Session.query()))
        .await
        .expect("connect")
        .registry();
    let key = unique_key("mysql-session-killed");
    let keys: Vec<String> = (0..4).map(|i| format!("{key}:{i}")).collect();
    let guards =
        futures_util::future::join_all(keys.iter().map(|k| registry.lock(k).acquire())).await;
    let mut holders = Vec::new();
    for k in &keys {
        let stored = format!("{}{k}", registry.key_prefix());
        holders.push(faults.session_holder(&stored).await.expect("held"));
    }
    for g in guards {
        g.expect("acquire").release().await.expect("release");
    }
    for id in holders {
        faults.kill(id).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    take_each_without_waiting(&registry, &keys, "after KILL of the kept connections").await;
}
