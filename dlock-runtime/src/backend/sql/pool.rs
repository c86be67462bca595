//! dlock's lease-table pools: one timeout a call, a failed connection
//! closed and the statement tried again on another, and which `sqlx` errors
//! say the connection failed.
//!
//! **Where statements go.** A `sqlx` connection belongs to the runtime that
//! opened it and dies with it. A backend keeps two kinds of pool (see
//! [`local`](crate::backend::local)): the **home** pool, opened on dlock's
//! own I/O runtime (the watchdog's renewals and background releases run
//! there, and calls from elsewhere hop to it), and a **local** pool opened
//! in the background on the application's runtime, used only by calls from
//! that runtime, without a hop. A call never waits for the local pool to
//! open: until it is ready, calls hop home.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use futures_util::future::BoxFuture;

use crate::backend::local::Local;
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
/// back with [`keep`](Checked::keep): a broken connection, or one whose
/// state is unknown, never goes back to the pool.
pub(crate) struct Checked<DB: sqlx::Database>(Option<sqlx::pool::PoolConnection<DB>>);

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
    /// The home pool (see the [module docs](self)).
    pub(crate) pool: sqlx::Pool<DB>,
    pub(crate) timeout: Duration,
    pub(crate) classify: fn(sqlx::Error) -> BackendError,
    local: Arc<Local<sqlx::Pool<DB>>>,
    unanswered: Arc<Unanswered>,
}

/// Statements of an owner's that were dropped while they ran (their caller
/// went away) and that the server has not answered yet: the owner's next
/// call — the clean-up release — waits until it has, so that it reaches the
/// server after the statement it undoes, never before (see
/// [`Pooled::call_for`]). It waits one call timeout at most: a statement is
/// answered or timed out by then (and the runtime's backstop release, sent
/// that long after, does not wait at all).
#[derive(Default)]
struct Unanswered {
    /// By owner token: when the wait ends, and a receiver that closes when
    /// the server has answered.
    owners: Mutex<HashMap<String, (Instant, tokio::sync::watch::Receiver<()>)>>,
}

/// Closed (dropped) when an owner's dropped statement has been answered.
type Answered = tokio::sync::watch::Sender<()>;

impl Unanswered {
    fn owners(
        &self,
    ) -> MutexGuard<'_, HashMap<String, (Instant, tokio::sync::watch::Receiver<()>)>> {
        self.owners.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Makes `owner`'s calls wait, for `timeout` at most, until `answered`
    /// is dropped.
    fn register(&self, owner: &str, timeout: Duration) -> Answered {
        let (answered, rx) = tokio::sync::watch::channel(());
        self.owners()
            .insert(owner.to_owned(), (Instant::now() + timeout, rx));
        answered
    }

    /// Waits until `owner`'s dropped statements have been answered, or their
    /// time is up.
    async fn wait_for(&self, owner: &str) {
        let pending = self.owners().get(owner).cloned();
        if let Some((until, mut answered)) = pending {
            // Ends when the sender is dropped.
            let _ = tokio::time::timeout_at(until.into(), answered.changed()).await;
            let mut owners = self.owners();
            if owners
                .get(owner)
                .is_some_and(|(until, rx)| rx.has_changed().is_err() || Instant::now() >= *until)
            {
                owners.remove(owner);
            }
        }
    }
}

/// A connection whose statement is running. Dropped before it is answered
/// (a caller that went away, a timeout), it is not closed: a task waits for
/// the server's answer on it (the statement runs to its end on the server
/// anyway), ends any transaction the call left open, then gives the
/// connection back — so callers that hang up cost
/// no connections — and until then the calls of the statement's `owner`, if
/// it has one, wait (see [`Unanswered`]).
struct Running<'a, DB: sqlx::Database> {
    conn: Option<Checked<DB>>,
    owner: Option<&'a str>,
    unanswered: &'a Arc<Unanswered>,
    timeout: Duration,
}

impl<DB: sqlx::Database> Running<'_, DB> {
    fn conn(&mut self) -> &mut DB::Connection {
        self.conn.as_mut().expect("present until finished").conn()
    }

    /// The statement answered: the connection, back.
    fn finished(mut self) -> Checked<DB> {
        self.conn.take().expect("present until finished")
    }
}

