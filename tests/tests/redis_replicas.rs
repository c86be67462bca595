//! `?replicas=N`: a grant counts only once `N` replicas acknowledged it
//! (`WAIT`), and is undone otherwise. Against the primary and replica that
//! `scripts/servers.sh` starts (46384 -> 46385).
#![cfg(feature = "redis")]

use std::time::{Duration, Instant};

use dlock_runtime::{RedisBackend, Registry};
use dlock_tests::{server_url, servers_missing, unique_key};
use redis::AsyncCommands;

/// One test at a time against the pair: one detaches the replica, which
/// changes what `WAIT` answers the others (and writes on the primary).
static PAIR: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn primary_url() -> String {
    server_url("DLOCK_TEST_REDIS_PRIMARY_URL", "redis://127.0.0.1:46384/")
}

fn replica_url() -> String {
    server_url("DLOCK_TEST_REDIS_REPLICA_URL", "redis://127.0.0.1:46385/")
}

async fn registry(options: &str) -> Registry {
    let url = format!("{}?{options}", primary_url());
    Registry::builder()
        .default_backend(
            RedisBackend::connect(&url)
                .await
                .unwrap_or_else(|e| servers_missing(&url, e)),
        )
        .build()
}

async fn admin(url: &str) -> redis::aio::MultiplexedConnection {
    redis::Client::open(url)
        .unwrap_or_else(|e| servers_missing(url, e))
        .get_multiplexed_async_connection()
        .await
        .unwrap_or_else(|e| servers_missing(url, e))
}

fn redis_key(key: &str) -> String {
    format!("{{dlock:{key}}}")
}

async fn replica_linked(replica: &mut redis::aio::MultiplexedConnection) -> bool {
    let info: String = redis::cmd("INFO")
        .arg("replication")
        .query_async(replica)
        .await
        .expect("INFO replication");
    info.lines().any(|l| l.trim() == "master_link_status:up")
}

/// With the replica attached, a grant is on the replica by the time
/// `acquire` returns. With the replica detached (`REPLICAOF NO ONE`), the
/// acquisition fails with the acknowledgement error once `wait` is over and
/// leaves no key; attached again, grants succeed again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_counts_once_a_replica_acknowledged_it() {
    let _alone = PAIR.lock().await;
    let reg = registry("replicas=1&timeout=600ms").await;
    let mut primary = admin(&primary_url()).await;
    let mut replica = admin(&replica_url()).await;
    assert!(
        replica_linked(&mut replica).await,
        "the replica of scripts/servers.sh is not in sync (run scripts/servers.sh up)"
    );

    for _ in 0..20 {
        let key = unique_key("replicas-ok");
        let guard = reg.lock(&key).acquire().await.expect("acquire");
        let owner: Option<String> = replica.get(redis_key(&key)).await.expect("GET");
        assert!(
            owner.is_some(),
            "the grant was acknowledged, so the replica has the key"
        );
        assert!(guard.fencing_token().is_some());
        guard.release().await.expect("release");
    }

    // Detach the replica: nobody acknowledges.
    let _: () = redis::cmd("REPLICAOF")
        .arg("NO")
        .arg("ONE")
        .query_async(&mut replica)
        .await
        .expect("REPLICAOF NO ONE");
    let reattach = ReattachOnDrop;
    let key = unique_key("replicas-detached");
    let started = Instant::now();
    let Err(err) = reg
        .lock(&key)
        .wait(Duration::from_millis(700))
        .acquire()
        .await
    else {
        panic!("no replica acknowledges: the acquisition must fail")
    };
    let took = started.elapsed();
    let text = err.to_string();
    assert!(
        text.contains("replicas") && text.contains("undone"),
        "the error says why: {text}"
    );
    assert!(
        err.is_retryable(),
        "a missing acknowledgement is transient: {err:?}"
    );
    assert!(
        took >= Duration::from_millis(700) && took < Duration::from_millis(700 + 1500),
        "retried within wait, answered soon after it (took {took:?})"
    );
    let left: bool = primary.exists(redis_key(&key)).await.expect("EXISTS");
    assert!(!left, "an unacknowledged grant is undone");

    drop(reattach);
    let deadline = Instant::now() + Duration::from_secs(20);
    while !replica_linked(&mut replica).await {
        assert!(Instant::now() < deadline, "the replica did not resync");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The replica's side of the link is up before the primary counts it as
    // online: the first grants may still be undone, and are retried within `wait`.
    let guard = reg
        .lock(&key)
        .wait(Duration::from_secs(10))
        .acquire()
        .await
        .expect("acknowledged again once the replica is back");
    guard.release().await.expect("release");
}

/// Puts the replica back under its primary, also when the test fails.
struct ReattachOnDrop;

impl Drop for ReattachOnDrop {
    fn drop(&mut self) {
        let url = replica_url();
        let primary = primary_url();
        let port = primary
            .trim_end_matches('/')
            .rsplit(':')
            .next()
            .expect("a port")
            .to_owned();
        let mut conn = redis::Client::open(url.as_str())
            .and_then(|c| c.get_connection())
            .expect("the replica");
        let _: () = redis::cmd("REPLICAOF")
            .arg("127.0.0.1")
            .arg(port)
            .query(&mut conn)
            .expect("REPLICAOF primary");
    }
}

/// More replicas asked for than exist: every grant is undone, the error says
/// how many acknowledged, and `wait = 0` answers after one `WAIT`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn more_replicas_than_exist_fail_and_leave_no_key() {
    let _alone = PAIR.lock().await;
    let reg = registry("replicas=2&timeout=400ms").await;
    let mut primary = admin(&primary_url()).await;
    let key = unique_key("replicas-two");
    let started = Instant::now();
    let Err(err) = reg.lock(&key).acquire().await else {
        panic!("one replica cannot acknowledge for two")
    };
    assert!(
        err.to_string().contains("of the 2 replicas"),
        "the error counts the acknowledgements: {err}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "one WAIT of 200 ms, took {:?}",
        started.elapsed()
    );
    let left: bool = primary.exists(redis_key(&key)).await.expect("EXISTS");
    assert!(!left, "the grant is undone");
}

/// The caller gives up while its grant waits for the replicas (`WAIT` blocks:
/// two replicas asked for, one exists): the grant must not stay on the
/// server — the runtime's owner-checked release follows the abandoned
/// attempt, over the grants' own connection too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_that_gives_up_during_wait_leaves_no_key() {
    let _alone = PAIR.lock().await;
    let reg = registry("replicas=2&timeout=2s").await;
    let mut primary = admin(&primary_url()).await;
    for round in 0..5 {
        let key = unique_key("replicas-cancelled");
        // WAIT blocks for 1 s (timeout/2); give up 100–500 ms into it.
        let give_up = Duration::from_millis(100 + 100 * round);
        let started = Instant::now();
        let outcome = tokio::time::timeout(give_up, reg.lock(&key).acquire()).await;
        assert!(
            outcome.is_err(),
            "round {round}: the acquisition cannot finish within {give_up:?}, yet after {:?}: {outcome:?}",
            started.elapsed()
        );
        let deadline = Instant::now() + Duration::from_secs(1);
        loop {
            let held: bool = primary.exists(redis_key(&key)).await.expect("EXISTS");
            if !held {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "round {round}: the abandoned grant is still on the server 1 s after the caller gave up"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}
