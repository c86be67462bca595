//! Redis locks without a fencing token, at their edges: a call nested in a
//! hold of the other kind (fenced in unfenced, unfenced in fenced), on Redis
//! and in process; the attribute's `fencing = false` beside `watchdog =
//! false` and `on_busy = "skip"`; a grant the replicas never acknowledge; and
//! a grant whose `SET` reaches the server only after the client timed out.
#![cfg(feature = "redis")]

use std::time::{Duration, Instant};

use dlock_runtime::{LockError, MemoryBackend, RedisBackend, Registry, current, distributed_lock};
use dlock_testkit::FaultProxy;
use dlock_tests::redis_support::{OwnRedis, hash_tagged};
use dlock_tests::{server_url, servers_missing, unique_key};
use redis::AsyncCommands;

fn url() -> String {
    server_url("DLOCK_TEST_REDIS_URL", "redis://127.0.0.1:46379/")
}

fn primary_url() -> String {
    server_url("DLOCK_TEST_REDIS_PRIMARY_URL", "redis://127.0.0.1:46384/")
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

async fn registry_at(url: &str) -> Registry {
    Registry::builder()
        .default_backend(connect(url).await)
        .build()
}

fn memory_registry() -> Registry {
    Registry::builder()
        .default_backend(MemoryBackend::new())
        .build()
}

async fn admin(url: &str) -> redis::aio::MultiplexedConnection {
    redis::Client::open(url)
        .unwrap_or_else(|e| servers_missing(url, e))
        .get_multiplexed_async_connection()
        .await
        .unwrap_or_else(|e| servers_missing(url, e))
}

/// The inner call's token (on its guard, and on `current()` inside its
/// scope) when a fenced call nests in an unfenced hold of the same key.
async fn fenced_inside_unfenced(registry: &Registry, key: &str) -> Result<(bool, bool), LockError> {
    let outer = registry
        .lock(key)
        .fencing(false)
        .acquire()
        .await
        .expect("outer");
    assert_eq!(outer.fencing_token(), None);
    let inner = outer
        .scope(async {
            let inner = registry.lock(key).acquire().await?;
            let on_current = inner
                .scope(async { current().and_then(|c| c.fencing_token()) })
                .await;
            let on_guard = inner.fencing_token();
            inner.release().await?;
            Ok((on_guard.is_some(), on_current.is_some()))
        })
        .await;
    outer.release().await.expect("release outer");
    inner
}

/// The inner call's token when an unfenced call nests in a fenced hold.
async fn unfenced_inside_fenced(registry: &Registry, key: &str) -> (bool, bool) {
    let outer = registry.lock(key).acquire().await.expect("outer");
    assert!(outer.fencing_token().is_some());
    let inner = outer
        .scope(async {
            let inner = registry
                .lock(key)
                .fencing(false)
                .acquire()
                .await
                .expect("nested");
            let on_current = inner
                .scope(async { current().and_then(|c| c.fencing_token()) })
                .await;
            let on_guard = inner.fencing_token();
            inner.release().await.expect("release inner");
            (on_guard.is_some(), on_current.is_some())
        })
        .await;
    outer.release().await.expect("release outer");
    inner
}

/// A fenced call (the default: it asks for a token) nested in an unfenced
/// hold of its key is refused at once; it never goes on without one while
/// believing itself fenced.
fn assert_fenced_call_is_refused(answer: Result<(bool, bool), LockError>) {
    match answer {
        Ok((on_guard, on_current)) => panic!(
            "a fenced call nested in an unfenced hold was granted \
             (guard has a token: {on_guard}, current() has one: {on_current})"
        ),
        Err(LockError::Config { .. }) => {}
        Err(other) => panic!("nested fenced call: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fenced_call_nested_in_an_unfenced_redis_hold_is_refused() {
    let registry = registry_at(&url()).await;
    let key = unique_key("nested-fenced-in-unfenced");
    assert_fenced_call_is_refused(fenced_inside_unfenced(&registry, &key).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fenced_call_nested_in_an_unfenced_memory_hold_is_refused() {
    let registry = memory_registry();
    let key = unique_key("nested-fenced-in-unfenced-memory");
    assert_fenced_call_is_refused(fenced_inside_unfenced(&registry, &key).await);
}

/// `fencing(false)` nested in a fenced hold shares the outer hold, and its
/// token, on the guard and on `current()`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unfenced_call_nested_in_a_fenced_redis_hold_sees_the_outer_token() {
    let registry = registry_at(&url()).await;
    let key = unique_key("nested-unfenced-in-fenced");
    let (on_guard, on_current) = unfenced_inside_fenced(&registry, &key).await;
    assert!(
        on_guard && on_current,
        "fencing(false) nested in a fenced hold shares the outer token \
         (guard: {on_guard}, current(): {on_current})"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unfenced_call_nested_in_a_fenced_memory_hold_sees_the_outer_token() {
    let registry = memory_registry();
    let key = unique_key("nested-unfenced-in-fenced-memory");
    let (on_guard, on_current) = unfenced_inside_fenced(&registry, &key).await;
    assert!(
        on_guard && on_current,
        "fencing(false) nested in a fenced hold shares the outer token \
         (guard: {on_guard}, current(): {on_current})"
    );
}

/// The global registry of this test binary: the shared Redis, fenced.
async fn global() -> &'static Registry {
    static INIT: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();
    INIT.get_or_init(|| async {
        dlock_runtime::init(registry_at(&url()).await).expect("first init");
    })
    .await;
    dlock_runtime::global().expect("installed above")
}

#[distributed_lock(key = "{key}", fencing = false, watchdog = false, on_busy = "skip")]
async fn unfenced_skip(key: &str) -> Option<bool> {
    Some(current().and_then(|c| c.fencing_token()).is_some())
}

/// `fencing = false` with `watchdog = false` and `on_busy = "skip"`: the
/// body runs without a token when the key is free, is skipped while a fenced
/// hold has it, and leaves no key behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_attribute_unfenced_without_watchdog_skips_when_busy() {
    let registry = global().await;
    let key = unique_key("attr-unfenced-skip");
    assert_eq!(
        unfenced_skip(&key).await,
        Some(false),
        "ran without a token"
    );
    let holder = registry.lock(&key).acquire().await.expect("fenced holder");
    assert_eq!(unfenced_skip(&key).await, None, "skipped while held");
    holder.release().await.expect("release");
    assert_eq!(unfenced_skip(&key).await, Some(false), "runs again");
    let stored = hash_tagged(&format!("{}{key}", registry.key_prefix()));
    let left: bool = admin(&url()).await.exists(&stored).await.expect("EXISTS");
    assert!(!left, "the attribute's hold left its key");
}

/// An unfenced grant that two replicas cannot acknowledge (one exists) is
/// undone: the acquisition fails and no key is left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unacknowledged_unfenced_grant_is_undone() {
    let registry = registry_at(&with_option(
        &primary_url(),
        "replicas=2&timeout=400ms&fencing=off",
    ))
    .await;
    let key = unique_key("unfenced-unacknowledged");
    let Err(err) = registry.lock(&key).acquire().await else {
        panic!("one replica cannot acknowledge for two")
    };
    assert!(
        matches!(err, LockError::Backend { .. }),
        "the acknowledgement error: {err:?}"
    );
    let stored = hash_tagged(&format!("{}{key}", registry.key_prefix()));
    let left: bool = admin(&primary_url())
        .await
        .exists(&stored)
        .await
        .expect("EXISTS");
    assert!(
        !left,
        "the unacknowledged unfenced grant is still on the primary"
    );
}

/// Polls until `stored` is gone from `conn`, for up to `within`.
async fn gone_within(
    conn: &mut redis::aio::MultiplexedConnection,
    stored: &str,
    within: Duration,
) -> Result<(), (String, i64)> {
    let deadline = Instant::now() + within;
    loop {
        let value: Option<String> = conn.get(stored).await.expect("GET");
        let Some(value) = value else { return Ok(()) };
        if Instant::now() > deadline {
            let ttl: i64 = conn.pttl(stored).await.expect("PTTL");
            return Err((value, ttl));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The unfenced `SET … NX PX … GET` of an acquisition reaches the server
/// only after the client's command timeout (held back by a proxy on its
/// connection): with `wait = 0` the acquisition fails, and the key the late
/// `SET` takes is released (owner-checked) rather than left for its lease;
/// with a `wait`, the acquisition's retry finds its own key and holds it,
/// and its release leaves nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unfenced_set_that_arrives_after_the_timeout_leaves_no_key() {
    let server = OwnRedis::start(47311, &[]).await;
    let proxy = FaultProxy::to_port(server.port()).await.expect("proxy");
    let registry = registry_at(&format!(
        "redis://127.0.0.1:{}/?timeout=300ms&fencing=off",
        proxy.port()
    ))
    .await;
    let mut admin = server.admin().await;
    // Warm-up: the release channel and the scripts.
    let warm = registry.lock("warm-up").acquire().await.expect("warm-up");
    warm.release().await.expect("warm-up release");

    for (round, wait) in [Duration::ZERO, Duration::from_secs(3)]
        .into_iter()
        .enumerate()
    {
        let key = unique_key(&format!("late-set-{round}"));
        let stored = hash_tagged(&format!("{}{key}", registry.key_prefix()));
        proxy.hold_next(
            &[stored.as_bytes(), b"$3\r\nSET\r\n"],
            Duration::from_millis(800),
        );
        let answer = registry
            .lock(&key)
            .lease(Duration::from_secs(30))
            .wait(wait)
            .acquire()
            .await;
        assert!(
            proxy.held_on().is_some(),
            "round {round}: the SET was not held"
        );
        match answer {
            Ok(guard) => {
                assert!(!wait.is_zero(), "round {round}: granted without a wait");
                assert_eq!(guard.fencing_token(), None);
                guard.release().await.expect("release");
            }
            Err(err) => assert!(
                wait.is_zero(),
                "round {round}: the retry did not take its own key: {err:?}"
            ),
        }
        if let Err((value, ttl)) = gone_within(&mut admin, &stored, Duration::from_secs(3)).await {
            panic!("round {round} (wait {wait:?}): key left, owner {value}, PTTL {ttl} ms");
        }
    }
}

/// A fenced holder's release wakes an unfenced waiter at once, and an
/// unfenced holder's release a fenced waiter (each on its own connections):
/// not the 30 s lease running out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn releases_wake_waiters_of_the_other_kind() {
    let fenced = registry_at(&url()).await;
    let unfenced = registry_at(&with_option(&url(), "fencing=off")).await;
    for (holder, waiter, name) in [
        (&fenced, &unfenced, "fenced-to-unfenced"),
        (&unfenced, &fenced, "unfenced-to-fenced"),
    ] {
        let handoffs = dlock_tests::handoff::measure(
            holder,
            waiter,
            &unique_key(name),
            5,
            Duration::from_millis(100),
        )
        .await;
        assert!(
            handoffs.median() < Duration::from_secs(1),
            "{name}: median handoff {:?} (all: {handoffs:?})",
            handoffs.median()
        );
    }
}

fn sentinel_url() -> String {
    server_url(
        "DLOCK_TEST_REDIS_SENTINEL_URL",
        "redis+sentinel://127.0.0.1:46411,127.0.0.1:46412,127.0.0.1:46413/dlock",
    )
}

/// The primary the first answering sentinel names.
async fn sentinel_primary() -> redis::aio::MultiplexedConnection {
    let url = sentinel_url();
    let (_, rest) = url.split_once("://").expect("a sentinel URL");
    let (hosts, name) = rest.split_once('/').expect("a primary name");
    let name = name.split('?').next().unwrap_or(name);
    for host in hosts.split(',') {
        let Ok(mut sentinel) = admin_maybe(&format!("redis://{host}/")).await else {
            continue;
        };
        let addr: Option<(String, u16)> = redis::cmd("SENTINEL")
            .arg("GET-MASTER-ADDR-BY-NAME")
            .arg(name)
            .query_async(&mut sentinel)
            .await
            .ok()
            .flatten();
        if let Some((ip, port)) = addr {
            return admin(&format!("redis://{ip}:{port}/")).await;
        }
    }
    servers_missing(&url, "no sentinel names the primary")
}

async fn admin_maybe(url: &str) -> redis::RedisResult<redis::aio::MultiplexedConnection> {
    redis::Client::open(url)?
        .get_multiplexed_async_connection()
        .await
}

/// Behind Sentinel, `?fencing=off` (also with `?replicas=1`): no token, a
/// fenced holder of another process excludes it and the reverse, and the
/// release leaves no key on the primary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unfenced_holds_behind_sentinel_exclude_fenced_ones_and_leave_no_key() {
    let fenced = registry_at(&sentinel_url()).await;
    let mut primary = sentinel_primary().await;
    for option in ["fencing=off", "fencing=off&replicas=1"] {
        let unfenced = registry_at(&with_option(&sentinel_url(), option)).await;
        let key = unique_key("sentinel-unfenced");
        let stored = hash_tagged(&format!("{}{key}", unfenced.key_prefix()));
        let guard = unfenced.lock(&key).acquire().await.expect(option);
        assert_eq!(guard.fencing_token(), None, "{option}");
        assert!(
            matches!(
                fenced.lock(&key).acquire().await,
                Err(LockError::Busy { .. })
            ),
            "{option}: a fenced holder got in beside the unfenced one"
        );
        guard.release().await.expect("release");
        let left: bool = primary.exists(&stored).await.expect("EXISTS");
        assert!(!left, "{option}: the unfenced release left its key");
        let guard = fenced.lock(&key).acquire().await.expect("fenced");
        assert!(
            matches!(
                unfenced.lock(&key).acquire().await,
                Err(LockError::Busy { .. })
            ),
            "{option}: an unfenced holder got in beside the fenced one"
        );
        guard.release().await.expect("release fenced");
    }
}

/// An acquisition's first grant command (`option` on the URL; held back by
/// `needle` on its connection) reaches the server only after the command
/// timeout; the retry, on whichever connection the backend picks then, takes
/// the key and the holder releases it. When the first command finally
/// arrives it must not take the key again for its 30 s lease with nobody
/// holding it.
async fn a_late_first_grant_after_a_release(port: u16, option: &str, needle: &[u8]) {
    let server = OwnRedis::start(port, &[]).await;
    let proxy = FaultProxy::to_port(server.port()).await.expect("proxy");
    let mut admin = server.admin().await;
    for round in 0..3 {
        // A backend of its own each round: the first command goes over the
        // home connection while the caller's own one opens.
        let registry = registry_at(&format!(
            "redis://127.0.0.1:{}/?timeout=300ms&{option}",
            proxy.port()
        ))
        .await;
        let key = unique_key(&format!("late-first-grant-{round}"));
        let stored = hash_tagged(&format!("{}{key}", registry.key_prefix()));
        proxy.hold_next(&[stored.as_bytes(), needle], Duration::from_millis(1500));
        let guard = registry
            .lock(&key)
            .lease(Duration::from_secs(30))
            .wait(Duration::from_secs(5))
            .acquire()
            .await
            .expect("the retry takes the key");
        assert!(
            proxy.held_on().is_some(),
            "{option} round {round}: the grant was not held"
        );
        guard.release().await.expect("release");
        // Past the held command's arrival (and the runtime's 3 s backstop).
        let until = Instant::now() + Duration::from_secs(4);
        while Instant::now() < until {
            let value: Option<String> = admin.get(&stored).await.expect("GET");
            if let Some(value) = value {
                let ttl: i64 = admin.pttl(&stored).await.expect("PTTL");
                panic!(
                    "{option} round {round}: the key came back after its release, \
                     owner {value}, PTTL {ttl} ms"
                );
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_first_unfenced_set_does_not_retake_a_key_released_after_its_retry() {
    a_late_first_grant_after_a_release(47312, "fencing=off", b"$3\r\nSET\r\n").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_first_fenced_grant_does_not_retake_a_key_released_after_its_retry() {
    a_late_first_grant_after_a_release(47313, "fencing=on", b"EVAL").await;
}

/// SQLite: `fencing(false)` drops the token of a hold of its own; nested in
/// a fenced hold it shares the outer token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unfenced_sqlite_hold_has_no_token_and_nested_shares_the_outer_one() {
    let dir = tempfile::tempdir().expect("a directory");
    let url = format!("sqlite://{}", dir.path().join("locks.db").display());
    let registry = Registry::builder()
        .default_backend(
            dlock_runtime::SqliteBackend::connect(&url)
                .await
                .expect("open sqlite"),
        )
        .build();
    let key = unique_key("sqlite-unfenced");
    let alone = registry
        .lock(&key)
        .fencing(false)
        .acquire()
        .await
        .expect("alone");
    let on_current = alone
        .scope(async { current().and_then(|c| c.fencing_token()) })
        .await;
    assert_eq!((alone.fencing_token(), on_current), (None, None));
    alone.release().await.expect("release");
    let (on_guard, on_current) = unfenced_inside_fenced(&registry, &key).await;
    assert!(
        on_guard && on_current,
        "fencing(false) nested in a fenced hold shares the outer token \
         (guard: {on_guard}, current(): {on_current})"
    );
}

/// An unfenced acquisition whose first `SET` is held back on the wire (it
/// reaches the server 1.5 s later) is dropped by its caller — while that
/// `SET` waits, or after it timed out and the acquisition tried again: no
/// key is left once the held `SET` has arrived, nor after the runtime's
/// backstop release.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unfenced_acquisition_dropped_while_its_set_is_held_leaves_no_key() {
    let server = OwnRedis::start(47314, &[]).await;
    let proxy = FaultProxy::to_port(server.port()).await.expect("proxy");
    let mut admin = server.admin().await;
    for (round, drop_after) in [100u64, 450, 900].into_iter().enumerate() {
        let registry = registry_at(&format!(
            "redis://127.0.0.1:{}/?timeout=300ms&fencing=off",
            proxy.port()
        ))
        .await;
        let key = unique_key(&format!("dropped-held-set-{round}"));
        let stored = hash_tagged(&format!("{}{key}", registry.key_prefix()));
        proxy.hold_next(
            &[stored.as_bytes(), b"$3\r\nSET\r\n"],
            Duration::from_millis(1500),
        );
        let answer = tokio::time::timeout(
            Duration::from_millis(drop_after),
            registry
                .lock(&key)
                .lease(Duration::from_secs(30))
                .wait(Duration::from_secs(5))
                .acquire(),
        )
        .await;
        if let Ok(answer) = answer {
            answer.expect("acquire").release().await.expect("release");
        }
        let until = Instant::now() + Duration::from_millis(4500);
        let mut last = None;
        while Instant::now() < until {
            let value: Option<String> = admin.get(&stored).await.expect("GET");
            last = value.map(|v| (v, Instant::now()));
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        if let Some((owner, _)) = last {
            let ttl: i64 = admin.pttl(&stored).await.expect("PTTL");
            panic!(
                "dropped after {drop_after} ms: key left 4.5 s later, owner {owner}, PTTL {ttl} ms"
            );
        }
    }
}

/// A retry finds its own key (an earlier attempt's grant) with little TTL
/// left, and the key expires before the extension reaches the server (held
/// back on the wire): nobody holds the key then, so the attempt takes it or
/// answers busy only for a moment — never busy for the stale TTL of a key
/// that is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_whose_own_key_expires_before_the_extension_is_not_busy_on_a_free_key() {
    use dlock_runtime::backend::{AcquireRequest, Attempt, LockBackend};
    let server = OwnRedis::start(47315, &[]).await;
    let proxy = FaultProxy::to_port(server.port()).await.expect("proxy");
    let mut admin = server.admin().await;
    let backend = connect(&format!(
        "redis://127.0.0.1:{}/?timeout=3s&fencing=off",
        proxy.port()
    ))
    .await;
    let key = unique_key("own-key-expiring");
    let stored = hash_tagged(&key);
    // Loads the scripts (the extension is a script call).
    let warm = AcquireRequest::new(&key, "warm-up", Duration::from_secs(1));
    let Attempt::Held(lease) = backend.try_acquire(&warm).await.expect("warm-up") else {
        panic!("warm-up")
    };
    backend.release(&lease).await.expect("warm-up release");
    // The earlier attempt's grant, 600 ms left.
    let () = redis::cmd("SET")
        .arg(&stored)
        .arg("retrying-owner")
        .arg("PX")
        .arg(600)
        .query_async(&mut admin)
        .await
        .expect("SET");
    proxy.hold_next(&[stored.as_bytes(), b"EVAL"], Duration::from_millis(900));
    let retry = AcquireRequest::new(&key, "retrying-owner", Duration::from_secs(20));
    let answer = backend.try_acquire(&retry).await.expect("retry");
    let free: bool = !admin.exists::<_, bool>(&stored).await.expect("EXISTS");
    eprintln!("the retry answered {answer:?} (key free now: {free})");
    assert!(proxy.held_on().is_some(), "the extension was not held");
    match answer {
        Attempt::Held(lease) => {
            backend.release(&lease).await.expect("release");
        }
        Attempt::Busy { retry_in } => assert!(
            retry_in.is_some_and(|r| r <= Duration::from_millis(50)),
            "busy for {retry_in:?} on a key that is free (free now: {free})"
        ),
        other => panic!("{other:?}"),
    }
}
