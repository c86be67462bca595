//! Revocation on etcd and Redlock under attack: a revoked holder is told
//! "revoked" even when its successor is revoked before its next renewal,
//! the next grant's token is larger, a waiter gets the key as soon as the
//! holder is revoked, two revocations at once report the holder once, a
//! Redlock revocation with a node stalled answers in time, a revocation
//! racing the holder's release leaves no mark, and the mark of a holder
//! that crashed goes with its session.
#![cfg(all(feature = "redis", feature = "etcd"))]

use std::process::Stdio;
use std::time::{Duration, Instant};

use dlock_runtime::{EtcdBackend, LossReason, Registry};
use dlock_testkit::{Fault, FaultProxy};
use dlock_tests::{server_url, servers_missing, unique_key};
use tokio::io::AsyncBufReadExt as _;

const SECOND: Duration = Duration::from_secs(1);

fn redlock_url() -> String {
    server_url(
        "DLOCK_TEST_REDLOCK_URL",
        "redlock://127.0.0.1:46379,127.0.0.1:46380,127.0.0.1:46381,127.0.0.1:46382,127.0.0.1:46383",
    )
}

fn redis_url() -> String {
    server_url("DLOCK_TEST_REDIS_URL", "redis://127.0.0.1:46379/")
}

fn redis_cluster_url() -> String {
    server_url(
        "DLOCK_TEST_REDIS_CLUSTER_URL",
        "redis+cluster://127.0.0.1:47001,127.0.0.1:47002,127.0.0.1:47003",
    )
}

fn etcd_url() -> String {
    server_url(
        "DLOCK_TEST_ETCD_URL",
        "etcd://127.0.0.1:42379,127.0.0.1:42389,127.0.0.1:42399/dlock-test",
    )
}

async fn connect(url: &str) -> Registry {
    Registry::from_url(url)
        .await
        .unwrap_or_else(|e| servers_missing(url, e))
}

/// `host:port` of each node of the Redlock URL.
fn redlock_hosts() -> Vec<String> {
    redlock_url()
        .trim_start_matches("redlock://")
        .split(',')
        .map(|h| h.trim_end_matches('/').to_owned())
        .collect()
}

/// The guard's fencing token (0 on Redlock, which issues none).
fn token(guard: &dlock_runtime::LockGuard) -> u64 {
    guard.fencing_token().map_or(0, u64::from)
}

