//! The conformance, session, semaphore and read-write suites on PostgreSQL
//! advisory locks (`?mode=session`).
#![cfg(feature = "postgres")]

use dlock_tests::Harness;
use dlock_tests::sql_db::{SqlDb, SqlTarget};
use dlock_tests::sql_support::SqlMode;

async fn target() -> SqlTarget {
    SqlTarget::get(SqlDb::Postgres, SqlMode::Session).await
}

async fn harness() -> &'static Harness {
    target().await.h
}

dlock_tests::conformance_suite!(harness);
dlock_tests::sql_session_suite!(target);
dlock_tests::semaphore_suite!(harness);
dlock_tests::rw_suite!(harness);
