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
//! Each row also carries its holder record (`holder`, `granted_at`) and the
//! last revoked owner (`revoked`): see `admin.rs` for inspection, listing,
//! revocation and how tables of earlier versions get these columns.
//!
//! Free rows older than a retention (10 minutes by default, `?retention=`)
//! are deleted now and then, so `order:{id}`-style keys do not grow the table
//! without bound; hybrid tokens make that safe.
//!
//! # Session mode
//!
//! PostgreSQL and MySQL also offer `?mode=session`: a server-side lock
//! (`pg_advisory_lock`, `GET_LOCK`) on a **dedicated connection per held
//! lock**, named by the first 64 bits of the stored key's SHA-256.
//!
//! - **Acquire**: one round trip takes the lock — waiting server-side, so the
//!   server hands the key over the moment it is free — and bumps the key's
//!   fencing counter row (`<table>_fence`, a hybrid token) in the same
//!   statement. A wait is cut into slices of at most a third of the lease, so
//!   that a grant always comes back early enough to be used; the slices of one
//!   acquisition share its `wait` budget.
//! - **Held**: the watchdog's renewal is a ping of the connection that also
//!   moves the server's idle limit (PostgreSQL ≥ 14 `idle_session_timeout`,
//!   MySQL `wait_timeout`) to the new lease end, so a frozen or partitioned
//!   holder loses the lock on the server too. A ping that fails or times out,
//!   or (PostgreSQL, whose idle connection is watched) the connection closing
//!   under it — `pg_terminate_backend`, a restart — closes the connection and
//!   reports the lease lost at once. A lease not renewed by its end
//!   (`watchdog = false`, the end of `hold_at_least`) is unlocked there.
//! - **Release**: unlock everything the connection holds; only then is it
//!   reused. Any failure, timeout or cancellation on the way closes it
//!   instead: a connection whose lock state is unknown is never reused, and
//!   closing it ends the server session, which drops its locks.
//!
//! - **Semaphores and readers** (PostgreSQL: both; MySQL: semaphores): each
//!   permit a session lock of a *slot key* (lowest free slot first), each
//!   share decided under a per-key gate that checks the mode recorded with
//!   the key; on PostgreSQL every share also holds the key's advisory lock
//!   shared, so writers (plain locks) and shares meet in the server's fair
//!   lock queue. Shares poll rather than wait on the server (see
//!   `session.rs`).
//!
//! Session locks live in the server's memory: they are not replicated (unsafe
//! across a failover) and are stranded by transaction-pooling proxies. Never
//! lock one key in both modes.
//!
//! # Layout
//!
//! One engine (`engine.rs`, `SqlBackend<D: Dialect>`) holds the
//! `impl LockBackend` of the server databases, their lease/session dispatch,
//! collection and connect skeleton; a folder per database holds its dialect,
//! URL options and session flavour (`postgres/` with its `LISTEN`
//! connection, `mysql/`), and `sqlite/` its own backend with its doorbells.
//! Beside them: `url.rs` (URL options), `pool.rs` (bounded pooled calls),
//! `ordered.rs` (an owner's undo after the work it undoes),
//! `upkeep.rs` (collection, lease units, contenders), `session.rs` (session
//! mode's locks, shared by PostgreSQL and MySQL).
//!
//! # Flavours
//!
//! - [`SqliteBackend`] (`sqlite://path`, feature `sqlite`, the embedded default);
//! - [`PostgresBackend`] (`postgres://`, feature `postgres`): waiters woken by
//!   `LISTEN`/`NOTIFY`; or advisory locks with `?mode=session`;
//! - [`MysqlBackend`] (`mysql://`, MySQL 8 and MariaDB ≥ 10.5, feature
//!   `mysql`): waiters poll with back-off; or `GET_LOCK` with `?mode=session`.

mod admin;
#[cfg(any(feature = "postgres", feature = "mysql"))]
mod engine;
#[cfg(feature = "mysql")]
pub mod mysql;
mod ordered;
#[cfg(any(feature = "postgres", feature = "mysql"))]
mod pool;
#[cfg(feature = "postgres")]
pub mod postgres;
#[cfg(any(feature = "postgres", feature = "mysql"))]
mod session;
mod shared;
#[cfg(feature = "sqlite")]
mod sqlite;
mod upkeep;
mod url;

#[cfg(feature = "mysql")]
pub use mysql::MysqlBackend;
#[cfg(feature = "postgres")]
pub use postgres::PostgresBackend;
#[cfg(feature = "sqlite")]
pub use sqlite::SqliteBackend;
