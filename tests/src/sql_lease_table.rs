//! The lease-table suite, run on every SQL database in lease mode
//! (`dlock_tests::sql_lease_table_suite!(target)`): tokens after a deleted
//! row, loss when the row is taken over behind the holder, `?table=` and
//! `?create=false`, row collection, bad URLs and unreachable servers, and a
//! black hole then a reset through a TCP proxy. A case that needs what a
//! database lacks (a server, `?table=`: SQLite) says so and ends there.
// A case left off the list at the end is unused: dead code fails the build.
#![deny(dead_code)]

use std::time::{Duration, Instant};

use dlock_runtime::LockError;

use crate::sql_db::SqlTarget;
use crate::sql_support::loss_cancels_the_body;
use crate::{acquire_and_release, unique_key};

/// Whether `t`'s database can run the case `case`, which needs `what`
/// (`can`); says so when it cannot.
fn applies(t: SqlTarget, can: bool, case: &str, what: &str) -> bool {
    if !can {
        println!("{case}: not run on {:?}, which has no {what}", t.db);
    }
    can
}

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

/// `?create=false` checks the table and never creates it; `?table=`
/// names it.
async fn the_table_option_and_create_false(t: SqlTarget) {
    if !applies(t, t.db.names_its_table(), "the table option", "`?table=`") {
        return;
    }
    let table = format!("custom_{:08x}", rand::random::<u32>());
    let missing =
        t.db.connect_url(&format!("{}?create=false&table={table}", t.db.url()))
            .await;
    match missing {
        Err(LockError::Config { message }) => assert!(message.contains(&table), "{message}"),
        other => panic!("a missing table with create=false: {other:?}"),
    }
    let created = t.other_process(&format!("&table={table}")).await.registry();
    let checked = t
        .other_process(&format!("&create=false&table={table}"))
        .await
        .registry();
    let key = unique_key("custom-table");
    let guard = created.lock(&key).acquire().await.expect("acquire");
    assert!(matches!(
        checked.lock(&key).acquire().await,
        Err(LockError::Busy { .. })
    ));
    guard.release().await.expect("release");
    let rows =
        t.db.fetch_count(&format!("SELECT count(*) FROM {table}"))
            .await;
    assert_eq!(rows, 1);
    t.db.execute(&format!("DROP TABLE {table}")).await;
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

/// Bad URLs are configuration errors that never show the password; an
/// unreachable server is an error within the timeout, without the
/// password; so is a login the server refuses.
async fn bad_urls_and_unreachable_servers(t: SqlTarget) {
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
    if !applies(t, t.db.has_server(), "unreachable servers", "server") {
        return;
    }
    let started = Instant::now();
    let err =
        t.db.connect_url(&format!(
            "{scheme}://u:hunter2@127.0.0.1:1/db?timeout=500ms"
        ))
        .await
        .expect_err("nothing listens on port 1");
    assert!(matches!(err, LockError::Backend { .. }), "{err}");
    assert!(!format!("{err} {err:?}").contains("hunter2"), "{err:?}");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    // PostgreSQL's test server trusts local logins, so an unknown role is
    // what it refuses; MariaDB refuses a wrong password.
    let refused = format!(
        "{scheme}://{}:not-the-password@{}/dlock",
        match t.db.scheme() {
            "postgres" => "no_such_role",
            _ => "dlock",
        },
        t.db.host_port()
    );
    let wrong = t.db.connect_url(&refused).await.expect_err("refused login");
    assert!(matches!(wrong, LockError::Backend { .. }), "{wrong}");
    assert!(
        !format!("{wrong} {wrong:?}").contains("not-the-password"),
        "{wrong:?}"
    );
}

/// Black hole: lost before the lease ends, the row expires on the server;
/// reset: the backend reconnects.
async fn black_hole_then_reset_through_a_proxy(t: SqlTarget) {
    if !applies(t, t.db.has_server(), "a proxy", "server") {
        return;
    }
    t.black_hole_then_reset().await;
}

crate::suite!(
    sql_lease_table_suite,
    sql_lease_table,
    crate::sql_db::SqlTarget,
    "the target (an `async fn() -> SqlTarget`)";
    tokens_keep_growing_when_the_row_is_deleted,
    a_row_taken_over_behind_the_holder_is_lost_before_the_lease_ends,
    the_table_option_and_create_false,
    free_rows_are_collected,
    bad_urls_and_unreachable_servers,
    black_hole_then_reset_through_a_proxy,
);