impl<DB: sqlx::Database> Drop for Running<'_, DB> {
    fn drop(&mut self) {
        let Some(mut conn) = self.conn.take() else {
            return;
        };
        // The connection belongs to the runtime that runs this call; if it
        // is shutting down, the connection closes with it.
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        // Dropped when the server has answered (or the task is dropped).
        let answered = self
            .owner
            .map(|owner| self.unanswered.register(owner, self.timeout));
        let timeout = self.timeout;
        runtime.spawn(async move {
            // The first round trip reads the dropped statement's answer.
            // Then a transaction of our own, rolled back: a call dropped
            // while its `BEGIN` was on the wire leaves the server inside a
            // transaction the driver does not count (it counts one once
            // `BEGIN` has answered), and every later statement on this
            // connection would run in it, uncommitted, its row locks held.
            // A new `BEGIN` ends that one (MySQL commits it: it holds
            // nothing, the dropped call sent nothing after its `BEGIN`;
            // PostgreSQL keeps it and warns), the rollback ends ours.
            use sqlx::Connection as _;
            let settle = async {
                conn.conn().begin().await?.rollback().await?;
                Ok::<(), sqlx::Error>(())
            };
            if let Ok(Ok(())) = tokio::time::timeout(timeout, settle).await {
                conn.keep();
            }
            drop(answered);
        });
    }
}

impl<DB: sqlx::Database> Clone for Pooled<DB> {
    fn clone(&self) -> Self {
        Pooled {
            pool: self.pool.clone(),
            timeout: self.timeout,
            classify: self.classify,
            local: self.local.clone(),
            unanswered: self.unanswered.clone(),
        }
    }
}

/// Opens one more pool like the home one, on the current runtime.
pub(crate) type Opener<DB> =
    Arc<dyn Fn() -> BoxFuture<'static, Result<sqlx::Pool<DB>, sqlx::Error>> + Send + Sync>;

impl<DB: sqlx::Database> Pooled<DB> {
    /// The home pool `pool`, and local pools opened by `open` when asked for.
    pub(crate) fn new(
        pool: sqlx::Pool<DB>,
        timeout: Duration,
        classify: fn(sqlx::Error) -> BackendError,
        open: Opener<DB>,
    ) -> Self {
        Pooled {
            pool,
            timeout,
            classify,
            local: Arc::new(Local::new(timeout, move || open())),
            unanswered: Arc::default(),
        }
    }

    /// Whether calls from the current thread go to a pool without a hop:
    /// it is dlock's I/O runtime, or its runtime's local pool is open (if
    /// not, this starts opening it). Otherwise run the calls on dlock's
    /// I/O runtime.
    pub(crate) fn is_near(&self) -> bool {
        crate::driver::on_io_runtime() || self.local.get().is_some()
    }

    /// The pool for a call from the current thread: the local one when it is
    /// open on this runtime, else the home one.
    fn near(&self) -> sqlx::Pool<DB> {
        match self.local.get() {
            Some(local) => local.value,
            None => self.pool.clone(),
        }
    }

