//! The conformance suite on the MySQL/MariaDB lease table, and what only it
//! has: the `LAST_INSERT_ID` outcome of the acquire, grouped renewals, loss
//! when the row is changed behind the holder, polling waiters.
#![cfg(feature = "mysql")]

use std::sync::Arc;

use dlock_runtime::{MysqlBackend, Registry};
use dlock_tests::sql_support::{MyFaults, SqlMode};
use dlock_tests::{Harness, server_url, servers_missing};
use tokio::sync::OnceCell;

fn url() -> String {
    server_url(
        "DLOCK_TEST_MYSQL_URL",
        "mysql://dlock:dlock@127.0.0.1:43306/dlock",
    )
}

async fn harness() -> &'static Harness {
    static HARNESS: OnceCell<Harness> = OnceCell::const_new();
    HARNESS
        .get_or_init(|| async {
            let url = url();
            let backend = MysqlBackend::connect(&url)
                .await
                .unwrap_or_else(|e| servers_missing(&url, e));
            dlock_runtime::init(Registry::builder().default_backend(backend).build())
                .expect("first init");
            Harness {
                faults: Arc::new(MyFaults {
                    url,
                    mode: SqlMode::Lease,
                }),
                fences: true,
            }
        })
        .await
}

dlock_tests::conformance_suite!(harness);
