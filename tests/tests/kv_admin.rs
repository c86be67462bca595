//! Inspection and revocation on the key-value backends (Redis, Redis
//! Cluster, Redlock, ZooKeeper, etcd), beyond the conformance suite: a
//! holder in another process is shown with its pid and instance name, a
//! Cluster listing covers every master, a Curator holder on ZooKeeper is
//! shown (without a record) and revoked, a revocation racing the
//! holder's renewals never frees the next holder's key, and on etcd and
//! Redlock a revoked holder is told "revoked" while a key deleted by hand is
//! told "gone", the revocation's mark neither listed nor left behind.
#![cfg(all(feature = "redis", feature = "zookeeper", feature = "etcd"))]

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use dlock_runtime::{EtcdBackend, LockError, LossReason, Registry, ZooKeeperBackend};
use dlock_tests::zk_support::{hosts, java_programs};
use dlock_tests::{server_url, servers_missing, unique_key};
use tokio::io::AsyncBufReadExt as _;

const SECOND: Duration = Duration::from_secs(1);

fn redis_url() -> String {
    server_url("DLOCK_TEST_REDIS_URL", "redis://127.0.0.1:46379/")
}

fn cluster_url() -> String {
    server_url(
        "DLOCK_TEST_REDIS_CLUSTER_URL",
        "redis+cluster://127.0.0.1:47001,127.0.0.1:47002,127.0.0.1:47003",
    )
}

fn redlock_url() -> String {
    server_url(
        "DLOCK_TEST_REDLOCK_URL",
        "redlock://127.0.0.1:46379,127.0.0.1:46380,127.0.0.1:46381,127.0.0.1:46382,127.0.0.1:46383",
    )
}

fn zk_url() -> String {
    dlock_tests::zk_support::url()
}

fn etcd_url() -> String {
    server_url(
        "DLOCK_TEST_ETCD_URL",
        "etcd://127.0.0.1:42379,127.0.0.1:42389,127.0.0.1:42399/dlock-test",
    )
}

async fn registry(url: &str) -> Registry {
    Registry::from_url(url)
        .await
        .unwrap_or_else(|e| servers_missing(url, e))
}