    /// Runs `attempt`, an attempt of `owner`'s, on dlock's I/O runtime (a
    /// call from a runtime whose own pool is not open yet). A caller that
    /// goes away does not stop it there: it runs to its end (each of its
    /// statements is bounded by the timeout), and until then `owner`'s calls
    /// wait (see [`Unanswered`]) — so the clean-up release follows it, as it
    /// follows an attempt dropped on the caller's own pool.
    pub(crate) async fn at_home_for<T: Send + 'static>(
        &self,
        owner: &str,
        attempt: impl std::future::Future<Output = T> + Send + 'static,
    ) -> T {
        /// Registers the owner's wait if the caller goes away first.
        struct Gone<'a> {
            unanswered: &'a Unanswered,
            owner: &'a str,
            until: Instant,
            answered: Option<tokio::sync::watch::Receiver<()>>,
        }
        impl Drop for Gone<'_> {
            fn drop(&mut self) {
                if let Some(rx) = self.answered.take() {
                    self.unanswered
                        .owners()
                        .insert(self.owner.to_owned(), (self.until, rx));
                }
            }
        }
        let (answered, rx) = tokio::sync::watch::channel(());
        let task = crate::driver::handle().spawn(async move {
            let answer = attempt.await;
            drop(answered);
            answer
        });
        let mut gone = Gone {
            unanswered: &self.unanswered,
            owner,
            // Its statements, one after the other.
            until: Instant::now() + self.timeout * 2,
            answered: Some(rx),
        };
        let answer = task.await;
        gone.answered = None;
        match answer {
            Ok(answer) => answer,
            // The runtime never aborts its tasks: a join error is a panic.
            Err(err) => std::panic::resume_unwind(err.into_panic()),
        }
    }

    /// Runs `statement` on a connection of the pool near this thread (see
    /// [`is_near`](Self::is_near)). `what` names it in a timeout error.
    pub(crate) async fn call<T, F>(&self, what: &str, statement: F) -> Result<T, BackendError>
    where
        F: for<'c> FnMut(&'c mut DB::Connection) -> BoxFuture<'c, Result<T, sqlx::Error>>,
    {
        self.call_inner(None, what, statement).await
    }

    /// [`call`](Self::call) for a statement of `owner`'s (an acquisition's
    /// attempt, its release): it goes out only once the server has answered
    /// every statement of `owner`'s that a caller dropped while it ran, so a
    /// clean-up release is ordered after the attempt it undoes.
    pub(crate) async fn call_for<T, F>(
        &self,
        owner: &str,
        what: &str,
        statement: F,
    ) -> Result<T, BackendError>
    where
        F: for<'c> FnMut(&'c mut DB::Connection) -> BoxFuture<'c, Result<T, sqlx::Error>>,
    {
        self.call_inner(Some(owner), what, statement).await
    }

    async fn call_inner<T, F>(
        &self,
        owner: Option<&str>,
        what: &str,
        mut statement: F,
    ) -> Result<T, BackendError>
    where
        F: for<'c> FnMut(&'c mut DB::Connection) -> BoxFuture<'c, Result<T, sqlx::Error>>,
    {
        if let Some(owner) = owner {
            self.unanswered.wait_for(owner).await;
        }
        let pool = self.near();
        let attempts = async {
            let mut dead = DeadConnections::new(pool.size() as usize);
            loop {
                // An error opening a connection ends the call: the server
                // cannot be reached, and trying again at once would not help.
                let conn = Checked::new(pool.acquire().await?);
                let mut running = Running {
                    conn: Some(conn),
                    owner,
                    unanswered: &self.unanswered,
                    timeout: self.timeout,
                };
                let answer = statement(running.conn()).await;
                let conn = running.finished();
                match answer {
                    Err(err) if is_connection_error(&err) => {
                        drop(conn);
                        if !dead.try_another(&err) {
                            return Err(err);
                        }
                    }
                    answer => {
                        conn.keep();
                        return answer;
                    }
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

/// The one connection-error policy of the SQL backends, in both modes: a
/// connection that fails in use (the server restarted, `KILL`ed it or ended
/// it with a message; a proxy reset it) is closed and the call goes on with
/// another — the server cannot have granted anything on a connection it
/// ended (a lease-table statement that ran before the connection died is
/// owner-checked and may run again; a session lock dies with its
/// connection). Every connection the pool held when the call began may be
/// found dead, once each; after that the call has met a new connection
/// failing in use, and the error is the server's.
pub(crate) struct DeadConnections {
    /// Connections that may still be found dead.
    left: usize,
}

impl DeadConnections {
    /// A call on a pool holding `pooled` connections now.
    pub(crate) fn new(pooled: usize) -> Self {
        DeadConnections { left: pooled + 1 }
    }

    /// Whether to try another connection after `err` on one in use.
    pub(crate) fn try_another(&mut self, err: &sqlx::Error) -> bool {
        if !is_connection_error(err)
            || matches!(err, sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed)
        {
            return false;
        }
        self.left = self.left.saturating_sub(1);
        self.left > 0
    }
}

/// The error of a call that did not answer in time.
pub(crate) fn timed_out(what: &str, after: Duration) -> BackendError {
    BackendError::transient(std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        format!("{what} did not answer within {after:?}"),
    ))
}

#[cfg(all(test, feature = "sqlite"))]
mod tests {
    use std::time::Instant;

    use sqlx::sqlite::{Sqlite, SqlitePoolOptions};

    use super::*;

    fn in_memory() -> BoxFuture<'static, Result<sqlx::Pool<Sqlite>, sqlx::Error>> {
        Box::pin(async {
            SqlitePoolOptions::new()
                .max_connections(1)
                .connect("sqlite::memory:")
                .await
        })
    }

    #[test]
    fn a_runtime_hops_home_until_its_own_pool_is_open_and_again_after_it_shut_down() {
        let home = crate::driver::handle()
            .block_on(in_memory())
            .expect("home pool");
        let db = Pooled::new(
            home,
            Duration::from_secs(5),
            BackendError::transient,
            Arc::new(in_memory),
        );
        for _ in 0..2 {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            runtime.block_on(async {
                assert!(!db.is_near(), "its pool opens in the background");
                let deadline = Instant::now() + Duration::from_secs(10);
                while !db.is_near() {
                    assert!(Instant::now() < deadline, "the local pool never opened");
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                let one: i64 = db
                    .call("one", |c| {
                        Box::pin(async move { sqlx::query_scalar("SELECT 1").fetch_one(c).await })
                    })
                    .await
                    .expect("a call on the local pool");
                assert_eq!(one, 1);
            });
            // Its pool dies with it: the next runtime hops until its own opens.
            drop(runtime);
        }
        let at_home = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime")
            .block_on(crate::driver::run(async move { db.is_near() }));
        assert!(at_home, "dlock's own runtime uses the home pool");
    }
}
