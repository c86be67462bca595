//! Redis locks without a fencing token (`?fencing=off`, `fencing(false)`,
//! `fencing = false`): the conformance suite on an unfenced backend, mutual
//! exclusion with fenced holds of the same key, no token, wake-ups by the
//! release message, expiry of a holder that never releases, the URL option,
//! Redis Cluster, replica acknowledgements, and acquisitions dropped at each
//! of their awaits.
//!
//! The suite runs with `fences: false`: its cases that look at the token
//! (`fencing_tokens_strictly_increase`, and the token checks of
//! `reentrancy_within_a_task` and `current_inside_and_outside`) expect `None`;
//! every other case is the same as on a fenced backend.
#![cfg(feature = "redis")]

use std::sync::Arc;
use std::time::{Duration, Instant};

use dlock_runtime::backend::{AcquireRequest, Attempt, LockBackend};
use dlock_runtime::{LockError, RedisBackend, Registry, distributed_lock};
use dlock_tests::redis_support::{OwnRedis, RedisFaults, RedisKeyFaults, hash_tagged};
use dlock_tests::{Harness, acquire_and_release, server_url, servers_missing, unique_key};
use futures_util::FutureExt;
use tokio::sync::OnceCell;

fn url() -> String {
    server_url("DLOCK_TEST_REDIS_URL", "redis://127.0.0.1:46379/")
}

fn cluster_url() -> String {
    server_url(
        "DLOCK_TEST_REDIS_CLUSTER_URL",
        "redis+cluster://127.0.0.1:47001,127.0.0.1:47002,127.0.0.1:47003",
    )
}

/// `url` with `option` added to its query.
fn with_option(url: &str, option: &str) -> String {
    let separator = if url.contains('?') { '&' } else { '?' };
    format!("{url}{separator}{option}")
}

async fn connect(url: &str) -> RedisBackend {
    RedisBackend::connect(url)
        .await
        .unwrap_or_else(|e| servers_missing(url, e))
}

/// The global registry: an unfenced backend by default, and the same server
/// fenced as the backend `fenced` (for the attribute's `fencing = false`).
async fn harness() -> &'static Harness {
    static HARNESS: OnceCell<Harness> = OnceCell::const_new();
    HARNESS
        .get_or_init(|| async {
            let url = url();
            dlock_runtime::init(
                Registry::builder()
                    .default_backend(connect(&with_option(&url, "fencing=off")).await)
                    .backend("fenced", connect(&url).await)
                    .build(),
            )
            .expect("first init");
            Harness {
                faults: Arc::new(RedisKeyFaults {
                    redis: RedisFaults::nodes(&[url]).await,
                    layout: hash_tagged,
                }),
                fences: false,
            }
        })
        .await
}

dlock_tests::conformance_suite!(harness);
dlock_tests::semaphore_suite!(harness);
dlock_tests::rw_suite!(harness);

/// A registry on connections of its own (what another process would have),
/// fenced or not by its URL.
async fn registry_at(url: &str) -> Registry {
    Registry::builder()
        .default_backend(connect(url).await)
        .build()
}

