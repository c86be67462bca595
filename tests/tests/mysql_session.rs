//! The conformance, session and semaphore suites on MySQL/MariaDB
//! `GET_LOCK` (`?mode=session`; read locks are refused there, see
//! `hold_modes_refused`).
#![cfg(feature = "mysql")]

use dlock_tests::Harness;
use dlock_tests::sql_db::{SqlDb, SqlTarget};
use dlock_tests::sql_support::SqlMode;

async fn target() -> SqlTarget {
    SqlTarget::get(SqlDb::Mysql, SqlMode::Session).await
}

async fn harness() -> &'static Harness {
    target().await.h
}

dlock_tests::conformance_suite!(harness);
dlock_tests::sql_session_suite!(target);
dlock_tests::semaphore_suite!(harness);
