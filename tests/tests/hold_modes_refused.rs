//! A backend that does not offer a hold mode refuses it before any attempt:
//! Redlock's semaphores and read locks are `Config` errors giving its
//! reason, while its plain locks (the write mode) work; MySQL's session mode
//! refuses read locks naming lease mode, while its semaphores and plain
//! locks work.

#[cfg(feature = "redis")]
use std::time::{Duration, Instant};

#[cfg(feature = "redis")]
use dlock_runtime::{LockError, RedlockBackend, Registry};
#[cfg(feature = "redis")]
use dlock_tests::{server_url, servers_missing, unique_key};

#[cfg(feature = "redis")]
async fn redlock() -> Registry {
    let url = server_url(
        "DLOCK_TEST_REDLOCK_URL",
        "redlock://127.0.0.1:46379,127.0.0.1:46380,127.0.0.1:46381,127.0.0.1:46382,127.0.0.1:46383",
    );
    let backend = RedlockBackend::connect(&url)
        .await
        .unwrap_or_else(|e| servers_missing(&url, e));
    Registry::builder().default_backend(backend).build()
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_refuses_semaphores_and_read_locks_with_its_reason() {
    let registry = redlock().await;
    let key = unique_key("redlock-refuses-modes");
    // Held as a plain lock: an attempt in another mode would meet it.
    let plain = registry
        .lock(&key)
        .lease(Duration::from_secs(30))
        .acquire()
        .await
        .expect("a plain lock works on Redlock");
    assert!(plain.fencing_token().is_none(), "Redlock has no safe token");
    for (what, builder) in [
        ("permits(3)", registry.lock(&key).permits(3)),
        ("read()", registry.lock(&key).read()),
        (
            "lock_all(..).permits(3)",
            registry
                .lock_all([key.clone(), format!("{key}:b")])
                .permits(3),
        ),
    ] {
        let started = Instant::now();
        let answer = builder.wait(Duration::from_secs(10)).acquire().await;
        let Err(LockError::Config { message }) = &answer else {
            panic!("{what} on Redlock: {answer:?}");
        };
        assert!(
            message.contains("Redlock does not offer")
                && message.contains("each node counts holders on its own"),
            "{what}: the reason is missing from {message:?}"
        );
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "{what}: refused after {:?}, not before any attempt",
            started.elapsed()
        );
    }
    plain.release().await.expect("release");
    let write = registry
        .lock(&key)
        .write()
        .acquire()
        .await
        .expect("the write mode is Redlock's plain lock");
    let one = registry.lock(&key).permits(1).acquire().await;
    assert!(
        matches!(one, Err(LockError::Busy { .. })),
        "permits(1) is the plain lock on Redlock too: {one:?}"
    );
    write.release().await.expect("release");
}

#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_session_mode_refuses_read_locks_naming_lease_mode() {
    use std::time::{Duration, Instant};

    use dlock_runtime::LockError;
    use dlock_tests::sql_db::SqlDb;
    use dlock_tests::sql_support::SqlMode;
    use dlock_tests::unique_key;

    let registry = SqlDb::Mysql
        .connect(SqlMode::Session.query())
        .await
        .registry();
    let key = unique_key("mysql-session-refuses-read");
    // Held by a semaphore's permit: an attempt would meet its holder.
    let permit = registry
        .lock(&key)
        .permits(2)
        .lease(Duration::from_secs(30))
        .acquire()
        .await
        .expect("MySQL's session mode offers semaphores");
    assert_eq!(permit.permit(), Some(0));
    let started = Instant::now();
    let read = registry
        .lock(&key)
        .read()
        .wait(Duration::from_secs(10))
        .acquire()
        .await;
    let Err(LockError::Config { message }) = &read else {
        panic!("read() on MySQL's session mode: {read:?}");
    };
    assert!(
        message.contains("lease mode") && message.contains("no shared mode"),
        "the reason is missing from {message:?}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "refused after {:?}, not before any attempt",
        started.elapsed()
    );
    permit.release().await.expect("release");
    let write = registry
        .lock(&key)
        .write()
        .acquire()
        .await
        .expect("the write mode is the plain lock");
    write.release().await.expect("release");
}