/// Whichever holds the key first, fenced or unfenced, the other is refused
/// until it is released; the fenced hold has a token, the unfenced one none.
async fn fenced_and_unfenced_exclude_each_other(fenced: &Registry, unfenced: &Registry) {
    let key = unique_key("mixed");
    let unfenced_lock = || unfenced.lock(&key).fencing(false);
    // Fenced first.
    let guard = fenced.lock(&key).acquire().await.expect("fenced");
    assert!(guard.fencing_token().is_some());
    assert!(matches!(
        unfenced_lock().acquire().await,
        Err(LockError::Busy { .. })
    ));
    guard.release().await.expect("release fenced");
    // Unfenced first, on a short lease: past two of its renewals (the same
    // owner-checked script) it is still held, and still excludes.
    let guard = unfenced_lock()
        .lease(Duration::from_millis(300))
        .acquire()
        .await
        .expect("unfenced");
    assert_eq!(guard.fencing_token(), None);
    assert!(matches!(
        fenced.lock(&key).acquire().await,
        Err(LockError::Busy { .. })
    ));
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert!(!guard.is_lost(), "the unfenced lease was not renewed");
    assert!(matches!(
        fenced.lock(&key).acquire().await,
        Err(LockError::Busy { .. })
    ));
    guard.release().await.expect("release unfenced");
    acquire_and_release(fenced, &key).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fenced_and_unfenced_holds_of_one_key_exclude_each_other() {
    harness().await;
    let (fenced, unfenced) = (registry_at(&url()).await, registry_at(&url()).await);
    fenced_and_unfenced_exclude_each_other(&fenced, &unfenced).await;
    // The same with the whole backend unfenced by its URL.
    let unfenced = registry_at(&with_option(&url(), "fencing=off")).await;
    fenced_and_unfenced_exclude_each_other(&fenced, &unfenced).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fenced_and_unfenced_holds_exclude_each_other_on_redis_cluster() {
    let (fenced, unfenced) = (
        registry_at(&cluster_url()).await,
        registry_at(&with_option(&cluster_url(), "fencing=off")).await,
    );
    fenced_and_unfenced_exclude_each_other(&fenced, &fenced).await;
    fenced_and_unfenced_exclude_each_other(&fenced, &unfenced).await;
}

#[distributed_lock(key = "{key}", backend = "fenced", fencing = false)]
async fn unfenced_body(key: &str) -> Result<Option<u64>, LockError> {
    Ok(dlock_runtime::current()
        .expect("inside")
        .fencing_token()
        .map(u64::from))
}

#[distributed_lock(key = "{key}", backend = "fenced")]
async fn fenced_body(key: &str) -> Result<Option<u64>, LockError> {
    Ok(dlock_runtime::current()
        .expect("inside")
        .fencing_token()
        .map(u64::from))
}

/// `fencing = false` on a fenced backend, `fencing(false)` on the builder,
/// and a `?fencing=off` backend: no token, on the guard and on `current()`;
/// the same backend still fences the locks that do not opt out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unfenced_hold_has_no_token() {
    let h = harness().await;
    let key = unique_key("no-token");
    assert_eq!(unfenced_body(&key).await.expect("attribute"), None);
    assert!(fenced_body(&key).await.expect("attribute").is_some());

    let guard = h
        .registry()
        .lock(&key)
        .backend("fenced")
        .fencing(false)
        .acquire()
        .await
        .expect("builder");
    assert_eq!(guard.fencing_token(), None);
    let inside = guard
        .scope(async { dlock_runtime::current().map(|c| c.fencing_token()) })
        .await;
    assert_eq!(inside, Some(None));
    guard.release().await.expect("release");

    // The default backend is `?fencing=off`: no token even when asked for.
    let guard = h.registry().lock(&key).acquire().await.expect("url");
    assert_eq!(guard.fencing_token(), None);
    guard.release().await.expect("release");
}

/// A port of this file's own server (the shared servers are 46379 and up,
/// the other tests' own 29401–29408).
const OWN_PORT: u16 = 47731;

/// The calls of each command the server ran since the last `CONFIG RESETSTAT`,
/// by name.
async fn commands(admin: &mut redis::aio::MultiplexedConnection) -> Vec<(String, u64)> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(admin)
        .await
        .expect("INFO commandstats");
    info.lines()
        .filter_map(|line| {
            let (name, rest) = line.strip_prefix("cmdstat_")?.split_once(':')?;
            let calls = rest
                .strip_prefix("calls=")?
                .split(',')
                .next()?
                .parse()
                .ok()?;
            Some((name.to_owned(), calls))
        })
        .filter(|(name, _)| !matches!(name.as_str(), "info" | "config|resetstat"))
        .collect::<std::collections::BTreeMap<_, _>>()
        .into_iter()
        .collect()
}

/// On a server of its own, where every command is the test's: an unfenced
/// grant is one `SET` and one `PTTL`, no script; a fenced one runs the
/// acquire script. Both leave the same key, the owner with the lease as TTL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unfenced_grant_is_a_set_and_a_pttl_without_a_script() {
    let server = OwnRedis::start(OWN_PORT, &[]).await;
    let mut admin = server.admin().await;
    let registry = registry_at(&server.url()).await;
    for fencing in [false, true] {
        let key = format!("grant-commands-{fencing}");
        let () = redis::cmd("CONFIG")
            .arg("RESETSTAT")
            .query_async(&mut admin)
            .await
            .expect("CONFIG RESETSTAT");
        let guard = registry
            .lock(&key)
            .lease(Duration::from_secs(20))
            .fencing(fencing)
            .acquire()
            .await
            .expect("acquire");
        let sent = commands(&mut admin).await;
        if fencing {
            // The script's own commands are counted too (and its first call
            // loads it).
            assert!(
                sent.iter().any(|(name, _)| name == "evalsha"),
                "fenced grant: {sent:?}"
            );
        } else {
            assert_eq!(
                sent,
                [("pttl".to_owned(), 1), ("set".to_owned(), 1)],
                "unfenced grant"
            );
        }
        let stored = hash_tagged(&format!("{}{key}", registry.key_prefix()));
        let (value, ttl): (String, i64) = redis::pipe()
            .get(&stored)
            .pttl(&stored)
            .query_async(&mut admin)
            .await
            .expect("GET, PTTL");
        // The owner token, then the holder record on the next line.
        let (owner, record) = value.split_once('\n').expect("a holder record");
        assert_eq!(owner.len(), 32, "the owner token: {owner}");
        let fields: Vec<&str> = record.splitn(3, ' ').collect();
        let [token, granted, holder] = fields[..] else {
            panic!("a token, a time and a record: {record}");
        };
        if fencing {
            assert!(
                token.parse::<u64>().is_ok() && granted.parse::<u64>().is_ok(),
                "a fenced grant's token and server time: {record}"
            );
        } else {
            assert_eq!((token, granted), ("-", "-"), "an unfenced grant: {record}");
        }
        assert!(
            holder.starts_with(&format!("h1 {} ", std::process::id())),
            "the holder: {record}"
        );
        assert!((19_000..=20_000).contains(&ttl), "TTL {ttl} ms");
        guard.release().await.expect("release");
    }
}

