//! `permits = N` and `mode = "read" | "write"` in `#[distributed_lock]`, on the
//! in-process backend: a semaphore never runs more than N bodies at once, each
//! on its own slot; readers run together; a writer (or a plain lock of the key)
//! excludes them.

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Once, OnceLock};
use std::time::Duration;

use dlock_runtime::{LockError, MemoryBackend, Registry, current, distributed_lock};
use dlock_tests::memory_support::registry;
use dlock_tests::unique_key;
use tokio::sync::{Barrier, Notify};
use tokio::task::JoinHandle;

fn global_backend() -> &'static MemoryBackend {
    static BACKEND: OnceLock<MemoryBackend> = OnceLock::new();
    BACKEND.get_or_init(MemoryBackend::new)
}

/// Installs the global registry (over [`global_backend`]) that `#[distributed_lock]` uses.
fn init() -> &'static Registry {
    static INIT: Once = Once::new();
    INIT.call_once(|| dlock_runtime::init(registry(global_backend())).expect("first init"));
    dlock_runtime::global().expect("installed above")
}

/// How many bodies run at once, the most seen, and the slots in use.
#[derive(Default)]
struct Gauge {
    inside: AtomicUsize,
    most: AtomicUsize,
    slots: Mutex<HashSet<u32>>,
    calls: AtomicUsize,
}

impl Gauge {
    fn enter(&self) {
        let now = self.inside.fetch_add(1, Ordering::SeqCst) + 1;
        self.most.fetch_max(now, Ordering::SeqCst);
        self.calls.fetch_add(1, Ordering::SeqCst);
    }

    fn leave(&self) {
        self.inside.fetch_sub(1, Ordering::SeqCst);
    }
}

#[distributed_lock(key = "provider:{name}", permits = 3, wait = "20s", lease = "10s")]
async fn call_provider(name: &str, gauge: &Gauge) -> Result<u32, LockError> {
    let lock = current().expect("the body runs in the lock's scope");
    let slot = lock
        .permit()
        .expect("a semaphore's holder has a permit slot");
    assert!(slot < 3, "slot {slot} of a 3-permit semaphore");
    assert!(
        gauge.slots.lock().unwrap().insert(slot),
        "slot {slot} handed to two holders at once"
    );
    gauge.enter();
    tokio::time::sleep(Duration::from_millis(150)).await;
    gauge.leave();
    gauge.slots.lock().unwrap().remove(&slot);
    Ok(slot)
}

/// Eight callers of a `permits = 3` function: never more than three bodies at
/// once, each on a distinct slot below 3, and all eight run.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn permits_bound_the_bodies_running_at_once() {
    init();
    let name: &'static str = Box::leak(unique_key("provider").into_boxed_str());
    let gauge = Arc::new(Gauge::default());
    let calls: Vec<_> = (0..8)
        .map(|_| {
            let gauge = Arc::clone(&gauge);
            tokio::spawn(async move { call_provider(name, &gauge).await })
        })
        .collect();
    for call in calls {
        let slot = call.await.expect("task").expect("call_provider");
        assert!(slot < 3, "slot {slot}");
    }
    assert_eq!(gauge.calls.load(Ordering::SeqCst), 8);
    assert_eq!(
        gauge.most.load(Ordering::SeqCst),
        3,
        "eight callers of a 3-permit semaphore should fill it, and never go past it"
    );
}

#[distributed_lock(key = "plain:{name}", permits = 1)]
async fn one_permit(name: &str) -> Result<Option<u32>, LockError> {
    Ok(current().expect("in scope").permit())
}

/// `permits = 1` is the plain lock: no slot.
#[tokio::test]
async fn one_permit_is_a_plain_lock() {
    init();
    let name = unique_key("one-permit");
    assert_eq!(one_permit(&name).await.expect("one_permit"), None);
}

#[distributed_lock(key = "doc:{id}", mode = "read", wait = "5s")]
async fn read_together(id: &str, readers: &Barrier) -> Result<(), LockError> {
    assert_eq!(current().expect("in scope").permit(), None);
    // Completes only once every reader is inside at the same time.
    tokio::time::timeout(Duration::from_secs(5), readers.wait())
        .await
        .expect("the readers should hold the key together");
    Ok(())
}

/// Three `mode = "read"` calls of one key are inside their bodies at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn readers_run_together() {
    init();
    let id: &'static str = Box::leak(unique_key("readers").into_boxed_str());
    let readers = Arc::new(Barrier::new(3));
    let calls: Vec<_> = (0..3)
        .map(|_| {
            let readers = Arc::clone(&readers);
            tokio::spawn(async move { read_together(id, &readers).await })
        })
        .collect();
    for call in calls {
        call.await.expect("task").expect("read_together");
    }
}

#[distributed_lock(key = "doc:{id}", mode = "read", wait = "5s")]
async fn read_until(id: &str, inside: &Notify, done: &Notify) -> Result<(), LockError> {
    inside.notify_one();
    done.notified().await;
    Ok(())
}

