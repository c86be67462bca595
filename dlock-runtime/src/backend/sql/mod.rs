//! The SQL lease table.
//!
//! One row per key: `(key, owner, token, expires_at)`. Every decision is made
//! by the database, on the database's clock, in one statement:
//!
//! - acquire: insert the row, or take it over when it is free or expired —
//!   `INSERT … ON CONFLICT DO UPDATE … WHERE owner IS NULL OR expires_at <= now
//!   RETURNING token`. The fencing token is **hybrid**: the larger of the row's
//!   token + 1 and the database clock in microseconds, so it keeps growing per
//!   key even when the row was deleted in between;
//! - renew: `UPDATE … SET expires_at = now + lease WHERE key = ? AND owner = ? AND expires_at > now`;
//! - release: `UPDATE … SET owner = NULL, expires_at = now WHERE key = ? AND owner = ?`.
//!
//! Free rows older than a retention (10 minutes by default) are deleted now
//! and then, so `order:{id}`-style keys do not grow the table without bound;
//! hybrid tokens make that safe.
//!
//! Flavours: [`SqliteBackend`] (`sqlite://path`, the embedded default).

#[cfg(feature = "sqlite")]
mod sqlite;

#[cfg(feature = "sqlite")]
pub use sqlite::SqliteBackend;
