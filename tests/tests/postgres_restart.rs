//! The PostgreSQL server SIGKILLed under held locks (lease and session mode)
//! and restarted through `scripts/servers.sh`: losses before the leases end,
//! errors within `wait` while it is down, locks and growing tokens after.
//! One test, in a binary of its own: the server is down for a moment.
#![cfg(feature = "postgres")]

use dlock_runtime::{PostgresBackend, Registry};
use dlock_tests::sql_support::sigkill_and_restart;
use dlock_tests::{server_url, servers_missing};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_and_restart_under_held_locks() {
    let url = server_url(
        "DLOCK_TEST_POSTGRES_URL",
        "postgres://dlock:dlock@127.0.0.1:45432/dlock",
    );
    let mut registries = Vec::new();
    for options in ["?timeout=1s", "?timeout=1s&mode=session"] {
        let backend = PostgresBackend::connect(&format!("{url}{options}"))
            .await
            .unwrap_or_else(|e| servers_missing(&url, e));
        registries.push(Registry::builder().default_backend(backend).build());
    }
    sigkill_and_restart("postgres", &registries).await;
}
