//! The read-write lock cases (`read()` / `write()`, a plain lock being the
//! write mode), run by every backend that offers read mode. Each takes the
//! [`Harness`] of the backend under test.
// A case left off the list at the end is unused: dead code fails the build.
#![deny(dead_code)]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use dlock_runtime::{LockError, LockGuard, lock};

use crate::{Harness, unique_key};

const SECOND: Duration = Duration::from_secs(1);

/// Reads `key`, trying once, with a 30 s lease.
async fn read_now(key: &str) -> Result<LockGuard, LockError> {
    lock(key).read().lease(30 * SECOND).acquire().await
}

/// Writes `key`, trying once, with a 30 s lease.
async fn write_now(key: &str) -> Result<LockGuard, LockError> {
    lock(key).write().lease(30 * SECOND).acquire().await
}

fn is_busy<T>(r: &Result<T, LockError>) -> bool {
    matches!(r, Err(LockError::Busy { .. }))
}

/// Many readers hold the key at once.
async fn many_readers_hold_at_once(_h: &Harness) {
    let key = unique_key("rw-readers");
    let mut readers = Vec::new();
    for _ in 0..8 {
        readers.push(read_now(&key).await.expect("a reader beside readers"));
    }
    for reader in readers {
        assert_eq!(reader.permit(), None);
        reader.release().await.expect("release");
    }
}

/// A writer excludes readers, writers and plain locks.
async fn a_writer_excludes_readers_and_writers(h: &Harness) {
    let key = unique_key("rw-writer");
    let writer = write_now(&key).await.expect("write");
    assert!(is_busy(&read_now(&key).await), "a reader beside a writer");
    assert!(is_busy(&write_now(&key).await), "two writers");
    assert!(
        is_busy(&lock(&key).acquire().await),
        "a plain lock beside a writer"
    );
    writer.release().await.expect("release");
    assert!(!h.faults.is_held(&h.stored(&key)).await);
    read_now(&key)
        .await
        .expect("a reader once the writer left")
        .release()
        .await
        .expect("release");
}

/// A plain lock is the write mode: it excludes readers, and readers exclude it.
async fn a_plain_lock_is_the_write_mode(_h: &Harness) {
    let key = unique_key("rw-plain");
    let plain = lock(&key)
        .lease(30 * SECOND)
        .acquire()
        .await
        .expect("plain");
    assert!(
        is_busy(&read_now(&key).await),
        "a reader beside a plain lock"
    );
    plain.release().await.expect("release");
    let reader = read_now(&key).await.expect("read");
    let plain = lock(&key).acquire().await;
    assert!(is_busy(&plain), "a plain lock beside a reader: {plain:?}");
    reader.release().await.expect("release");
}