/// A holds with a lease whose next renewal is a few seconds away; it is
/// revoked, a waiter takes the key and is revoked in turn before A's next
/// renewal. A must still be told it was revoked (nothing else took its
/// hold from it), and each grant's token is larger than the revoked one.
async fn holder_revoked_then_successor_revoked(url: &str) {
    let registry = connect(url).await;
    let key = unique_key("revoked-twice");
    let first = registry
        .lock(&key)
        .lease(6 * SECOND)
        .acquire()
        .await
        .expect("acquire");
    let waiter = {
        let registry = registry.clone();
        let key = key.clone();
        tokio::spawn(async move {
            registry
                .lock(&key)
                .lease(6 * SECOND)
                .wait(10 * SECOND)
                .acquire()
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(registry.revoke(&key).await.expect("revoke").len(), 1);
    let second = tokio::time::timeout(5 * SECOND, waiter)
        .await
        .expect("the waiter gets the revoked key in time")
        .expect("join")
        .expect("the waiter's acquisition");
    assert!(
        token(&second) > token(&first) || token(&second) == 0,
        "{} then {}",
        token(&first),
        token(&second)
    );
    let revoked = registry.revoke(&key).await.expect("revoke the successor");
    assert_eq!(revoked.len(), 1, "{revoked:?}");
    tokio::time::timeout(10 * SECOND, first.lost())
        .await
        .expect("the first holder learns");
    tokio::time::timeout(10 * SECOND, second.lost())
        .await
        .expect("the second holder learns");
    assert_eq!(
        second.loss_reason(),
        Some(LossReason::Revoked),
        "the second holder"
    );
    assert_eq!(
        first.loss_reason(),
        Some(LossReason::Revoked),
        "the first holder was revoked, then its successor was"
    );
    let third = registry
        .lock(&key)
        .wait(5 * SECOND)
        .acquire()
        .await
        .expect("the key is free");
    assert!(token(&third) > token(&second) || token(&third) == 0);
    third.release().await.expect("release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_a_holder_whose_successor_is_revoked_too_is_told_revoked() {
    holder_revoked_then_successor_revoked(&redlock_url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_a_holder_whose_successor_is_revoked_too_is_told_revoked() {
    holder_revoked_then_successor_revoked(&redis_url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_a_holder_whose_successor_is_revoked_too_is_told_revoked() {
    holder_revoked_then_successor_revoked(&redis_cluster_url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_a_holder_whose_successor_is_revoked_too_is_told_revoked() {
    holder_revoked_then_successor_revoked(&etcd_url()).await;
}

/// A waiter (wait 10 s) behind a 30 s lease gets the key soon after the
/// holder is revoked, not when the lease runs out.
async fn revocation_wakes_a_waiter(url: &str) {
    let registry = connect(url).await;
    let key = unique_key("revoke-wakes");
    let holder = registry
        .lock(&key)
        .lease(30 * SECOND)
        .acquire()
        .await
        .expect("acquire");
    let waiter = {
        let registry = registry.clone();
        let key = key.clone();
        tokio::spawn(async move {
            registry
                .lock(&key)
                .lease(30 * SECOND)
                .wait(10 * SECOND)
                .acquire()
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    let revoked_at = Instant::now();
    assert_eq!(registry.revoke(&key).await.expect("revoke").len(), 1);
    let next = waiter
        .await
        .expect("join")
        .expect("the waiter gets the key");
    let waited = revoked_at.elapsed();
    assert!(waited < 3 * SECOND, "woken {waited:?} after the revocation");
    assert!(token(&next) > token(&holder) || token(&next) == 0);
    next.release().await.expect("release");
    let _ = holder.release().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_revocation_wakes_a_waiter() {
    revocation_wakes_a_waiter(&redlock_url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_revocation_wakes_a_waiter() {
    revocation_wakes_a_waiter(&etcd_url()).await;
}

/// Two revocations at once, every node answering: exactly one reports the
/// holder, round after round.
async fn two_revocations_report_the_holder_once(url: &str) {
    let registry = connect(url).await;
    let other = connect(url).await;
    let revoked_before = registry.stats().lost_for(LossReason::Revoked);
    for round in 0..10 {
        let key = unique_key("revoked-by-two");
        let holder = registry
            .lock(&key)
            .lease(10 * SECOND)
            .acquire()
            .await
            .expect("acquire");
        let (a, b) = tokio::join!(registry.revoke(&key), other.revoke(&key));
        let reported = a.expect("revoke").len() + b.expect("revoke").len();
        assert_eq!(
            reported, 1,
            "round {round}: the holder reported {reported} times"
        );
        tokio::time::timeout(10 * SECOND, holder.lost())
            .await
            .expect("the holder learns");
        assert_eq!(holder.loss_reason(), Some(LossReason::Revoked));
    }
    assert_eq!(
        registry.stats().lost_for(LossReason::Revoked) - revoked_before,
        10,
        "losses by revocation counted"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_two_revocations_at_once_report_the_holder_once() {
    two_revocations_report_the_holder_once(&redlock_url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_two_revocations_at_once_report_the_holder_once() {
    two_revocations_report_the_holder_once(&etcd_url()).await;
}

/// A Redlock revocation sent through a registry whose last node is stalled
/// answers within a bound, reports the holder (its copies went on the four
/// other nodes), and the holder is told it was revoked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_revocation_with_a_node_stalled_answers_in_time() {
    let hosts = redlock_hosts();
    let holder_registry = connect(&redlock_url()).await;
    let proxy = FaultProxy::start(hosts[4].clone()).await.expect("proxy");
    let through = format!("redlock://{},{}", hosts[..4].join(","), proxy.addr());
    let revoker = connect(&through).await;
    let key = unique_key("revoke-stalled");
    let holder = holder_registry
        .lock(&key)
        .lease(6 * SECOND)
        .acquire()
        .await
        .expect("acquire");
    // The revoker's connections are open before the stall.
    assert!(revoker.inspect(&key).await.expect("inspect").is_some());
    proxy.set(Fault::Hold);
    let started = Instant::now();
    let revoked = tokio::time::timeout(10 * SECOND, revoker.revoke(&key))
        .await
        .expect("the revocation answers within 10 s")
        .expect("four of five nodes answered");
    let took = started.elapsed();
    assert_eq!(revoked.len(), 1, "{revoked:?}");
    assert!(took < 5 * SECOND, "revoke took {took:?}");
    tokio::time::timeout(10 * SECOND, holder.lost())
        .await
        .expect("the holder learns");
    assert_eq!(holder.loss_reason(), Some(LossReason::Revoked));
    proxy.set(Fault::Pass);
}

/// etcd: the holder's release racing a revocation, round after round, never
/// leaves a revocation mark behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_revocation_racing_the_release_leaves_no_mark() {
    let url = etcd_url();
    let etcd = EtcdBackend::connect(&url)
        .await
        .unwrap_or_else(|e| servers_missing(&url, e));
    let registry = Registry::builder().default_backend(etcd.clone()).build();
    let revoker = connect(&url).await;
    let admin = dlock_tests::etcd_support::admin(&url).await;
    for round in 0..20 {
        let key = unique_key("revoke-vs-release");
        let queue = etcd.queue_prefix(&format!("dlock:{key}"));
        let (root, escaped) = queue
            .trim_end_matches('/')
            .rsplit_once('/')
            .expect("{prefix}/{key}/");
        let marks = format!("{root}/%revoked/{escaped}/");
        let guard = registry
            .lock(&key)
            .lease(10 * SECOND)
            .acquire()
            .await
            .expect("acquire");
        let delay = Duration::from_micros(round * 500);
        let (_, revoked) = tokio::join!(
            async {
                tokio::time::sleep(delay).await;
                let _ = guard.release().await;
            },
            revoker.revoke(&key)
        );
        revoked.expect("revoke");
        let left = dlock_tests::etcd_support::entries(&admin, &marks).await;
        assert!(left.is_empty(), "round {round}: marks left {left:?}");
        assert!(
            dlock_tests::etcd_support::entries(&admin, &queue)
                .await
                .is_empty(),
            "round {round}: an entry left"
        );
    }
}

/// etcd: the mark of a holder revoked and then killed goes with the
/// holder's session, within about the session's TTL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_mark_of_a_crashed_revoked_holder_goes_with_its_session() {
    let url = etcd_url();
    let short = format!("{url}?session_ttl=2s");
    let etcd = EtcdBackend::connect(&url)
        .await
        .unwrap_or_else(|e| servers_missing(&url, e));
    let registry = Registry::builder().default_backend(etcd.clone()).build();
    let admin = dlock_tests::etcd_support::admin(&url).await;
    let key = unique_key("crashed-revoked");
    let queue = etcd.queue_prefix(&format!("dlock:{key}"));
    let (root, escaped) = queue
        .trim_end_matches('/')
        .rsplit_once('/')
        .expect("{prefix}/{key}/");
    let marks = format!("{root}/%revoked/{escaped}/");

    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_dlock-admin-holder"))
        .arg(&short)
        .arg(&key)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .expect("start dlock-admin-holder");
    let mut lines = tokio::io::BufReader::new(child.stdout.take().expect("stdout")).lines();
    let held = tokio::time::timeout(30 * SECOND, lines.next_line())
        .await
        .expect("the child holds in time")
        .expect("its output")
        .expect("a line");
    assert!(held.starts_with("held "), "{held}");
    // Killed right after the revocation, before its
    // next renewal (its lease is 10 s: renewals about every 3 s).
    assert_eq!(registry.revoke(&key).await.expect("revoke").len(), 1);
    child.kill().await.expect("kill the child");
    assert_eq!(
        dlock_tests::etcd_support::entries(&admin, &marks)
            .await
            .len(),
        1,
        "the mark is put"
    );
    let deadline = Instant::now() + 10 * SECOND;
    loop {
        let left = dlock_tests::etcd_support::entries(&admin, &marks).await;
        if left.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the mark outlives the crashed holder's session: {left:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // The key is free for the next holder.
    let next = registry
        .lock(&key)
        .wait(5 * SECOND)
        .acquire()
        .await
        .expect("the key is free");
    next.release().await.expect("release");
}

/// etcd: an acquisition queued behind a revoked holder whose entry is
/// revoked in turn before it learns it heads the queue (its connection
/// held meanwhile) queues again under the same entry name; once every hold
/// of the key is released, no revocation mark is left on the server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_a_queued_acquisition_revoked_before_it_learns_leaves_no_mark() {
    let url = etcd_url();
    let etcd = EtcdBackend::connect(&url)
        .await
        .unwrap_or_else(|e| servers_missing(&url, e));
    let registry = Registry::builder().default_backend(etcd.clone()).build();
    let admin = dlock_tests::etcd_support::admin(&url).await;
    let member = dlock_tests::etcd_support::endpoints(&url)[0].clone();
    let proxy = FaultProxy::start(member).await.expect("proxy");
    let through = dlock_tests::etcd_support::url_to(&[format!("127.0.0.1:{}", proxy.port())], "");
    let waiting = connect(&through).await;
    let key = unique_key("queued-revoked");
    let queue = etcd.queue_prefix(&format!("dlock:{key}"));
    let (root, escaped) = queue
        .trim_end_matches('/')
        .rsplit_once('/')
        .expect("{prefix}/{key}/");
    let marks = format!("{root}/%revoked/{escaped}/");

    let holder = registry
        .lock(&key)
        .lease(30 * SECOND)
        .acquire()
        .await
        .expect("acquire");
    let waiter = {
        let key = key.clone();
        tokio::spawn(async move {
            waiting
                .lock(&key)
                .lease(30 * SECOND)
                .wait(20 * SECOND)
                .acquire()
                .await
        })
    };
    let queued_by = Instant::now() + 10 * SECOND;
    while dlock_tests::etcd_support::entries(&admin, &queue)
        .await
        .len()
        < 2
    {
        assert!(Instant::now() < queued_by, "the waiter never queued");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    proxy.set(Fault::Hold);
    assert_eq!(registry.revoke(&key).await.expect("revoke").len(), 1);
    let second = registry
        .revoke(&key)
        .await
        .expect("revoke the queue's head");
    tokio::time::sleep(Duration::from_millis(300)).await;
    proxy.set(Fault::Pass);
    let next = waiter.await.expect("join");
    let granted = next.as_ref().map(token).ok();
    let _ = holder.release().await;
    if let Ok(next) = next {
        next.release().await.expect("release");
    }
    let left = dlock_tests::etcd_support::entries(&admin, &marks).await;
    assert!(
        left.is_empty(),
        "marks left after every hold was released (the queue's head revoked: {second:?}; \
         the waiter then granted token {granted:?}): {left:?}"
    );
}

/// A Redlock revocation through a registry whose last node was stalled
/// before it ever connected there answers within a bound and reports the
/// holder, whose copies went on the four other nodes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_revocation_with_a_node_stalled_from_the_start_answers_in_time() {
    let hosts = redlock_hosts();
    let holder_registry = connect(&redlock_url()).await;
    let proxy = FaultProxy::start(hosts[4].clone()).await.expect("proxy");
    proxy.set(Fault::Hold);
    let through = format!("redlock://{},{}", hosts[..4].join(","), proxy.addr());
    let key = unique_key("revoke-stalled-early");
    let holder = holder_registry
        .lock(&key)
        .lease(6 * SECOND)
        .acquire()
        .await
        .expect("acquire");
    let started = Instant::now();
    let revoked = tokio::time::timeout(10 * SECOND, async {
        connect(&through).await.revoke(&key).await
    })
    .await
    .expect("the revocation answers within 10 s")
    .expect("four of five nodes answered");
    let took = started.elapsed();
    assert_eq!(revoked.len(), 1, "{revoked:?}");
    assert!(took < 5 * SECOND, "revoke took {took:?}");
    tokio::time::timeout(10 * SECOND, holder.lost())
        .await
        .expect("the holder learns");
    assert_eq!(holder.loss_reason(), Some(LossReason::Revoked));
}

/// etcd: the revoked holder's read of its mark answered late once (held
/// back 3 s on its connection, past one request bound, well within the
/// session's TTL): the holder must still be told it was revoked, not that
/// its key is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_a_revoked_holder_whose_mark_read_is_slow_is_told_revoked() {
    let url = etcd_url();
    let registry = connect(&url).await;
    let member = dlock_tests::etcd_support::endpoints(&url)[0].clone();
    let proxy = FaultProxy::start(member).await.expect("proxy");
    let through = dlock_tests::etcd_support::url_to(&[format!("127.0.0.1:{}", proxy.port())], "");
    let holding = connect(&through).await;
    let key = unique_key("revoked-slow-mark");
    let holder = holding
        .lock(&key)
        .lease(10 * SECOND)
        .acquire()
        .await
        .expect("acquire");
    proxy.hold_next(&[b"%revoked/"], 3 * SECOND);
    assert_eq!(registry.revoke(&key).await.expect("revoke").len(), 1);
    tokio::time::timeout(15 * SECOND, holder.lost())
        .await
        .expect("the holder learns");
    assert!(proxy.held_on().is_some(), "the mark's read was held back");
    assert_eq!(holder.loss_reason(), Some(LossReason::Revoked));
}

/// Keys shaped like the marks (`%revoked`, `/`, a literal `\n` followed by
/// `revoked`) are held, listed, revoked and told so like any other key;
/// after the revocations the listing shows no mark and the keys are free.
async fn keys_shaped_like_marks(url: &str, case: &str) {
    let registry = connect(url).await;
    let other = connect(url).await;
    let base = unique_key(case);
    let keys: Vec<String> = ["%revoked", "/%revoked/x", "\\nrevoked", "%2Frevoked"]
        .iter()
        .map(|suffix| format!("{base}{suffix}"))
        .collect();
    let mut guards = Vec::new();
    for key in &keys {
        guards.push(
            registry
                .lock(key)
                .lease(3 * SECOND)
                .acquire()
                .await
                .expect("acquire"),
        );
    }
    let mut listed: Vec<String> = other
        .list(&base, 100)
        .await
        .expect("list")
        .iter()
        .map(|info| info.key().to_owned())
        .collect();
    listed.sort();
    let mut expected = keys.clone();
    expected.sort();
    assert_eq!(listed, expected);
    for key in &keys {
        assert_eq!(other.revoke(key).await.expect("revoke").len(), 1, "{key}");
    }
    assert!(
        other.list(&base, 100).await.expect("list").is_empty(),
        "marks listed"
    );
    for (key, guard) in keys.iter().zip(&guards) {
        tokio::time::timeout(10 * SECOND, guard.lost())
            .await
            .expect("the holder learns");
        assert_eq!(guard.loss_reason(), Some(LossReason::Revoked), "{key}");
        assert!(
            other.inspect(key).await.expect("inspect").is_none(),
            "{key}"
        );
    }
    for key in &keys {
        let next = other
            .lock(key)
            .acquire()
            .await
            .unwrap_or_else(|e| panic!("{key} is free: {e}"));
        next.release().await.expect("release");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_keys_shaped_like_marks_are_revoked_like_any_other() {
    keys_shaped_like_marks(&redlock_url(), "redlock-mark-shaped").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_keys_shaped_like_marks_are_revoked_like_any_other() {
    keys_shaped_like_marks(&etcd_url(), "etcd-mark-shaped").await;
}

/// Redlock: the holder's release racing a revocation, round after round,
/// leaves the key free on every node and no mark without an expiry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_revocation_racing_the_release_frees_every_node() {
    let registry = connect(&redlock_url()).await;
    let revoker = connect(&redlock_url()).await;
    let mut nodes = Vec::new();
    for host in redlock_hosts() {
        let url = format!("redis://{host}/");
        nodes.push(
            redis::Client::open(url.as_str())
                .expect("node url")
                .get_multiplexed_async_connection()
                .await
                .unwrap_or_else(|e| servers_missing(&url, e)),
        );
    }
    for round in 0..20u64 {
        let key = unique_key(&format!("redlock-revoke-vs-release-{round}"));
        let stored = format!("dlock:{key}");
        let mark = format!("{stored}\nrevoked");
        let guard = registry
            .lock(&key)
            .lease(5 * SECOND)
            .acquire()
            .await
            .expect("acquire");
        let delay = Duration::from_micros(round * 300);
        let (_, revoked) = tokio::join!(
            async {
                tokio::time::sleep(delay).await;
                let _ = guard.release().await;
            },
            revoker.revoke(&key)
        );
        revoked.expect("revoke");
        for node in &mut nodes {
            let held: Option<String> = redis::cmd("GET")
                .arg(&stored)
                .query_async(node)
                .await
                .expect("GET");
            assert!(held.is_none(), "round {round}: a copy left: {held:?}");
            let left: i64 = redis::cmd("PTTL")
                .arg(&mark)
                .query_async(node)
                .await
                .expect("PTTL");
            assert!(
                left == -2 || (0..=6_000).contains(&left),
                "round {round}: a mark kept for {left} ms"
            );
        }
        let next = registry
            .lock(&key)
            .acquire()
            .await
            .expect("the key is free at once");
        next.release().await.expect("release");
    }
}

/// Redlock: a revocation while an acquisition is half-way (its copies on
/// three nodes, two nodes stalled) reports that acquisition's holder, and
/// the acquisition, if it returns a guard, is told "revoked" within a
/// renewal period; the key is free for the next holder at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_revocation_during_a_half_granted_acquisition() {
    let hosts = redlock_hosts();
    let registry = connect(&redlock_url()).await;
    let (four, five) = (
        FaultProxy::start(hosts[3].clone()).await.expect("proxy"),
        FaultProxy::start(hosts[4].clone()).await.expect("proxy"),
    );
    let through = format!(
        "redlock://{},{},{}",
        hosts[..3].join(","),
        four.addr(),
        five.addr()
    );
    let acquiring = connect(&through).await;
    let key = unique_key("revoke-half-granted");
    four.set(Fault::Hold);
    five.set(Fault::Hold);
    let acquisition = {
        let key = key.clone();
        tokio::spawn(async move {
            acquiring
                .lock(&key)
                .lease(3 * SECOND)
                .wait(5 * SECOND)
                .acquire()
                .await
        })
    };
    let seen_by = Instant::now() + 5 * SECOND;
    while registry.inspect(&key).await.expect("inspect").is_none() {
        assert!(
            Instant::now() < seen_by,
            "the copies never reached a majority"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let revoked = registry.revoke(&key).await.expect("revoke");
    assert_eq!(revoked.len(), 1, "{revoked:?}");
    let next = registry
        .lock(&key)
        .lease(3 * SECOND)
        .acquire()
        .await
        .expect("the key is free at once");
    four.set(Fault::Pass);
    five.set(Fault::Pass);
    if let Ok(half) = acquisition.await.expect("join") {
        tokio::time::timeout(5 * SECOND, half.lost())
            .await
            .expect("the half-granted holder learns");
        assert_eq!(half.loss_reason(), Some(LossReason::Revoked));
    }
    assert!(
        next.loss_reason().is_none(),
        "the next holder keeps the key"
    );
    next.release().await.expect("release");
}

/// Redlock: a revocation dropped mid-way (one node stalled, dropped at
/// several instants) leaves the holder either holding or told "revoked",
/// never told its key is gone, and leaves no copy that outlives its lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_revocation_dropped_mid_way_leaves_the_holder_holding_or_revoked() {
    let hosts = redlock_hosts();
    let registry = connect(&redlock_url()).await;
    let proxy = FaultProxy::start(hosts[4].clone()).await.expect("proxy");
    let through = format!("redlock://{},{}", hosts[..4].join(","), proxy.addr());
    let revoker = connect(&through).await;
    for (round, after) in [0u64, 2, 10, 30, 80, 200, 500].into_iter().enumerate() {
        let key = unique_key(&format!("revoke-dropped-{round}"));
        let holder = registry
            .lock(&key)
            .lease(3 * SECOND)
            .acquire()
            .await
            .expect("acquire");
        assert!(revoker.inspect(&key).await.expect("inspect").is_some());
        proxy.set(Fault::Hold);
        let dropped = tokio::time::timeout(Duration::from_millis(after), revoker.revoke(&key))
            .await
            .is_err();
        proxy.set(Fault::Pass);
        tokio::time::sleep(2 * SECOND).await;
        match holder.loss_reason() {
            None => assert!(
                registry.inspect(&key).await.expect("inspect").is_some(),
                "round {round} (dropped: {dropped}): the holder is not told, yet holds nothing"
            ),
            Some(reason) => assert_eq!(
                reason,
                LossReason::Revoked,
                "round {round} (dropped after {after} ms: {dropped})"
            ),
        }
        let _ = holder.release().await;
        let next = registry
            .lock(&key)
            .wait(5 * SECOND)
            .acquire()
            .await
            .expect("the key is free");
        next.release().await.expect("release");
    }
}
