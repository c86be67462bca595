//! Fencing at the resource: the check that refuses a stale holder's write.
//!
//! A lock is a lease. A holder that pauses past its lease (GC, SIGSTOP, a
//! slow network) wakes up believing it still holds the lock while another
//! does. Its [`FencingToken`] is smaller than the newer holder's, and a store
//! that keeps the largest token it has seen can refuse its late write. This
//! module is that store-side check:
//!
//! - **SQL** ([`check`], [`check_current`], [`Fence`]; features `postgres`,
//!   `mysql`, `sqlite`): inside the caller's open sqlx transaction, keep the
//!   largest token seen for a resource in the table `dlock_fences`, and fail
//!   with [`LockError::Fenced`] when a larger one was already seen — the
//!   caller rolls back, and the stale write never commits.
//! - **Redis** ([`redis::set`], [`redis::hset`]; feature `redis`): a write
//!   that happens only if its token is at least the largest one seen for the
//!   key, in one script call, on one server or on Cluster.
//!
//! ```no_run
//! # #[cfg(feature = "postgres")]
//! # mod m {
//! use dlock_runtime::{distributed_lock, fence, LockError};
//!
//! #[derive(Debug)]
//! enum AppError { Lock(LockError), Db(sqlx::Error) }
//! impl From<LockError> for AppError { fn from(e: LockError) -> Self { AppError::Lock(e) } }
//! impl From<sqlx::Error> for AppError { fn from(e: sqlx::Error) -> Self { AppError::Db(e) } }
//!
//! #[distributed_lock(key = "account:{id}", lease = "10s")]
//! async fn debit(pool: &sqlx::PgPool, id: i64, cents: i64) -> Result<(), AppError> {
//!     let mut tx = pool.begin().await?;
//!     // Refused (and the transaction dropped, so rolled back) if a holder
//!     // with a larger token already wrote this account.
//!     fence::check_current(&mut tx, &format!("account:{id}")).await?;
//!     sqlx::query("UPDATE accounts SET balance = balance - $1 WHERE id = $2")
//!         .bind(cents)
//!         .bind(id)
//!         .execute(&mut *tx)
//!         .await?;
//!     tx.commit().await?;
//!     Ok(())
//! }
//! # }
//! ```
//!
//! # The SQL check
//!
//! One statement on PostgreSQL and SQLite, which answer with the kept token
//! (no row: refused; a second `SELECT` then reads the larger token, on the
//! refusal path only):
//!
//! ```sql
//! INSERT INTO dlock_fences (resource, token, updated_at) VALUES ($1, $2, now())
//! ON CONFLICT (resource) DO UPDATE SET token = EXCLUDED.token, updated_at = EXCLUDED.updated_at
//! WHERE dlock_fences.token <= EXCLUDED.token
//! RETURNING token
//! ```
//!
//! One statement on MySQL and MariaDB, which have no `RETURNING` on an
//! update: `INSERT … ON DUPLICATE KEY UPDATE token = IF(token <= ?, ?, token
//! + 0 * LAST_INSERT_ID(token))`, the refusal and the larger token reported
//! through `LAST_INSERT_ID`.
//!
//! The row the check inserts or updates stays locked until the caller's
//! transaction ends, so checkers of one resource are serialised: a second
//! checker waits for the first to commit or roll back, then compares with
//! what it committed. Two writers therefore never both commit out of token
//! order. Put the check before the writes it protects, in the same
//! transaction, on the same database. On **SQLite** the whole database is
//! locked for writing instead of a row; make the check the transaction's
//! first statement (a deferred transaction that read first may fail to
//! upgrade to a writer with `SQLITE_BUSY`, reported as a retryable
//! [`LockError::Backend`]). At PostgreSQL's REPEATABLE READ or SERIALIZABLE,
//! a concurrent checker fails with a serialization failure (retryable)
//! instead of waiting.
//!
//! **The table** is created on first use: the first check in a process on
//! PostgreSQL or SQLite looks for it and, if it is missing, creates it inside
//! the caller's transaction (PostgreSQL serialises concurrent creators with
//! a transaction-scoped advisory lock; SQLite with its write lock), so it
//! appears when that transaction commits. Once a check has found the table
//! committed, later checks in the process do not look again. MySQL and
//! MariaDB commit the open transaction on any `CREATE TABLE`, so no check
//! creates it there: call [`create_table`] at startup (or run
//! [`MYSQL_DDL`]); a check on a missing table is a [`LockError::Config`]
//! naming both. [`Fence::create_table(false)`](Fence::create_table) turns
//! creation off everywhere (the DDL constants, [`POSTGRES_DDL`],
//! [`MYSQL_DDL`], [`SQLITE_DDL`], are for migrations).
//!
//! # The column form
//!
//! A row that is the resource can keep its own fence, with no extra table and
//! no extra statement: add a `fence bigint NOT NULL DEFAULT 0` column and
//! write with
//!
//! ```sql
//! UPDATE accounts SET balance = $1, fence = $2 WHERE id = $3 AND fence <= $2
//! ```
//!
//! Zero rows updated (for a row that exists) means a larger token already
//! wrote it: the write was stale, roll back what else the transaction did.
//! Count the rows matched, not changed, where the driver tells them apart
//! (MySQL without `CLIENT_FOUND_ROWS` reports an update that changes nothing
//! as zero rows; sqlx sets the flag). This fences one row; the table form
//! fences a resource of any shape (several rows, other tables, a file).
//!
//! # `check_current`
//!
//! [`check_current`] takes the token of [`current()`](crate::current), the
//! lock the calling task holds (inside a `#[distributed_lock]` function or a
//! [`LockGuard::scope`](crate::LockGuard::scope)). It fails with
//! [`LockError::Config`] when the task holds no lock (a fenced write outside
//! any lock is a programming error, not a lost race: nothing is written) and
//! when the held lock has no token (Redlock has none, nor a lock taken
//! without fencing; fence such writes with a version compare-and-set). It
//! does not refuse a lease known to be lost: the fence decides, and a write
//! whose token is still the largest is safe.
//!
//! # Bounded state, and what may be deleted
//!
//! The table holds one row per resource. [`collect`] deletes rows not
//! checked for a retention ([`DEFAULT_RETENTION`], a day); an operator may
//! delete the same rows by hand, or any row of a resource no longer written.
//! Deleting a row forgets the largest token of its resource: the next check
//! passes **whatever** token it brings. That is harmless for the newest
//! holder and for every later one, and unsafe only for a stale writer — one
//! whose lease ended before the row's last check — arriving after the
//! deletion. So deleting a row is safe exactly when no stale holder of that
//! resource can still reach the database: when its last update is older than
//! the longest a lease-less holder can go on writing (its longest pause, plus
//! the longest a write can be in flight). This holds for every kind of token,
//! and no token kind makes an earlier deletion safe. What differs is the
//! other direction. With the hybrid tokens of Redis and SQL (the larger of a
//! counter + 1 and the server's clock in µs), every new acquisition's token
//! is above every token issued before, even after the lock backend lost its
//! state, so a row never blocks a legitimate holder. ZooKeeper's token (the
//! lock node's `czxid`) and etcd's (the holder entry's create revision)
//! restart from small numbers if the ensemble's or cluster's data is wiped,
//! and then every stored row refuses every new holder: delete all rows of
//! resources locked through it, once the old holders are gone. The same
//! applies when a resource's lock moves to another backend (tokens of two
//! backends are not comparable).
//!
//! # Scope
//!
//! A token is comparable only with tokens of the same key on the same
//! backend: fence one resource with the tokens of one lock key. A semaphore
//! fences per slot; a read-write lock's writer token fences writes, and what
//! readers write is not fenced by it. On [`LockError::Fenced`], roll back and
//! stop: this holder is stale, a newer one has written since; retrying with
//! the same token is refused again.