/// Writers are preferred: while a writer waits behind readers, a new
/// reader waits too, and gets the key only after the writer.
async fn a_waiting_writer_holds_new_readers_back(_h: &Harness) {
    let key = unique_key("rw-preference");
    let first = read_now(&key).await.expect("read");
    let order = Arc::new(AtomicUsize::new(0));
    let writer = tokio::spawn({
        let (key, order) = (key.clone(), order.clone());
        async move {
            let guard = lock(&key)
                .write()
                .wait(20 * SECOND)
                .lease(30 * SECOND)
                .acquire()
                .await
                .expect("the writer gets the key");
            let turn = order.fetch_add(1, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(200)).await;
            guard.release().await.expect("release");
            turn
        }
    });
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(!writer.is_finished(), "the writer waits behind the reader");
    assert!(
        is_busy(&read_now(&key).await),
        "a new reader entered while a writer waited"
    );
    let reader = tokio::spawn({
        let (key, order) = (key.clone(), order.clone());
        async move {
            let guard = lock(&key)
                .read()
                .wait(20 * SECOND)
                .lease(30 * SECOND)
                .acquire()
                .await
                .expect("the reader gets the key after the writer");
            let turn = order.fetch_add(1, Ordering::SeqCst);
            guard.release().await.expect("release");
            turn
        }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !reader.is_finished(),
        "the new reader waits behind the writer"
    );
    first.release().await.expect("release");
    let writer_turn = writer.await.expect("task");
    let reader_turn = reader.await.expect("task");
    assert_eq!(
        (writer_turn, reader_turn),
        (0, 1),
        "the waiting writer went first"
    );
}

/// Readers and writers take their tokens from one sequence: a holder
/// granted after another finished has the larger token.
async fn readers_and_writers_share_one_token_sequence(h: &Harness) {
    if !h.fences {
        return;
    }
    let key = unique_key("rw-tokens");
    let mut last = None;
    for write in [true, false, false, true, false, true] {
        let guard = if write {
            write_now(&key).await
        } else {
            read_now(&key).await
        }
        .expect("acquire");
        let token = guard.fencing_token().expect("token");
        if let Some(last) = last {
            assert!(
                token > last,
                "{} token {token:?} after {last:?}",
                if write { "write" } else { "read" }
            );
        }
        last = Some(token);
        guard.release().await.expect("release");
    }
}

/// In one call chain, a read inside a write and a read inside a read of
/// the same key enter at once, also while a writer waits.
async fn read_inside_write_and_read_inside_read_enter_at_once(_h: &Harness) {
    let key = unique_key("rw-nested");
    let writer = write_now(&key).await.expect("write");
    writer
        .scope(async {
            let inner = lock(&key)
                .read()
                .acquire()
                .await
                .expect("read inside write");
            assert_eq!(inner.fencing_token(), writer.fencing_token());
            inner.release().await.expect("release");
        })
        .await;
    writer.release().await.expect("release");

    let reader = read_now(&key).await.expect("read");
    let waiting = tokio::spawn({
        let key = key.clone();
        async move {
            lock(&key)
                .write()
                .wait(20 * SECOND)
                .lease(30 * SECOND)
                .acquire()
                .await
                .expect("the writer after the reader")
                .release()
                .await
                .expect("release");
        }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiting.is_finished(), "the writer waits");
    reader
        .scope(async {
            let inner = lock(&key)
                .read()
                .acquire()
                .await
                .expect("read inside read while a writer waits");
            inner.release().await.expect("release");
        })
        .await;
    reader.release().await.expect("release");
    tokio::time::timeout(10 * SECOND, waiting)
        .await
        .expect("the writer entered after the reader")
        .expect("task");
}

/// A write (or a plain lock) inside a read of the same key is a `Config`
/// error at once, never a wait for itself.
async fn write_inside_read_is_a_config_error_at_once(_h: &Harness) {
    let key = unique_key("rw-write-in-read");
    let reader = read_now(&key).await.expect("read");
    reader
        .scope(async {
            for plain in [false, true] {
                let started = Instant::now();
                let builder = if plain {
                    lock(&key)
                } else {
                    lock(&key).write()
                };
                let answer = builder.wait(10 * SECOND).acquire().await;
                assert!(
                    matches!(answer, Err(LockError::Config { .. })),
                    "write inside read: {answer:?}"
                );
                assert!(started.elapsed() < 5 * SECOND, "the error was not at once");
            }
        })
        .await;
    reader.release().await.expect("release");
}

/// A waiting writer that gives up — dropped while it waits, or out of its
/// wait budget — leaves no mark: new readers enter at once afterwards.
async fn a_cancelled_waiting_writer_leaves_no_mark(_h: &Harness) {
    let key = unique_key("rw-cancelled-writer");
    let reader = read_now(&key).await.expect("read");
    let dropped = tokio::time::timeout(
        Duration::from_millis(400),
        lock(&key)
            .write()
            .wait(60 * SECOND)
            .lease(30 * SECOND)
            .acquire(),
    )
    .await;
    assert!(dropped.is_err(), "the writer waited behind the reader");
    readers_enter_soon(&key, "a dropped waiting writer").await;

    let gave_up = lock(&key)
        .write()
        .wait(Duration::from_millis(400))
        .lease(30 * SECOND)
        .acquire()
        .await;
    assert!(is_busy(&gave_up), "the writer ran out of wait: {gave_up:?}");
    readers_enter_soon(&key, "a writer out of wait").await;
    reader.release().await.expect("release");
}

/// A new reader of `key` enters within 3 s (a writer's mark lasts as long
/// as its 30 s lease, so a left-over mark would hold it back).
async fn readers_enter_soon(key: &str, after: &str) {
    let until = Instant::now() + 3 * SECOND;
    loop {
        match read_now(key).await {
            Ok(guard) => {
                guard.release().await.expect("release");
                return;
            }
            Err(LockError::Busy { .. }) if Instant::now() < until => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("after {after}, a new reader is still held back: {e:?}"),
        }
    }
}

/// A read hold taken away on the server reaches its holder as a loss.
async fn a_lost_read_hold_reaches_its_holder(h: &Harness) {
    let key = unique_key("rw-lost");
    let guard = lock(&key)
        .read()
        .lease(Duration::from_millis(900))
        .acquire()
        .await
        .expect("read");
    let body = guard.scope(async {
        let current = dlock_runtime::current().expect("inside");
        tokio::time::timeout(Duration::from_millis(2500), current.lost())
            .await
            .is_ok()
    });
    let revoke = async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        h.faults.revoke(&h.stored(&key)).await;
    };
    let (noticed, ()) = tokio::join!(body, revoke);
    assert!(noticed, "the loss did not reach the body");
    assert!(matches!(guard.release().await, Err(LockError::Lost { .. })));
}

/// `inspect` shows each reader as a reader, and a writer as not one.
async fn inspect_shows_readers_as_readers(h: &Harness) {
    let key = unique_key("rw-inspect");
    let a = read_now(&key).await.expect("read");
    let b = read_now(&key).await.expect("read");
    let info = h
        .registry()
        .inspect(&key)
        .await
        .expect("inspect")
        .expect("a read key is shown");
    assert_eq!(info.holders().len(), 2, "{info:?}");
    for holder in info.holders() {
        assert!(holder.is_reader(), "{holder:?}");
        assert_eq!(holder.slot(), None);
    }
    a.release().await.expect("release");
    b.release().await.expect("release");
    let writer = write_now(&key).await.expect("write");
    let info = h
        .registry()
        .inspect(&key)
        .await
        .expect("inspect")
        .expect("a written key is shown");
    let [holder] = info.holders() else {
        panic!("one writer expected: {info:?}");
    };
    assert!(!holder.is_reader(), "{holder:?}");
    writer.release().await.expect("release");
}

crate::suite!(
    rw_suite,
    rw_locks,
    &crate::Harness,
    "`$harness().await` (an `async fn() -> &'static Harness`)";
    many_readers_hold_at_once,
    a_writer_excludes_readers_and_writers,
    a_plain_lock_is_the_write_mode,
    a_waiting_writer_holds_new_readers_back,
    readers_and_writers_share_one_token_sequence,
    read_inside_write_and_read_inside_read_enter_at_once,
    write_inside_read_is_a_config_error_at_once,
    a_cancelled_waiting_writer_leaves_no_mark,
    a_lost_read_hold_reaches_its_holder,
    inspect_shows_readers_as_readers,
);
