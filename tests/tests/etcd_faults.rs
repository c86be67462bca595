//! The etcd backend under faults of the test cluster: the leader or a
//! follower killed while keys are held and waited for, a member cut off
//! behind a proxy, an unreachable cluster, and token order across holders.
//! The tests run one at a time: a member killed by one would stall the others.
#![cfg(feature = "etcd")]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use dlock_runtime::{LockError, LockGuard};
use dlock_testkit::{Fault, FaultProxy};
use dlock_tests::etcd_support::{
    RestartMembersOnDrop, backend, endpoints, kill_member, leader, registry, start_member, url,
    url_to,
};
use dlock_tests::unique_key;
use tokio::sync::Mutex;

/// One test at a time.
static CLUSTER: Mutex<()> = Mutex::const_new(());

/// Three keys held by one process and waited for by another while member
/// `victim` is SIGKILLed: every holder keeps its lease (its renewals and
/// keep-alives reach the new leader well within the 10 s lease and the
/// session's ⅔ TTL, even through a slow election), no waiter is served while
/// its holder holds, and each waiter, served once its holder releases, has
/// a larger token.
async fn holders_and_waiters_survive_a_member_kill(pick: fn(usize) -> usize, case: &str) {
    let _one = CLUSTER.lock().await;
    let _restart = RestartMembersOnDrop;
    let holder_etcd = backend(&url()).await;
    let holders = registry(&holder_etcd);
    let waiters = registry(&backend(&url()).await);
    let mut held: Vec<(String, LockGuard, Arc<AtomicBool>)> = Vec::new();
    for i in 0..3 {
        let key = unique_key(&format!("{case}-{i}"));
        let guard = holders
            .lock(&key)
            .lease(Duration::from_secs(10))
            .acquire()
            .await
            .expect("acquire");
        held.push((key, guard, Arc::new(AtomicBool::new(true))));
    }
    let mut tasks = Vec::new();
    for (key, guard, holding) in &held {
        let (waiters, key, holding) = (waiters.clone(), key.clone(), holding.clone());
        let token = guard.fencing_token().expect("token");
        tasks.push(tokio::spawn(async move {
            let next = waiters
                .lock(&key)
                .wait(Duration::from_secs(60))
                .acquire()
                .await
                .expect("the waiter is served");
            assert!(
                !holding.load(Ordering::SeqCst),
                "{key}: granted while its holder held it"
            );
            assert!(next.fencing_token().expect("token") > token, "{key}");
            next.release().await.expect("release");
        }));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let victim = pick(leader(&url()).await);
    kill_member(victim);
    let killed = Instant::now();
    // Through the election and past a renewal of the 10 s leases.
    tokio::time::sleep(Duration::from_secs(5)).await;
    for (key, guard, _) in &held {
        assert!(!guard.is_lost(), "{key}: the holder lost its lease");
    }
    assert!(
        tasks.iter().all(|t| !t.is_finished()),
        "a waiter finished early"
    );
    for (_, guard, holding) in held {
        holding.store(false, Ordering::SeqCst);
        guard.release().await.expect("release after the kill");
    }
    for task in tasks {
        tokio::time::timeout(Duration::from_secs(20), task)
            .await
            .expect("waiters are served after the kill")
            .expect("waiter");
    }
    start_member(victim);
    eprintln!(
        "member {victim} killed; all served {:?} after",
        killed.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_leader_keeps_holders_and_serves_waiters() {
    holders_and_waiters_survive_a_member_kill(|leader| leader, "leader-kill").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_a_follower_keeps_holders_and_serves_waiters() {
    holders_and_waiters_survive_a_member_kill(|leader| (leader + 1) % 3, "follower-kill").await;
}

/// A holder whose only member is cut off (a partition: its packets are held,
/// nothing is refused) hears of its loss before etcd can expire its session
/// lease — so before anyone else can be granted the key — and the waiter on
/// the healthy side is served after that.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_holder_hears_of_its_loss_before_anyone_is_granted() {
    let _one = CLUSTER.lock().await;
    let member = endpoints(&url())[0].clone();
    let proxy = FaultProxy::start(member).await.expect("proxy");
    let cut_url = url_to(&[format!("127.0.0.1:{}", proxy.port())], "?session_ttl=3s");
    let holder = registry(&backend(&cut_url).await);
    let other = registry(&backend(&url()).await);
    let key = unique_key("partition");
    let guard = holder
        .lock(&key)
        .lease(Duration::from_secs(30))
        .acquire()
        .await
        .expect("acquire");
    let token = guard.fencing_token().expect("token");
    let waiter = tokio::spawn({
        let key = key.clone();
        async move {
            let next = other
                .lock(&key)
                .wait(Duration::from_secs(30))
                .acquire()
                .await;
            (next, Instant::now())
        }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    proxy.set(Fault::Hold);
    let cut = Instant::now();
    tokio::time::timeout(Duration::from_secs(10), guard.lost())
        .await
        .expect("the holder hears of the loss");
    let lost_at = Instant::now();
    let (next, granted_at) = tokio::time::timeout(Duration::from_secs(20), waiter)
        .await
        .expect("the waiter is served")
        .expect("task");
    let next = next.expect("the waiter gets the key");
    assert!(
        lost_at < granted_at,
        "granted {:?} before the holder heard of its loss",
        lost_at - granted_at
    );
    assert!(
        lost_at - cut <= Duration::from_secs(3),
        "loss heard {:?} after the cut: later than the session TTL",
        lost_at - cut
    );
    assert!(next.fencing_token().expect("token") > token);
    next.release().await.expect("release");
    proxy.set(Fault::Pass);
    assert!(matches!(guard.release().await, Err(LockError::Lost { .. })));
    eprintln!(
        "loss heard {:?} after the cut, key granted {:?} after",
        lost_at - cut,
        granted_at - cut
    );
}

/// With the cluster unreachable (its only member cut off), an acquisition
/// answers an error within its `wait` and one request bound — no hang.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_cluster_is_an_error_within_wait() {
    let _one = CLUSTER.lock().await;
    let member = endpoints(&url())[1].clone();
    let proxy = FaultProxy::start(member).await.expect("proxy");
    let cut_url = url_to(&[format!("127.0.0.1:{}", proxy.port())], "?session_ttl=3s");
    let locks = registry(&backend(&cut_url).await);
    proxy.set(Fault::Hold);
    let started = Instant::now();
    let result = locks
        .lock(unique_key("unreachable"))
        .wait(Duration::from_secs(1))
        .acquire()
        .await;
    let took = started.elapsed();
    let err = result.expect_err("no cluster to grant it");
    assert!(matches!(err, LockError::Backend { .. }), "{err:?}");
    assert!(took < Duration::from_secs(3), "took {took:?}");
    proxy.set(Fault::Pass);
}

/// Holders from three processes take turns on one key: never two at once,
/// and every holder's token is larger than the one before it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_increase_across_holders_of_three_processes() {
    let _one = CLUSTER.lock().await;
    let key = unique_key("token-order");
    let mut backends = Vec::new();
    for _ in 0..3 {
        backends.push(registry(&backend(&url()).await));
    }
    let log = Arc::new(std::sync::Mutex::new(Vec::new()));
    let inside = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for (p, locks) in backends.into_iter().enumerate() {
        for t in 0..3 {
            let (locks, key, log, inside) =
                (locks.clone(), key.clone(), log.clone(), inside.clone());
            tasks.push(tokio::spawn(async move {
                for _ in 0..8 {
                    let guard = locks
                        .lock(&key)
                        .wait(Duration::from_secs(60))
                        .acquire()
                        .await
                        .expect("acquire");
                    assert!(!inside.swap(true, Ordering::SeqCst), "two holders at once");
                    log.lock().unwrap().push((
                        u64::from(guard.fencing_token().expect("token")),
                        p,
                        t,
                    ));
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    inside.store(false, Ordering::SeqCst);
                    guard.release().await.expect("release");
                }
            }));
        }
    }
    for task in tasks {
        task.await.expect("holder");
    }
    let log = log.lock().unwrap();
    assert_eq!(log.len(), 72);
    for pair in log.windows(2) {
        assert!(pair[0].0 < pair[1].0, "tokens out of order: {pair:?}");
    }
}
