//! The lease-table cases that need a database server (PostgreSQL, MySQL;
//! not SQLite): `?table=` and `?create=false`, unreachable servers and
//! refused logins, and a black hole then a reset through a TCP proxy
//! (`dlock_tests::sql_server_lease_table_suite!(target)`, beside
//! [`crate::sql_lease_table`]'s suite).
// A case left off the list at the end is unused: dead code fails the build.
#![deny(dead_code)]

use std::time::{Duration, Instant};

use dlock_runtime::LockError;

use crate::sql_db::SqlTarget;
use crate::unique_key;

/// `?create=false` checks the table and never creates it; `?table=`
/// names it.
async fn the_table_option_and_create_false(t: SqlTarget) {
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

/// An unreachable server is an error within the timeout, without the
/// password; so is a login the server refuses.
async fn unreachable_servers_and_refused_logins(t: SqlTarget) {
    let scheme = t.db.scheme();
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
    t.black_hole_then_reset().await;
}

crate::suite!(
    sql_server_lease_table_suite,
    sql_server_lease_table,
    crate::sql_db::SqlTarget,
    "the target (an `async fn() -> SqlTarget`)";
    the_table_option_and_create_false,
    unreachable_servers_and_refused_logins,
    black_hole_then_reset_through_a_proxy,
);
