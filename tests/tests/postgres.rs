//! The conformance suite on the PostgreSQL lease table, and what only it
//! has: LISTEN/NOTIFY wake-ups between processes, a listener that comes
//! back after its connection is killed, loss when the row is changed behind
//! the holder, tokens that survive deleted rows, the table's options.
#![cfg(feature = "postgres")]

use std::sync::Arc;

use dlock_runtime::{PostgresBackend, Registry};
use dlock_tests::sql_support::{PgFaults, SqlMode};
use dlock_tests::{Harness, server_url, servers_missing};
use tokio::sync::OnceCell;

fn url() -> String {
    server_url(
        "DLOCK_TEST_POSTGRES_URL",
        "postgres://dlock:dlock@127.0.0.1:45432/dlock",
    )
}

async fn harness() -> &'static Harness {
    static HARNESS: OnceCell<Harness> = OnceCell::const_new();
    HARNESS
        .get_or_init(|| async {
            let url = url();
            let backend = PostgresBackend::connect(&url)
                .await
                .unwrap_or_else(|e| servers_missing(&url, e));
            assert!(backend.is_listening(), "{backend:?}");
            dlock_runtime::init(Registry::builder().default_backend(backend).build())
                .expect("first init");
            Harness {
                faults: Arc::new(PgFaults {
                    url,
                    mode: SqlMode::Lease,
                }),
                fences: true,
            }
        })
        .await
}

dlock_tests::conformance_suite!(harness);