use std::time::Duration;

use crate::{FencingToken, LockError};

#[cfg(feature = "redis")]
pub mod redis;
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
mod sql;

#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
pub use sql::{
    Fence, FenceDatabase, MAX_RESOURCE_LEN, MYSQL_DDL, POSTGRES_DDL, SQLITE_DDL, collect,
    create_table,
};

/// How long a fence is kept after its last check by default: a day (the
/// retention of [`collect`] and of the Redis fences). Read the module docs
/// for what deleting a fence gives up.
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(24 * 3600);

/// Checks `token` against the largest token seen for `resource`, inside the
/// caller's open transaction, and keeps the larger one: [`Fence::check`]
/// with the defaults.
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
pub async fn check<DB: FenceDatabase>(
    tx: &mut sqlx::Transaction<'_, DB>,
    resource: &str,
    token: FencingToken,
) -> Result<(), LockError> {
    Fence::new().check(tx, resource, token).await
}

/// [`check`] with the token of the lock the current task holds:
/// [`Fence::check_current`] with the defaults.
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
pub async fn check_current<DB: FenceDatabase>(
    tx: &mut sqlx::Transaction<'_, DB>,
    resource: &str,
) -> Result<(), LockError> {
    Fence::new().check_current(tx, resource).await
}

/// The token of the lock the current task holds for a fenced write to
/// `resource`: see [`check_current`].
fn current_token(resource: &str) -> Result<FencingToken, LockError> {
    let Some(held) = crate::lease::token_for(resource) else {
        return Err(LockError::config(format!(
            "fenced write to `{resource}` outside a held lock: `current()` is None \
             (call it inside a #[distributed_lock] function or a LockGuard::scope)"
        )));
    };
    let crate::lease::TokenFor {
        key,
        backend,
        token,
    } = held?;
    token.ok_or_else(|| {
        LockError::config(format!(
            "fenced write to `{resource}` under lock `{key}` on backend `{backend}`, which has no \
             fencing token (Redlock, or a lock taken without fencing): fence it with a \
             version compare-and-set instead"
        ))
    })
}
