//! The lease-table suite, run on every SQL database in lease mode
//! (`dlock_tests::sql_lease_table_suite!(target)`): tokens after a deleted
//! row, loss when the row is taken over behind the holder, row collection and
//! bad URLs. What needs a server (`?table=`, logins, a proxy between) is
//! [`crate::sql_server_lease_table`]'s, which SQLite does not run.
// A case left off the list at the end is unused: dead code fails the build.
#![deny(dead_code)]

use std::time::{Duration, Instant};

use dlock_runtime::LockError;

use crate::sql_db::SqlTarget;
use crate::sql_support::loss_cancels_the_body;
use crate::{acquire_and_release, unique_key};

/// The fencing token keeps growing when the row is deleted (by an
/// operator, or the collection of free rows), round after round: it is the
/// larger of the row's token + 1 and the database clock in µs.
async fn tokens_keep_growing_when_the_row_is_deleted(t: SqlTarget) {
    let key = unique_key("row-deleted");
    let stored = t.h.stored(&key);
    let mut last = None;
    for round in 0..3 {
        let guard = t.h.registry().lock(&key).acquire().await.expect("acquire");
        let token = guard.fencing_token().expect("token");
        assert!(
            last.is_none_or(|last| token > last),
            "round {round}: token {token} after {last:?}"
        );
        last = Some(token);
        guard.release().await.expect("release");
        let deleted =
            t.db.execute_with("DELETE FROM dlock_leases WHERE {key} = {param}", &stored)
                .await;
        assert_eq!(deleted, 1, "the row existed");
    }
}

/// The row taken over behind the holder's back (its owner changed, its
/// expiry kept): the holder learns it at its next renewal, before the
/// lease ends, and the body is cancelled.
async fn a_row_taken_over_behind_the_holder_is_lost_before_the_lease_ends(t: SqlTarget) {
    let key = unique_key("taken-over");
    let stored = t.h.stored(&key);
    loss_cancels_the_body(&key, async {
        let changed =
            t.db.execute_with(
                "UPDATE dlock_leases SET owner = 'intruder' WHERE {key} = {param}",
                &stored,
            )
            .await;
        assert_eq!(changed, 1);
    })
    .await;
}

/// Free rows are collected after the retention: 500 keys locked and
/// released leave O(1) rows once the retention (1 s) has passed and one
/// more release runs the collection (before it returns where the database
/// collects in the release, SQLite; else within 5 s).
async fn free_rows_are_collected(t: SqlTarget) {
    let (backend, table) = t.with_own_table("gc", "&retention=1s").await;
    let registry = backend.registry();
    let prefix = unique_key("bounded");
    for i in 0..500 {
        acquire_and_release(&registry, &format!("{prefix}:{i}")).await;
    }
    let before = backend.row_count().await;
    assert!(
        before > 5,
        "{before} rows right after the releases: the rows of the last second are kept"
    );
    tokio::time::sleep(Duration::from_millis(1200)).await;
    acquire_and_release(&registry, &format!("{prefix}:last")).await;
    let deadline = Instant::now()
        + if t.db.collects_in_the_release() {
            Duration::ZERO
        } else {
            Duration::from_secs(5)
        };
    loop {
        let rows = backend.row_count().await;
        if rows <= 2 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{rows} rows left of 501 free keys once the retention passed"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    table.drop_table().await;
}

/// Bad URLs are configuration errors that never show the password.
async fn bad_urls_are_config_errors(t: SqlTarget) {
    let scheme = t.db.scheme();
    let server = if t.db.has_server() {
        format!("{scheme}://u:hunter2@{}/dlock", t.db.host_port())
    } else {
        t.db.url()
    };
    let mut bad = vec![
        format!("{server}?mode=advisory"),
        format!("{server}?table=a;b"),
        format!("{server}?poll=never"),
    ];
    if t.db.scheme() == "postgres" {
        bad.push(format!("{server}?listen_url=mysql%3A%2F%2Fh"));
    }
    for bad in bad {
        let err = t.db.connect_url(&bad).await.expect_err(&bad);
        assert!(matches!(err, LockError::Config { .. }), "{bad}: {err}");
        assert!(!format!("{err} {err:?}").contains("hunter2"), "{err:?}");
    }
}

crate::suite!(
    sql_lease_table_suite,
    sql_lease_table,
    crate::sql_db::SqlTarget,
    "the target (an `async fn() -> SqlTarget`)";
    tokens_keep_growing_when_the_row_is_deleted,
    a_row_taken_over_behind_the_holder_is_lost_before_the_lease_ends,
    free_rows_are_collected,
    bad_urls_are_config_errors,
);
