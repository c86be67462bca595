//! Read-write locks and semaphores on ZooKeeper: Curator's node names,
//! readers sharing and writers preferred, at most N permit holders on
//! distinct slots, mode mismatches refused, cancellation that leaves no
//! node, and what an operator sees and revokes.
#![cfg(feature = "zookeeper")]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use dlock_runtime::{HoldMode, LockBackend, LockError, Registry, ZooKeeperBackend};
use dlock_tests::zk_support::{ProxiedZk, admin, children, url};
use dlock_tests::{servers_missing, unique_key};

async fn backend() -> ZooKeeperBackend {
    let url = url();
    ZooKeeperBackend::connect(&url)
        .await
        .unwrap_or_else(|e| servers_missing(&url, e))
}

fn registry(backend: &ZooKeeperBackend) -> Registry {
    Registry::builder().default_backend(backend.clone()).build()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_share_in_curators_read_names_and_exclude_plain_locks() {
    let zk = backend().await;
    let locks = registry(&zk);
    let key = unique_key("zk-readers-share");
    let first = locks.lock(&key).read().acquire().await.expect("reader 1");
    let second = locks.lock(&key).read().acquire().await.expect("reader 2");
    assert_ne!(first.fencing_token(), second.fencing_token());
    let admin = admin(&url()).await;
    let container = zk.container_path(&format!("dlock:{key}"));
    let kids = children(&admin, &container).await;
    assert_eq!(kids.len(), 2, "{kids:?}");
    assert!(
        kids.iter()
            .all(|k| k.starts_with("_c_") && k.contains("-__READ__")),
        "{kids:?}"
    );
    let busy = locks.lock(&key).acquire().await;
    assert!(matches!(busy, Err(LockError::Busy { .. })), "{busy:?}");
    let writer = locks.lock(&key).write().acquire().await;
    assert!(matches!(writer, Err(LockError::Busy { .. })), "{writer:?}");
    first.release().await.expect("release 1");
    second.release().await.expect("release 2");
    let plain = locks
        .lock(&key)
        .acquire()
        .await
        .expect("plain lock after the readers");
    let reader = locks.lock(&key).read().acquire().await;
    assert!(matches!(reader, Err(LockError::Busy { .. })), "{reader:?}");
    plain.release().await.expect("release");
    assert!(children(&admin, &container).await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_writer_holds_new_readers_back_and_gets_the_larger_token() {
    let zk = backend().await;
    let locks = registry(&zk);
    let key = unique_key("zk-writer-preferred");
    let reader = locks.lock(&key).read().acquire().await.expect("reader");
    let reader_token = reader.fencing_token().expect("token");
    let writer = {
        let (locks, key) = (locks.clone(), key.clone());
        tokio::spawn(async move {
            locks
                .lock(&key)
                .wait(Duration::from_secs(20))
                .acquire()
                .await
        })
    };
    // The writer queues behind the reader.
    let admin = admin(&url()).await;
    let container = zk.container_path(&format!("dlock:{key}"));
    for _ in 0..200 {
        if children(&admin, &container).await.len() == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(children(&admin, &container).await.len(), 2);
    let late = locks.lock(&key).read().acquire().await;
    assert!(matches!(late, Err(LockError::Busy { .. })), "{late:?}");
    reader.release().await.expect("release the reader");
    let writer = writer.await.expect("task").expect("the writer is granted");
    let writer_token = writer.fencing_token().expect("token");
    assert!(writer_token > reader_token);
    writer.release().await.expect("release the writer");
    let after = locks
        .lock(&key)
        .read()
        .acquire()
        .await
        .expect("reader after");
    assert!(after.fencing_token().expect("token") > writer_token);
    after.release().await.expect("release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permit_holders_never_exceed_the_permits_and_take_distinct_slots() {
    let zk = backend().await;
    let locks = registry(&zk);
    let key = unique_key("zk-permits");
    let holding = Arc::new(std::sync::Mutex::new(Vec::<u32>::new()));
    let most = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..6 {
        let (locks, key, holding, most) =
            (locks.clone(), key.clone(), holding.clone(), most.clone());
        tasks.push(tokio::spawn(async move {
            for _ in 0..4 {
                let guard = locks
                    .lock(&key)
                    .permits(3)
                    .wait(Duration::from_secs(30))
                    .acquire()
                    .await
                    .expect("a permit");
                let slot = guard.permit().expect("a slot");
                assert!(slot < 3, "slot {slot}");
                {
                    let mut now = holding.lock().unwrap();
                    assert!(!now.contains(&slot), "slot {slot} held twice: {now:?}");
                    now.push(slot);
                    most.fetch_max(now.len(), Ordering::SeqCst);
                    assert!(now.len() <= 3, "{now:?}");
                }
                tokio::time::sleep(Duration::from_millis(30)).await;
                holding.lock().unwrap().retain(|s| *s != slot);
                guard.release().await.expect("release");
            }
        }));
    }
    for task in tasks {
        task.await.expect("task");
    }
    assert!(
        most.load(Ordering::SeqCst) >= 2,
        "the permits were never shared"
    );
    let admin = admin(&url()).await;
    let leases = format!("{}/leases", zk.container_path(&format!("dlock:{key}")));
    assert!(children(&admin, &leases).await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn modes_and_permit_counts_that_disagree_are_refused_while_held() {
    let zk = backend().await;
    let locks = registry(&zk);
    let key = unique_key("zk-mismatch");
    let permit = locks.lock(&key).permits(3).acquire().await.expect("permit");
    for attempt in [
        locks.lock(&key).permits(4).acquire().await,
        locks.lock(&key).acquire().await,
        locks.lock(&key).read().acquire().await,
    ] {
        assert!(
            matches!(attempt, Err(LockError::Config { .. })),
            "{attempt:?}"
        );
    }
    let admin = admin(&url()).await;
    let container = zk.container_path(&format!("dlock:{key}"));
    assert_eq!(
        children(&admin, &format!("{container}/leases")).await.len(),
        1
    );
    assert!(
        children(&admin, &container)
            .await
            .iter()
            .all(|k| k == "leases"),
        "a refused lock node stayed"
    );
    permit.release().await.expect("release");
    let reader = locks
        .lock(&key)
        .read()
        .acquire()
        .await
        .expect("any mode once free");
    let refused = locks.lock(&key).permits(3).acquire().await;
    assert!(
        matches!(refused, Err(LockError::Config { .. })),
        "{refused:?}"
    );
    assert!(
        children(&admin, &format!("{container}/leases"))
            .await
            .is_empty()
    );
    reader.release().await.expect("release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_permit_wait_leaves_no_lease() {
    let zk = backend().await;
    let locks = registry(&zk);
    let key = unique_key("zk-permit-cancel");
    let a = locks
        .lock(&key)
        .permits(2)
        .acquire()
        .await
        .expect("permit 1");
    let b = locks
        .lock(&key)
        .permits(2)
        .acquire()
        .await
        .expect("permit 2");
    assert_ne!(a.permit(), b.permit());
    let waiting = locks
        .lock(&key)
        .permits(2)
        .wait(Duration::from_secs(30))
        .acquire();
    let dropped = tokio::time::timeout(Duration::from_millis(300), waiting).await;
    assert!(dropped.is_err(), "the third permit was granted");
    let admin = admin(&url()).await;
    let leases = format!("{}/leases", zk.container_path(&format!("dlock:{key}")));
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(children(&admin, &leases).await.len(), 2);
    let slot = a.permit();
    a.release().await.expect("release");
    let c = locks
        .lock(&key)
        .permits(2)
        .wait(Duration::from_secs(5))
        .acquire()
        .await
        .expect("the freed permit");
    assert_eq!(c.permit(), slot, "the lowest free slot");
    b.release().await.expect("release");
    c.release().await.expect("release");
    assert!(children(&admin, &leases).await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_shows_each_reader_and_permit_and_revoke_removes_them_all() {
    let zk = backend().await;
    let locks = registry(&zk);
    let readers = unique_key("zk-inspect-readers");
    let r1 = locks.lock(&readers).read().acquire().await.expect("reader");
    let r2 = locks.lock(&readers).read().acquire().await.expect("reader");
    let entry = zk
        .inspect(&format!("dlock:{readers}"))
        .await
        .expect("inspect")
        .expect("held");
    assert_eq!(entry.holders.len(), 2);
    assert!(entry.holders.iter().all(|h| h.mode == HoldMode::Shared));
    let revoked = zk
        .revoke(&format!("dlock:{readers}"))
        .await
        .expect("revoke");
    assert_eq!(revoked.len(), 2);
    assert!(
        zk.inspect(&format!("dlock:{readers}"))
            .await
            .expect("inspect")
            .is_none()
    );
    drop((r1, r2));

    let sem = unique_key("zk-inspect-permits");
    let p1 = locks.lock(&sem).permits(3).acquire().await.expect("permit");
    let p2 = locks.lock(&sem).permits(3).acquire().await.expect("permit");
    let entry = zk
        .inspect(&format!("dlock:{sem}"))
        .await
        .expect("inspect")
        .expect("held");
    assert_eq!(entry.holders.len(), 2);
    let mut slots: Vec<Option<u32>> = entry.holders.iter().map(|h| h.slot).collect();
    slots.sort();
    assert_eq!(slots, [Some(0), Some(1)]);
    assert!(
        entry
            .holders
            .iter()
            .all(|h| h.mode == HoldMode::Permit { permits: 3 })
    );
    let revoked = zk.revoke(&format!("dlock:{sem}")).await.expect("revoke");
    assert_eq!(revoked.len(), 2);
    assert!(
        zk.inspect(&format!("dlock:{sem}"))
            .await
            .expect("inspect")
            .is_none()
    );
    drop((p1, p2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ended_session_frees_only_its_own_permits_and_readers() {
    let gone = ProxiedZk::connect().await;
    let (stays, next) = (backend().await, backend().await);
    for read in [false, true] {
        let key = unique_key(if read {
            "zk-session-reader"
        } else {
            "zk-session-permit"
        });
        let take = |zk: &ZooKeeperBackend| {
            let builder = registry(zk).lock(&key).wait(Duration::from_secs(20));
            if read {
                builder.read()
            } else {
                builder.permits(2)
            }
        };
        let lost = take(&gone.backend).acquire().await.expect("first holder");
        let kept = take(&stays).acquire().await.expect("second holder");
        if !read {
            let full = registry(&next).lock(&key).permits(2).acquire().await;
            assert!(matches!(full, Err(LockError::Busy { .. })), "{full:?}");
        }
        // Another client takes over the first holder's session and closes it.
        gone.end_session().await;
        tokio::time::timeout(Duration::from_secs(15), lost.lost())
            .await
            .expect("the first holder hears of the loss");
        let after = take(&next).acquire().await.expect("the freed share");
        if !read {
            assert_eq!(after.permit(), lost.permit(), "the freed slot");
        }
        let entry = stays
            .inspect(&format!("dlock:{key}"))
            .await
            .expect("inspect")
            .expect("held");
        assert_eq!(entry.holders.len(), 2, "{entry:?}");
        assert!(
            tokio::time::timeout(Duration::from_millis(300), kept.lost())
                .await
                .is_err(),
            "the other holder keeps its share"
        );
        drop(lost);
        kept.release().await.expect("release");
        after.release().await.expect("release");
    }
}
