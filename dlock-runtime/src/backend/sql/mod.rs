//! The SQL lease table, and the session locks of PostgreSQL and MySQL.
//!
//! One row per key: `(key, owner, token, expires_at)`. Every decision is made
//! by the database, on the database's clock, in one statement:
//!
//! - acquire: insert the row, or take it over when it is free or expired —
//!   `INSERT … ON CONFLICT DO UPDATE … WHERE free-or-expired RETURNING token`
//!   (MySQL: `INSERT … ON DUPLICATE KEY UPDATE`, the outcome reported through
//!   `LAST_INSERT_ID(expr)`). The fencing token is **hybrid**: the larger of
//!   the row's token + 1 and the database clock in microseconds, so it keeps
//!   growing per key even when the row was deleted in between (or a replica
//!   without the last grants was promoted);
//! - renew: extend the expiry where the owner still holds an unexpired row —
//!   one statement for a whole watchdog batch on PostgreSQL and MySQL;
//! - release: `UPDATE … SET owner = NULL, expires_at = now WHERE key = ? AND owner = ?`.
//!
//! Free rows older than a retention (10 minutes by default, `?retention=`)
//! are deleted now and then, so `order:{id}`-style keys do not grow the table
//! without bound; hybrid tokens make that safe.
//!
//! Flavours:
//!
//! - [`SqliteBackend`] (`sqlite://path`, feature `sqlite`, the embedded default);
//! - [`PostgresBackend`] (`postgres://`, feature `postgres`): waiters woken by
//!   `LISTEN`/`NOTIFY`; or advisory locks with `?mode=session`;
//! - [`MysqlBackend`] (`mysql://`, MySQL 8 and MariaDB ≥ 10.5, feature
//!   `mysql`): waiters poll with back-off; or `GET_LOCK` with `?mode=session`.

#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
mod common;
#[cfg(feature = "mysql")]
mod mysql;
#[cfg(feature = "postgres")]
mod pg_listener;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(any(feature = "postgres", feature = "mysql"))]
mod session;
#[cfg(feature = "sqlite")]
mod sqlite;

#[cfg(feature = "mysql")]
pub use mysql::MysqlBackend;
#[cfg(feature = "postgres")]
pub use postgres::PostgresBackend;
#[cfg(feature = "sqlite")]
pub use sqlite::SqliteBackend;
