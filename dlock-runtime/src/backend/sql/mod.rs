//! The SQL lease table.
//!
//! One row per key: `(key, owner, token, expires_at)`. Every decision is made
//! by the database, on the database's clock, in one statement:
//!
//! - acquire: insert the row, or take it over when it is free or expired,
//!   incrementing `token` (the fencing token) — `INSERT … ON CONFLICT DO UPDATE …
//!   WHERE owner IS NULL OR expires_at <= now RETURNING token`;
//! - renew: `UPDATE … SET expires_at = now + lease WHERE key = ? AND owner = ? AND expires_at > now`;
//! - release: `UPDATE … SET owner = NULL WHERE key = ? AND owner = ?`. The row
//!   stays, so that the token keeps growing for that key.
//!
//! Flavours: [`SqliteBackend`] (`sqlite://path`, the embedded default).

#[cfg(feature = "sqlite")]
mod sqlite;

#[cfg(feature = "sqlite")]
pub use sqlite::SqliteBackend;
