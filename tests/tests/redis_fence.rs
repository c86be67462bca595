//! Bounded state and fencing tokens on Redis: locking many
//! distinct names leaves no key per name on the server, and tokens strictly
//! increase per key when the shared fence counter is deleted, lost in a
//! restart without persistence, or behind on a replica promoted after its
//! master died.
//!
//! The key count is taken on a database of this test's own (`/11`) of the
//! shared server; restarts and promotions use `redis-server`s of the test's
//! own on ports 29401–29403 and 29409 (29400 stays free: the "master that
//! does not exist").
#![cfg(feature = "redis")]

use std::sync::Arc;
use std::time::{Duration, Instant};

use dlock_runtime::{RedisBackend, Registry};
use dlock_tests::redis_support::OwnRedis;
use dlock_tests::{server_url, servers_missing, unique_key};

/// The shared server's database that only this binary uses.
const DB: u32 = 11;

fn db_url() -> String {
    let url = server_url("DLOCK_TEST_REDIS_URL", "redis://127.0.0.1:46379/");
    let base = url.trim_end_matches('/');
    format!("{base}/{DB}")
}

async fn registry(url: &str) -> Registry {
    Registry::builder()
        .default_backend(
            RedisBackend::connect(url)
                .await
                .unwrap_or_else(|e| servers_missing(url, e)),
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

async fn dbsize(conn: &mut redis::aio::MultiplexedConnection) -> u64 {
    redis::cmd("DBSIZE")
        .query_async(conn)
        .await
        .expect("DBSIZE")
}

/// The keys of the database other than the shared counter, counted
/// atomically (another test of this file deletes the counter meanwhile).
async fn keys_besides_the_counter(conn: &mut redis::aio::MultiplexedConnection) -> u64 {
    redis::Script::new("return redis.call('DBSIZE') - redis.call('EXISTS', KEYS[1])")
        .key("dlock-fence")
        .invoke_async(conn)
        .await
        .expect("DBSIZE")
}

async fn token_of(registry: &Registry, key: &str) -> u64 {
    let guard = registry
        .lock(key)
        .wait(Duration::from_secs(5))
        .acquire()
        .await
        .expect("acquire");
    let token = guard.fencing_token().expect("Redis fences").into();
    guard.release().await.expect("release");
    token
}

/// 100,000 distinct names locked and released (32 at a time): the database's
/// key count is back at its baseline, plus at most the one shared counter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_thousand_names_leave_no_key_behind() {
    const NAMES: usize = 100_000;
    const TASKS: usize = 32;
    let url = db_url();
    let registry = Arc::new(registry(&url).await);
    let mut conn = admin(&url).await;
    let baseline = keys_besides_the_counter(&mut conn).await;
    let run = unique_key("names");
    let started = Instant::now();
    let tasks: Vec<_> = (0..TASKS)
        .map(|t| {
            let (registry, run) = (registry.clone(), run.clone());
            tokio::spawn(async move {
                for i in (t..NAMES).step_by(TASKS) {
                    let guard = registry
                        .lock(format!("{run}:order:{i}"))
                        .acquire()
                        .await
                        .expect("acquire");
                    guard.release().await.expect("release");
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.expect("task");
    }
    let took = started.elapsed();
    let after = keys_besides_the_counter(&mut conn).await;
    println!(
        "{NAMES} names locked and released in {took:?} ({:.0}/s); keys in db {DB}: \
         {baseline} before, {after} after (besides the shared counter)",
        NAMES as f64 / took.as_secs_f64()
    );
    assert!(
        after <= baseline,
        "{NAMES} distinct names left {} keys (baseline {baseline})",
        after - baseline
    );
}

/// The shared counter deleted (an operator, an eviction): the next token of
/// the key is still larger.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_increase_across_a_counter_delete() {
    let url = db_url();
    let registry = registry(&url).await;
    let key = unique_key("counter-deleted");
    let mut last = token_of(&registry, &key).await;
    let mut conn = admin(&url).await;
    for _ in 0..5 {
        let _: i64 = redis::cmd("DEL")
            .arg("dlock-fence")
            .query_async(&mut conn)
            .await
            .expect("DEL");
        let next = token_of(&registry, &key).await;
        assert!(next > last, "token {next} after the DEL, {last} before");
        last = next;
    }
}

/// A server restarted without persistence comes back empty, counter
/// included: the next token of the key is still larger.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_increase_across_a_restart_without_persistence() {
    let mut server = OwnRedis::start(29401, &[]).await;
    let registry = registry(&format!("{}?timeout=500ms", server.url())).await;
    let key = unique_key("restart");
    let mut last = 0;
    for _ in 0..50 {
        let token = token_of(&registry, &key).await;
        assert!(token > last);
        last = token;
    }
    server.restart().await;
    assert_eq!(
        dbsize(&mut server.admin().await).await,
        0,
        "restarted empty"
    );
    // Within `wait`, the acquisition rides out the reconnection.
    let next = token_of(&registry, &key).await;
    assert!(next > last, "token {next} after the restart, {last} before");
}

/// A replica that stopped hearing its master (here: pointed at a master that
/// does not exist) while the master went on granting, then promoted with
/// `REPLICAOF NO ONE` once the master died: its counter is behind, yet the
/// next token of the key is larger than every token the old master issued.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_increase_across_a_lagging_replica_promotion() {
    let mut master = OwnRedis::start(29402, &[]).await;
    let replica = OwnRedis::start(29403, &["--replicaof", "127.0.0.1", "29402"]).await;
    let on_master = registry(&format!("{}?timeout=500ms", master.url())).await;
    let key = unique_key("promotion");
    let heard = token_of(&on_master, &key).await;
    // The replica has the counter up to `heard` (its first sync takes a moment).
    let mut replica_conn = replica.admin().await;
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let counter: Option<u64> = redis::cmd("GET")
            .arg("dlock-fence")
            .query_async(&mut replica_conn)
            .await
            .expect("GET on the replica");
        if counter == Some(heard) {
            break;
        }
        assert!(Instant::now() < deadline, "the replica never synced");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The replica loses its master (a partition); it keeps its data.
    let _: () = redis::cmd("REPLICAOF")
        .arg("127.0.0.1")
        .arg(29400)
        .query_async(&mut replica_conn)
        .await
        .expect("REPLICAOF elsewhere");
    let mut last = heard;
    for _ in 0..20 {
        last = token_of(&on_master, &key).await;
    }
    master.kill();
    let _: () = redis::cmd("REPLICAOF")
        .arg("NO")
        .arg("ONE")
        .query_async(&mut replica_conn)
        .await
        .expect("REPLICAOF NO ONE");
    let counter: u64 = redis::cmd("GET")
        .arg("dlock-fence")
        .query_async(&mut replica_conn)
        .await
        .expect("the promoted replica's counter");
    assert!(
        counter < last,
        "the replica is behind: its counter {counter}, the master's last token {last}"
    );
    let on_replica = registry(&replica.url()).await;
    let next = token_of(&on_replica, &key).await;
    assert!(
        next > last,
        "token {next} on the promoted replica, {last} issued by the old master"
    );
}

/// A counter ahead of the server clock (a clock stepped back, or tokens
/// issued by a server whose clock ran ahead): the tokens go on from the
/// counter, one by one, and the counter keeps up with them. And a counter
/// that is not a number (written by someone else) is overwritten, not an
/// error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_go_on_from_a_counter_ahead_of_the_clock() {
    let server = OwnRedis::start(29409, &[]).await;
    let registry = registry(&server.url()).await;
    let mut admin = server.admin().await;
    let now_us = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after 1970")
        .as_micros() as u64;
    let ahead = now_us + 3_600_000_000; // an hour ahead
    let _: () = redis::cmd("SET")
        .arg("dlock-fence")
        .arg(ahead)
        .query_async(&mut admin)
        .await
        .expect("SET");
    let key = unique_key("counter-ahead");
    for n in 1..=5 {
        assert_eq!(token_of(&registry, &key).await, ahead + n);
    }
    let counter: u64 = redis::cmd("GET")
        .arg("dlock-fence")
        .query_async(&mut admin)
        .await
        .expect("GET");
    assert_eq!(counter, ahead + 5);

    let _: () = redis::cmd("SET")
        .arg("dlock-fence")
        .arg("not a number")
        .query_async(&mut admin)
        .await
        .expect("SET");
    let token = token_of(&registry, &key).await;
    assert!(
        token > now_us && token < ahead,
        "from the clock again: {token}"
    );
}