/// A waiter is woken by an unfenced holder's release message, not by its
/// 30 s lease running out: on one server, and on Redis Cluster (the sharded
/// message of the same release script).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unfenced_release_wakes_a_waiter_of_another_connection() {
    harness().await;
    for base in [url(), cluster_url()] {
        let unfenced = with_option(&base, "fencing=off");
        let (holder, waiter) = (registry_at(&unfenced).await, registry_at(&unfenced).await);
        let handoffs = dlock_tests::handoff::measure(
            &holder,
            &waiter,
            &unique_key("unfenced-handoff"),
            5,
            Duration::from_millis(100),
        )
        .await;
        assert!(
            handoffs.median() < Duration::from_secs(1),
            "{base}: median handoff {:?} (all: {handoffs:?})",
            handoffs.median()
        );
    }
}

/// A holder that never releases nor renews (a crashed process: its grant
/// was made by the backend directly, with no watchdog behind it) frees the
/// key when its TTL runs out: the waiter takes it then, not before, and not
/// at the end of its own `wait`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_unfenced_holders_key_frees_at_its_ttl() {
    let h = harness().await;
    let key = unique_key("crashed-unfenced");
    let crashed = connect(&with_option(&url(), "fencing=off")).await;
    let ttl = Duration::from_millis(800);
    let request = AcquireRequest::new(h.stored(&key), "crashed-holder", ttl).with_fencing(false);
    let granted = Instant::now();
    let attempt = crashed.try_acquire(&request).await.expect("grant");
    assert!(
        matches!(attempt, Attempt::Held(_)),
        "the key was free: {attempt:?}"
    );
    assert!(h.faults.is_held(&h.stored(&key)).await);
    let guard = h
        .registry()
        .lock(&key)
        .wait(Duration::from_secs(10))
        .acquire()
        .await
        .expect("taken once the TTL ran out");
    let waited = granted.elapsed();
    assert!(waited >= ttl - Duration::from_millis(50), "{waited:?}");
    assert!(waited < ttl + Duration::from_secs(3), "{waited:?}");
    guard.release().await.expect("release");
}

/// An unfenced attempt sent again for the same owner (a retry after an
/// attempt whose answer was lost) takes the key again, its lease from now;
/// another owner is told the holder's remaining TTL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_unfenced_attempt_takes_its_own_key_again() {
    let h = harness().await;
    let backend = connect(&with_option(&url(), "fencing=off")).await;
    let stored = h.stored(&unique_key("retried"));
    let first = AcquireRequest::new(&stored, "retried-owner", Duration::from_secs(2));
    assert!(matches!(
        backend.try_acquire(&first).await.expect("first"),
        Attempt::Held(_)
    ));
    let retry = AcquireRequest::new(&stored, "retried-owner", Duration::from_secs(20));
    match backend.try_acquire(&retry).await.expect("retry") {
        Attempt::Held(lease) => assert_eq!(lease.token, None),
        other => panic!("the retry found its own key busy: {other:?}"),
    }
    let other = AcquireRequest::new(&stored, "another-owner", Duration::from_secs(2));
    match backend.try_acquire(&other).await.expect("other") {
        Attempt::Busy {
            retry_in: Some(retry_in),
        } => assert!(
            retry_in > Duration::from_secs(15) && retry_in <= Duration::from_secs(20),
            "the holder's TTL, extended by the retry: {retry_in:?}"
        ),
        other => panic!("another owner: {other:?}"),
    }
    let lease = match backend.try_acquire(&retry).await.expect("again") {
        Attempt::Held(lease) => lease,
        other => panic!("{other:?}"),
    };
    backend.release(&lease).await.expect("release");
    assert!(!h.faults.is_held(&stored).await);
}