/// Another process (`dlock-zk-holder`, which opens any URL) holds `key` on
/// `url` under the instance name `name`: it is shown with its pid and name,
/// and a revocation takes the key from it.
async fn another_process_is_shown_and_revoked(url: &str, name: &str) {
    let key = unique_key("other-process");
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_dlock-zk-holder"))
        .arg(url)
        .arg(&key)
        .env("DLOCK_HOLDER", name)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .expect("start dlock-zk-holder");
    let pid = child.id().expect("the child's pid");
    let mut lines = tokio::io::BufReader::new(child.stdout.take().expect("stdout")).lines();
    let held = tokio::time::timeout(30 * SECOND, lines.next_line())
        .await
        .expect("the child holds in time")
        .expect("its output")
        .expect("a line");
    assert!(held.starts_with("held "), "{held}");

    let registry = registry(url).await;
    let info = registry
        .inspect(&key)
        .await
        .expect("inspect")
        .expect("the child's key is held");
    let [holder] = info.holders() else {
        panic!("one holder: {info:?}");
    };
    assert_eq!(holder.pid(), Some(pid), "{holder:?}");
    assert_ne!(holder.pid(), Some(std::process::id()));
    assert_eq!(holder.name(), Some(name), "{holder:?}");
    let listed = registry.list(&key, 10).await.expect("list");
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0].holders()[0].pid(), Some(pid));

    let revoked = registry.revoke(&key).await.expect("revoke");
    assert_eq!(revoked.len(), 1, "{revoked:?}");
    assert_eq!(revoked[0].pid(), Some(pid));
    let guard = registry
        .lock(&key)
        .wait(10 * SECOND)
        .acquire()
        .await
        .expect("the revoked key is free");
    let info = registry
        .inspect(&key)
        .await
        .expect("inspect")
        .expect("held");
    assert_eq!(info.holders()[0].pid(), Some(std::process::id()));
    guard.release().await.expect("release");
    child.kill().await.expect("stop the child");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_shows_and_revokes_a_holder_in_another_process() {
    another_process_is_shown_and_revoked(&redis_url(), "redis child").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_shows_and_revokes_a_holder_in_another_process() {
    another_process_is_shown_and_revoked(&cluster_url(), "cluster-child").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unfenced_redis_shows_and_revokes_a_holder_in_another_process() {
    another_process_is_shown_and_revoked(&format!("{}?fencing=off", redis_url()), "unfenced").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_shows_and_revokes_a_holder_in_another_process() {
    another_process_is_shown_and_revoked(&redlock_url(), "redlock-child").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zookeeper_shows_and_revokes_a_holder_in_another_process() {
    another_process_is_shown_and_revoked(&zk_url(), "zk-child").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_shows_and_revokes_a_holder_in_another_process() {
    another_process_is_shown_and_revoked(&etcd_url(), "etcd-child").await;
}

/// `RegistryBuilder::holder_name` is stored with the grant and read back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_holder_name_is_shown() {
    for url in [redis_url(), zk_url(), etcd_url()] {
        let backend = dlock_runtime::connect(&url)
            .await
            .unwrap_or_else(|e| servers_missing(&url, e));
        let registry = Registry::builder()
            .default_backend(backend)
            .holder_name("payments blue")
            .build();
        let key = unique_key("holder-name");
        let guard = registry.lock(&key).acquire().await.expect("acquire");
        let info = registry
            .inspect(&key)
            .await
            .expect("inspect")
            .expect("held");
        assert_eq!(info.holders()[0].name(), Some("payments blue"), "{url}");
        guard.release().await.expect("release");
    }
}

/// Keys spread over every master of the cluster are all listed, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_listing_covers_every_master() {
    let registry = registry(&cluster_url()).await;
    let prefix = unique_key("cluster-list");
    // 30 keys: the chance that they all hash to one master of three is 3⁻²⁹.
    let mut keys: Vec<String> = (0..30).map(|i| format!("{prefix}:{i:02}")).collect();
    let mut guards = Vec::new();
    for key in &keys {
        guards.push(registry.lock(key).acquire().await.expect("acquire"));
    }
    keys.sort();
    let listed = registry.list(&prefix, 100).await.expect("list");
    let names: Vec<&str> = listed.iter().map(|i| i.key()).collect();
    assert_eq!(names, keys);
    for info in &listed {
        assert_eq!(info.holders()[0].pid(), Some(std::process::id()));
    }
    for guard in guards {
        guard.release().await.expect("release");
    }
}

/// A Curator `InterProcessMutex` holder is shown without a record (its node
/// carries its IP address) and can be revoked; dlock then takes the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_curator_holder_is_shown_without_a_record_and_revoked() {
    let Some(programs) = java_programs(Path::new(env!("CARGO_TARGET_TMPDIR"))) else {
        return;
    };
    let url = zk_url();
    let zk = ZooKeeperBackend::connect(&url)
        .await
        .unwrap_or_else(|e| servers_missing(&url, e));
    let registry = Registry::builder().default_backend(zk.clone()).build();
    let key = unique_key("curator-admin");
    let container = zk.container_path(&format!("dlock:{key}"));
    let mut curator = programs.curator(&hosts(&url), &container, 10 * SECOND, "hold", &[]);
    assert_eq!(curator.line(60 * SECOND).await, "connected");
    assert_eq!(curator.line(30 * SECOND).await, "held");

    let info = registry
        .inspect(&key)
        .await
        .expect("inspect")
        .expect("Curator holds the key");
    let [holder] = info.holders() else {
        panic!("one holder: {info:?}");
    };
    assert_eq!((holder.pid(), holder.host()), (None, None), "{holder:?}");
    assert!(holder.token().is_some() && holder.granted_at().is_some());
    let busy = registry.lock(&key).wait(Duration::ZERO).acquire().await;
    assert!(matches!(busy, Err(LockError::Busy { .. })), "{busy:?}");

    let revoked = registry.revoke(&key).await.expect("revoke");
    assert_eq!(revoked.len(), 1, "{revoked:?}");
    assert_eq!(revoked[0].token(), holder.token());
    let guard = registry
        .lock(&key)
        .wait(10 * SECOND)
        .acquire()
        .await
        .expect("the key is free after the revocation");
    assert!(guard.fencing_token() > holder.token());
    guard.release().await.expect("release");
    curator.kill().await;
}

/// Revoking a holder whose watchdog renews every few tens of milliseconds,
/// again and again: a renewal in flight at the revocation never extends or
/// frees the next holder's key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revocations_racing_renewals_never_free_the_next_holders_key() {
    for url in [redis_url(), cluster_url(), zk_url(), etcd_url()] {
        let registry = registry(&url).await;
        let key = unique_key("revoke-race");
        for round in 0..5 {
            let first = registry
                .lock(&key)
                .lease(dlock_runtime::MIN_LEASE * 2)
                .wait(10 * SECOND)
                .acquire()
                .await
                .expect("first holder");
            tokio::time::sleep(Duration::from_millis(20 * round)).await;
            let revoked = registry.revoke(&key).await.expect("revoke");
            assert_eq!(revoked.len(), 1, "{url} round {round}: {revoked:?}");
            let second = registry
                .lock(&key)
                .lease(10 * SECOND)
                .wait(10 * SECOND)
                .acquire()
                .await
                .expect("second holder");
            tokio::time::timeout(10 * SECOND, first.lost())
                .await
                .expect("the revoked holder learns");
            // Past several of the first holder's renewal periods.
            tokio::time::sleep(Duration::from_millis(300)).await;
            let info = registry
                .inspect(&key)
                .await
                .expect("inspect")
                .expect("the second holder keeps the key");
            assert_eq!(info.holders()[0].token(), second.fencing_token(), "{url}");
            assert!(!second.is_lost(), "{url} round {round}");
            assert!(matches!(first.release().await, Err(LockError::Lost { .. })));
            second.release().await.expect("release");
        }
    }
}

/// `redis://host:port/` of each node of the Redlock URL.
fn redlock_nodes() -> Vec<String> {
    let url = redlock_url();
    let hosts = url.trim_start_matches("redlock://");
    hosts
        .split(',')
        .map(|h| format!("redis://{}/", h.trim_end_matches('/')))
        .collect()
}

async fn redlock_node(url: &str) -> redis::aio::MultiplexedConnection {
    redis::Client::open(url)
        .expect("node url")
        .get_multiplexed_async_connection()
        .await
        .unwrap_or_else(|e| servers_missing(url, e))
}

/// The etcd keys under `prefix`.
async fn etcd_keys(client: &etcd_client::Client, prefix: &str) -> Vec<String> {
    dlock_tests::etcd_support::entries(client, prefix)
        .await
        .into_iter()
        .map(|(key, _)| key)
        .collect()
}

/// etcd: an entry deleted by hand is reported gone, a revoked one revoked;
/// the revocation's mark is not listed, and is deleted by the holder's
/// release (its renewal only reads it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_tells_a_revocation_from_an_entry_deleted_by_hand() {
    let url = etcd_url();
    let etcd = EtcdBackend::connect(&url)
        .await
        .unwrap_or_else(|e| servers_missing(&url, e));
    let registry = Registry::builder().default_backend(etcd.clone()).build();
    let admin = dlock_tests::etcd_support::admin(&url).await;
    let key = unique_key("revoked-or-gone");
    let queue = etcd.queue_prefix(&format!("dlock:{key}"));
    let (root, escaped) = queue
        .trim_end_matches('/')
        .rsplit_once('/')
        .expect("{prefix}/{key}/");
    let marks = format!("{root}/%revoked/{escaped}/");

    let deleted = registry
        .lock(&key)
        .lease(2 * SECOND)
        .acquire()
        .await
        .expect("acquire");
    let mut kv = admin.kv_client();
    for entry in etcd_keys(&admin, &queue).await {
        kv.delete(entry, None).await.expect("delete by hand");
    }
    tokio::time::timeout(5 * SECOND, deleted.lost())
        .await
        .expect("the holder learns");
    assert_eq!(deleted.loss_reason(), Some(LossReason::Gone));
    let _ = deleted.release().await;

    let revoked = registry
        .lock(&key)
        .lease(2 * SECOND)
        .acquire()
        .await
        .expect("acquire");
    assert_eq!(registry.revoke(&key).await.expect("revoke").len(), 1);
    tokio::time::timeout(5 * SECOND, revoked.lost())
        .await
        .expect("the holder learns");
    assert_eq!(revoked.loss_reason(), Some(LossReason::Revoked));
    let _ = revoked.release().await;
    assert!(
        etcd_keys(&admin, &marks).await.is_empty(),
        "the release of a hold told revoked leaves the mark"
    );

    let released = registry
        .lock(&key)
        .lease(30 * SECOND)
        .acquire()
        .await
        .expect("acquire");
    assert_eq!(registry.revoke(&key).await.expect("revoke").len(), 1);
    // The next renewal is 10 s away.
    assert_eq!(etcd_keys(&admin, &marks).await.len(), 1, "the mark is put");
    assert!(
        registry.list(&key, 10).await.expect("list").is_empty(),
        "the mark is listed"
    );
    let _ = released.release().await;
    assert!(
        etcd_keys(&admin, &marks).await.is_empty(),
        "the release leaves the mark"
    );
}

