//! dlock's lease-table pool: one timeout a call, a failed connection
//! closed and the statement tried again on another, and which `sqlx` errors
//! say the connection failed.

use std::time::Duration;

use crate::error::BackendError;

/// Whether a `sqlx` error says the connection (or the pool) failed, not the
/// statement: worth trying again, and the connection is not to be reused.
pub(crate) fn is_connection_error(err: &sqlx::Error) -> bool {
    match err {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => true,
        // The server ended the session with a message (PostgreSQL sends a
        // FATAL before closing: terminated, shut down, idle-session
        // timeout; SQLSTATE class 08: connection exception): the
        // connection is dead like any other.
        sqlx::Error::Database(db) => db.code().is_some_and(|c| {
            c.starts_with("08") || matches!(c.as_ref(), "57P01" | "57P02" | "57P03" | "57P05")
        }),
        _ => false,
    }
}

/// A pooled connection that is **closed** when dropped, unless it was handed
/// back with [`keep`](Checked::keep): a statement dropped halfway (a
/// timeout, a caller that went away) or a broken connection never goes back
/// to the pool in an unknown state.
// `pub` for MySQL's session connections (a `Dialect`'s interface).
#[cfg_attr(not(feature = "mysql"), allow(unreachable_pub))]
pub struct Checked<DB: sqlx::Database>(Option<sqlx::pool::PoolConnection<DB>>);

impl<DB: sqlx::Database> Checked<DB> {
    pub(crate) fn new(conn: sqlx::pool::PoolConnection<DB>) -> Self {
        Checked(Some(conn))
    }

    pub(crate) fn conn(&mut self) -> &mut DB::Connection {
        self.0.as_mut().expect("present until dropped or kept")
    }

    /// Returns the connection to its pool (it is in a known state).
    pub(crate) fn keep(mut self) {
        drop(self.0.take());
    }
}

impl<DB: sqlx::Database> Drop for Checked<DB> {
    fn drop(&mut self) {
        if let Some(mut conn) = self.0.take() {
            conn.close_on_drop();
        }
    }
}

/// A pool and how its calls are bounded: one timeout for the whole call, a
/// connection that failed is closed (never reused) and the statement tried
/// again on another — a server restart leaves dead connections in the pool,
/// each failing at once, and every dlock statement may be sent twice (each
/// is owner-checked).
pub(crate) struct Pooled<DB: sqlx::Database> {
    pub(crate) pool: sqlx::Pool<DB>,
    pub(crate) timeout: Duration,
    pub(crate) classify: fn(sqlx::Error) -> BackendError,
}

impl<DB: sqlx::Database> Clone for Pooled<DB> {
    fn clone(&self) -> Self {
        Pooled {
            pool: self.pool.clone(),
            timeout: self.timeout,
            classify: self.classify,
        }
    }
}

impl<DB: sqlx::Database> Pooled<DB> {
    /// Runs `statement` on a connection of the pool. `what` names it in a
    /// timeout error.
    pub(crate) async fn call<T, F>(&self, what: &str, mut statement: F) -> Result<T, BackendError>
    where
        F: for<'c> FnMut(
            &'c mut DB::Connection,
        ) -> futures_util::future::BoxFuture<'c, Result<T, sqlx::Error>>,
    {
        let attempts = async {
            let mut tries = 0;
            loop {
                tries += 1;
                let answer = async {
                    let mut conn = Checked::new(self.pool.acquire().await?);
                    let answer = statement(conn.conn()).await;
                    match &answer {
                        Err(err) if is_connection_error(err) => drop(conn),
                        _ => conn.keep(),
                    }
                    answer
                }
                .await;
                match answer {
                    Err(err)
                        if tries < CONNECTION_TRIES
                            && is_connection_error(&err)
                            && !matches!(err, sqlx::Error::PoolTimedOut) => {}
                    answer => return answer,
                }
            }
        };
        match tokio::time::timeout(self.timeout, attempts).await {
            Ok(answer) => answer.map_err(self.classify),
            Err(_) => Err(timed_out(what, self.timeout)),
        }
    }
}

/// One batch statement's error, as the answer of each lease of the batch.
pub(crate) fn batch_failed<T>(
    kind: &str,
    err: BackendError,
    n: usize,
) -> Vec<Result<T, BackendError>> {
    let (transient, message) = (err.is_retryable(), err.to_string());
    (0..n)
        .map(|_| {
            let message = format!("{kind}: batch renewal failed: {message}");
            Err(if transient {
                BackendError::transient(message)
            } else {
                BackendError::permanent(message)
            })
        })
        .collect()
}

/// How many connections one call tries: a pool holds at most this many
/// dead ones after a restart.
const CONNECTION_TRIES: u32 = 11;

/// The error of a call that did not answer in time.
pub(crate) fn timed_out(what: &str, after: Duration) -> BackendError {
    BackendError::transient(std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        format!("{what} did not answer within {after:?}"),
    ))
}