/// `?fencing=off` (and `on`) on `redis://` and `redis+cluster://`; anything
/// else is a configuration error that names the option.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fencing_url_option() {
    for (base, name) in [(url(), "single"), (cluster_url(), "cluster")] {
        let key = unique_key(&format!("url-option-{name}"));
        for (option, fenced) in [("fencing=off", false), ("fencing=on", true)] {
            let registry = registry_at(&with_option(&base, option)).await;
            let guard = registry.lock(&key).acquire().await.expect("acquire");
            assert_eq!(guard.fencing_token().is_some(), fenced, "{name} {option}");
            guard.release().await.expect("release");
        }
        for bad in ["fencing=false", "fencing=OFF", "fencing="] {
            match RedisBackend::connect(&with_option(&base, bad)).await {
                Err(LockError::Config { message }) => {
                    assert!(message.contains("fencing"), "{message}")
                }
                other => panic!("{name} `{bad}`: {other:?}"),
            }
        }
    }
}

/// `?replicas=N` applies to unfenced grants too: acknowledged by the replica,
/// the grant is held; the primary's key is the same as a fenced grant's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unfenced_grants_wait_for_replica_acknowledgements() {
    let primary = server_url("DLOCK_TEST_REDIS_PRIMARY_URL", "redis://127.0.0.1:46384/");
    let registry = registry_at(&with_option(&primary, "replicas=1&fencing=off")).await;
    let key = unique_key("unfenced-replicas");
    let guard = registry.lock(&key).acquire().await.expect("acknowledged");
    assert_eq!(guard.fencing_token(), None);
    let stored = hash_tagged(&format!("{}{key}", registry.key_prefix()));
    let faults = RedisFaults::nodes(&[primary]).await;
    assert!(faults.exists(&stored).await);
    guard.release().await.expect("release");
    assert!(!faults.exists(&stored).await);
}

/// Whether `key` (stored) stays free on the server for `window` after
/// becoming free within `free_within`.
async fn frees_and_stays_free(
    faults: &RedisFaults,
    stored: &str,
    free_within: Duration,
    window: Duration,
) -> Result<(), String> {
    let key = hash_tagged(stored);
    let deadline = Instant::now() + free_within;
    while faults.exists(&key).await {
        if Instant::now() > deadline {
            return Err(format!("{key} still held after {free_within:?}"));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let until = Instant::now() + window;
    while Instant::now() < until {
        if faults.exists(&key).await {
            return Err(format!("{key} came back after it was freed"));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

/// An unfenced acquisition dropped after each of its polls (each poll
/// takes one step: the grant's round trip, the release channel's join, the
/// second try), alone or behind a holder: no key is left for the 30 s lease
/// (the runtime's owner-checked release follows an attempt that may have
/// been granted on the wire).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unfenced_acquisition_dropped_at_its_awaits_leaves_no_key() {
    let h = harness().await;
    let faults = RedisFaults::nodes(&[url()]).await;
    let unfenced = with_option(&url(), "fencing=off");
    for contended in [false, true] {
        for polls in 1..=4 {
            let registry = registry_at(&unfenced).await;
            let key = unique_key(&format!("dropped-{contended}-{polls}"));
            let holder = if contended {
                Some(
                    registry_at(&unfenced)
                        .await
                        .lock(&key)
                        .lease(Duration::from_secs(30))
                        .acquire()
                        .await
                        .expect("holder"),
                )
            } else {
                None
            };
            let mut acquisition = Box::pin(
                registry
                    .lock(&key)
                    .lease(Duration::from_secs(30))
                    .wait(Duration::from_secs(10))
                    .acquire(),
            );
            let mut granted = None;
            for _ in 0..polls {
                if let Some(answer) = (&mut acquisition).now_or_never() {
                    granted = Some(answer);
                    break;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            drop(acquisition);
            if let Some(answer) = granted {
                // Finished before it was dropped: an ordinary release.
                answer.expect("acquire").release().await.expect("release");
            }
            if let Some(holder) = holder {
                holder.release().await.expect("release the holder");
            }
            frees_and_stays_free(
                &faults,
                &h.stored(&key),
                Duration::from_secs(3),
                Duration::from_millis(500),
            )
            .await
            .unwrap_or_else(|e| panic!("contended {contended}, {polls} polls: {e}"));
        }
    }
}