/// Redlock: a key deleted by hand on every node is reported gone, a
/// revoked one revoked; the revocation's mark is not listed and expires on
/// its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_tells_a_revocation_from_a_key_deleted_by_hand() {
    let registry = registry(&redlock_url()).await;
    let key = unique_key("revoked-or-gone");
    let stored = format!("dlock:{key}");
    let mut nodes = Vec::new();
    for url in redlock_nodes() {
        nodes.push(redlock_node(&url).await);
    }

    let deleted = registry
        .lock(&key)
        .lease(2 * SECOND)
        .acquire()
        .await
        .expect("acquire");
    for node in &mut nodes {
        let _: i64 = redis::cmd("DEL")
            .arg(&stored)
            .query_async(node)
            .await
            .expect("DEL");
    }
    tokio::time::timeout(5 * SECOND, deleted.lost())
        .await
        .expect("the holder learns");
    assert_eq!(deleted.loss_reason(), Some(LossReason::Gone));
    let _ = deleted.release().await;

    let revoked = registry
        .lock(&key)
        .lease(2 * SECOND)
        .acquire()
        .await
        .expect("acquire");
    assert_eq!(registry.revoke(&key).await.expect("revoke").len(), 1);
    let mark = format!("{stored}\nrevoked");
    for node in &mut nodes {
        let left: i64 = redis::cmd("PTTL")
            .arg(&mark)
            .query_async(node)
            .await
            .expect("PTTL");
        assert!(
            left > 0 && left <= 3_000,
            "the mark outlives the copy it replaced by 1 s, no more: {left} ms"
        );
    }
    assert!(
        registry.list(&key, 10).await.expect("list").is_empty(),
        "the mark is listed"
    );
    tokio::time::timeout(5 * SECOND, revoked.lost())
        .await
        .expect("the holder learns");
    assert_eq!(revoked.loss_reason(), Some(LossReason::Revoked));
    let _ = revoked.release().await;
}
