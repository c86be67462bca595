//! The session suite, run on every SQL database in session mode
//! (`dlock_tests::sql_session_suite!(target)`): loss the moment the server
//! drops the holder's connection, waits the server hands over, abandoned waits
//! leaving no lock, tokens from the fence table, and a black hole then a reset
//! through a TCP proxy.
// A case left off the list at the end is unused: dead code fails the build.
#![deny(dead_code)]

use std::time::Duration;

use crate::handoff;
use crate::sql_db::SqlTarget;
use crate::sql_support::loss_cancels_the_body;
use crate::unique_key;

/// The holder's connection dropped by the server (PostgreSQL:
/// `pg_terminate_backend`; MySQL: `KILL`): the loss reaches the body
/// before the lease ends (PostgreSQL watches the idle connection, so at
/// once; MySQL at the next ping, a third of the lease), and the key is
/// free for others, with a larger token.
async fn a_dropped_connection_is_lost_before_the_lease_ends(t: SqlTarget) {
    let key = unique_key("dropped-connection");
    let before = {
        let g = t.h.registry().lock(&key).acquire().await.expect("acquire");
        let token = g.fencing_token().expect("token");
        g.release().await.expect("release");
        token
    };
    let stored = t.h.stored(&key);
    let noticed = loss_cancels_the_body(&key, async {
        let holders = t.db.session_holder_count(&stored).await;
        assert_eq!(holders, 1, "one connection holds the lock");
        t.h.faults.revoke(&stored).await;
    })
    .await;
    if let Some(bound) = t.db.connection_loss_noticed_within() {
        assert!(
            noticed < bound,
            "noticed {noticed:?} after the connection was dropped"
        );
    }
    let next =
        t.h.registry()
            .lock(&key)
            .acquire()
            .await
            .expect("free again");
    assert!(next.fencing_token().expect("token") > before);
    next.release().await.expect("release");
}

/// Waiting is server-side: the server hands the key to a waiter of
/// another backend the moment the holder unlocks. Without that push the
/// waiter would get the key at the end of its server-side wait (a third of
/// its 30 s lease); the bound leaves a loaded machine room, not a speed
/// target (the benchmarks measure handoffs).
async fn the_server_hands_the_key_to_a_waiter_of_another_backend(t: SqlTarget) {
    let holder = t.other_process("").await.registry();
    let waiter = t.other_process("").await.registry();
    let handoffs = handoff::measure(
        &holder,
        &waiter,
        &unique_key("pushed"),
        5,
        Duration::from_millis(100),
    )
    .await;
    assert!(
        handoffs.median() < Duration::from_millis(500),
        "median handoff {:?} ({handoffs:?})",
        handoffs.median()
    );
}

/// Acquisitions dropped while the server makes them wait leave no lock
/// behind: their connections are closed, never reused, and the key is
/// free at once for a try after the holder releases.
async fn abandoned_waits_leave_no_lock(t: SqlTarget) {
    let holder = t.other_process("").await.registry();
    let waiters = t.other_process("").await.registry();
    let key = unique_key("abandoned-waits");
    let guard = holder.lock(&key).acquire().await.expect("acquire");
    let tasks: Vec<_> = (0..8)
        .map(|_| {
            let (waiters, key) = (waiters.clone(), key.clone());
            tokio::spawn(async move {
                let _ = waiters
                    .lock(&key)
                    .wait(Duration::from_secs(30))
                    .acquire()
                    .await;
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    for task in &tasks {
        task.abort();
    }
    // The server notices a vanished waiter within a second (PostgreSQL:
    // `client_connection_check_interval`).
    tokio::time::sleep(Duration::from_millis(1500)).await;
    guard.release().await.expect("release");
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        !t.h.faults.is_held(&t.h.stored(&key)).await,
        "an abandoned waiter was granted the key"
    );
    let free =
        t.h.registry()
            .lock(&key)
            .acquire()
            .await
            .expect("free for a try");
    free.release().await.expect("release");
}

/// The token keeps growing when the fence row is deleted.
async fn tokens_keep_growing_when_the_fence_row_is_deleted(t: SqlTarget) {
    let key = unique_key("fence-deleted");
    let first = t.h.registry().lock(&key).acquire().await.expect("acquire");
    let before = first.fencing_token().expect("token");
    first.release().await.expect("release");
    assert_eq!(t.db.delete_fence_row(&t.h.stored(&key)).await, 1);
    let second = t.h.registry().lock(&key).acquire().await.expect("acquire");
    assert!(second.fencing_token().expect("token") > before);
    second.release().await.expect("release");
}

/// Black hole: lost before the lease ends, and the server ends the silent
/// session (PostgreSQL: `idle_session_timeout` = the lease; MySQL:
/// `wait_timeout`, the lease rounded up to a second) so the key is free
/// just after it; reset: the backend reconnects.
async fn black_hole_then_reset_through_a_proxy(t: SqlTarget) {
    t.black_hole_then_reset().await;
}

crate::suite!(
    sql_session_suite,
    sql_session,
    crate::sql_db::SqlTarget,
    "the target (an `async fn() -> SqlTarget`)";
    a_dropped_connection_is_lost_before_the_lease_ends,
    the_server_hands_the_key_to_a_waiter_of_another_backend,
    abandoned_waits_leave_no_lock,
    tokens_keep_growing_when_the_fence_row_is_deleted,
    black_hole_then_reset_through_a_proxy,
);