#[distributed_lock(key = "doc:{id}", mode = "read")]
async fn read_now(id: &str) -> Result<(), LockError> {
    Ok(())
}

#[distributed_lock(key = "doc:{id}", mode = "write")]
async fn write_now(id: &str) -> Result<(), LockError> {
    Ok(())
}

#[distributed_lock(key = "doc:{id}")]
async fn plain_now(id: &str) -> Result<(), LockError> {
    Ok(())
}

#[distributed_lock(key = "doc:{id}", mode = "write", wait = "5s")]
async fn write_until(id: &str, inside: &Notify, done: &Notify) -> Result<(), LockError> {
    inside.notify_one();
    done.notified().await;
    Ok(())
}

/// Waits until `holder` says it is inside its body; fails if it returns first
/// or takes more than 5 s.
async fn until_inside(inside: &Notify, holder: &mut JoinHandle<Result<(), LockError>>) {
    tokio::select! {
        () = inside.notified() => {}
        ended = &mut *holder => panic!("the holder returned before it got in: {ended:?}"),
        () = tokio::time::sleep(Duration::from_secs(5)) => panic!("the holder never got in"),
    }
}

/// While a reader is inside, `mode = "write"` and a plain lock of the key are
/// busy; once it has returned, both run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writer_waits_for_the_readers() {
    init();
    let id: &'static str = Box::leak(unique_key("reader-first").into_boxed_str());
    let (inside, done) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let mut reader = tokio::spawn({
        let (inside, done) = (Arc::clone(&inside), Arc::clone(&done));
        async move { read_until(id, &inside, &done).await }
    });
    until_inside(&inside, &mut reader).await;
    assert!(
        matches!(write_now(id).await, Err(LockError::Busy { .. })),
        "a writer beside a reader"
    );
    assert!(
        matches!(plain_now(id).await, Err(LockError::Busy { .. })),
        "a plain lock beside a reader"
    );
    done.notify_one();
    reader.await.expect("task").expect("read_until");
    write_now(id)
        .await
        .expect("the writer once the reader is gone");
    plain_now(id)
        .await
        .expect("the plain lock once the reader is gone");
    read_now(id)
        .await
        .expect("a reader once the writers are gone");
}

/// While `mode = "write"` is inside, readers (and a second writer) are busy;
/// once it has returned, a reader runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writer_excludes_readers() {
    init();
    let id: &'static str = Box::leak(unique_key("writer-first").into_boxed_str());
    let (inside, done) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let mut writer = tokio::spawn({
        let (inside, done) = (Arc::clone(&inside), Arc::clone(&done));
        async move { write_until(id, &inside, &done).await }
    });
    until_inside(&inside, &mut writer).await;
    assert!(
        matches!(read_now(id).await, Err(LockError::Busy { .. })),
        "a reader beside a writer"
    );
    assert!(
        matches!(write_now(id).await, Err(LockError::Busy { .. })),
        "two writers at once"
    );
    done.notify_one();
    writer.await.expect("task").expect("write_until");
    read_now(id)
        .await
        .expect("a reader once the writer is gone");
}

#[distributed_lock(key = "doc:{id}", mode = "read", wait = "20s")]
async fn gauged_read(id: &str, readers: &Gauge, writers: &Gauge) -> Result<(), LockError> {
    readers.enter();
    assert_eq!(
        writers.inside.load(Ordering::SeqCst),
        0,
        "a reader beside a writer"
    );
    tokio::time::sleep(Duration::from_millis(30)).await;
    readers.leave();
    Ok(())
}

#[distributed_lock(key = "doc:{id}", mode = "write", wait = "20s")]
async fn gauged_write(id: &str, readers: &Gauge, writers: &Gauge) -> Result<(), LockError> {
    writers.enter();
    assert_eq!(
        readers.inside.load(Ordering::SeqCst),
        0,
        "a writer beside a reader"
    );
    tokio::time::sleep(Duration::from_millis(30)).await;
    writers.leave();
    Ok(())
}

/// Readers and writers of one key called together: never a reader beside a
/// writer nor two writers at once, and every call runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn readers_and_writers_mixed() {
    init();
    let id: &'static str = Box::leak(unique_key("mixed").into_boxed_str());
    let readers = Arc::new(Gauge::default());
    let writers = Arc::new(Gauge::default());
    let calls: Vec<_> = (0..24)
        .map(|i| {
            let (readers, writers) = (Arc::clone(&readers), Arc::clone(&writers));
            tokio::spawn(async move {
                if i % 6 == 5 {
                    gauged_write(id, &readers, &writers).await
                } else {
                    gauged_read(id, &readers, &writers).await
                }
            })
        })
        .collect();
    for call in calls {
        call.await.expect("task").expect("call");
    }
    assert_eq!(readers.calls.load(Ordering::SeqCst), 20);
    assert_eq!(writers.calls.load(Ordering::SeqCst), 4);
    assert_eq!(
        writers.most.load(Ordering::SeqCst),
        1,
        "two writers at once"
    );
}
