//! An owner's statements in the order they were sent: a statement whose
//! caller went away before the server answered it still runs there, so the
//! owner's next statement — the owner-checked undo of an abandoned
//! acquisition (its release, the removal of its waiting-writer mark) — is
//! sent only once the server has answered it. The order then holds at the
//! server, whichever connection or runtime each statement goes out on: an
//! answered statement has run (and committed) before the undo is sent.
//!
//! Each statement left running is tracked until it has been answered (or has
//! timed out: its connection is then closed), so the wait ends when the
//! statement does — never after a fixed time that a loaded machine can
//! outlast, sending the undo while the statement is still on its way.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

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

/// Work of an owner's the server may still be doing for a caller that went
/// away: a statement dropped while it ran, an attempt running on dlock's I/O
/// runtime. By owner token, each with the task that does it (`None`: a
/// statement) and a receiver that closes when it is done.
#[derive(Default)]
pub(crate) struct Unanswered {
    owners: Mutex<HashMap<String, Vec<Pending>>>,
}

/// How many owners may be tracked before those whose work is done are let go.
const PRUNE_AT: usize = 64;

struct Pending {
    /// The task doing it: that task's own statements do not wait for it.
    task: Option<tokio::task::Id>,
    done: tokio::sync::watch::Receiver<()>,
}

/// Dropped when the work it was registered for is done.
pub(crate) type Done = tokio::sync::watch::Sender<()>;

impl Unanswered {
    fn owners(&self) -> MutexGuard<'_, HashMap<String, Vec<Pending>>> {
        self.owners.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Makes `owner`'s statements wait until the returned sender is dropped
    /// (when the work is done). `task`, if given, is the task doing the work:
    /// its own statements go on without waiting for it.
    pub(crate) fn register(&self, owner: &str, task: Option<tokio::task::Id>) -> Done {
        let (done, rx) = tokio::sync::watch::channel(());
        self.register_receiver(owner, task, rx);
        done
    }

    /// [`register`](Self::register) with the receiver of a sender made
    /// beforehand.
    pub(crate) fn register_receiver(
        &self,
        owner: &str,
        task: Option<tokio::task::Id>,
        done: tokio::sync::watch::Receiver<()>,
    ) {
        let mut owners = self.owners();
        // Work nobody waited for (an owner with no statement after it) is
        // let go once done, so the map stays as small as the work running.
        if owners.len() >= PRUNE_AT {
            owners.retain(|_, pending| {
                pending.retain(|p| p.done.has_changed().is_ok());
                !pending.is_empty()
            });
        }
        owners
            .entry(owner.to_owned())
            .or_default()
            .push(Pending { task, done });
    }

    /// Waits until the work registered for `owner` is done (but for the
    /// current task's own).
    pub(crate) async fn wait_for(&self, owner: &str) {
        let me = tokio::task::try_id();
        loop {
            let next = {
                let mut owners = self.owners();
                let Some(pending) = owners.get_mut(owner) else {
                    return;
                };
                pending.retain(|p| p.done.has_changed().is_ok());
                if pending.is_empty() {
                    owners.remove(owner);
                    return;
                }
                pending
                    .iter()
                    .find(|p| p.task.is_none() || p.task != me)
                    .map(|p| p.done.clone())
            };
            let Some(mut done) = next else {
                return;
            };
            // Ends when the sender is dropped (no value is ever sent).
            let _ = done.changed().await;
        }
    }
}

/// A connection whose statement is running. Dropped before it is answered
/// (a caller that went away, a timeout), it is not closed: a task waits for
/// the server's answer on it (the statement runs to its end on the server
/// anyway), then gives the connection back — so callers that hang up cost
/// no connections — and until then the statements of its `owner`, if it
/// has one, wait (see [`Unanswered`]). A statement that is not answered
/// within `timeout` closes its connection (the server's own timeouts bound
/// it too).
pub(crate) struct Running<'a, DB: sqlx::Database> {
    conn: Option<Checked<DB>>,
    owner: Option<&'a str>,
    unanswered: &'a Arc<Unanswered>,
    timeout: Duration,
}

impl<'a, DB: sqlx::Database> Running<'a, DB> {
    /// `conn`, about to run a statement of `owner`'s (if any).
    pub(crate) fn new(
        conn: Checked<DB>,
        owner: Option<&'a str>,
        unanswered: &'a Arc<Unanswered>,
        timeout: Duration,
    ) -> Self {
        Running {
            conn: Some(conn),
            owner,
            unanswered,
            timeout,
        }
    }

    pub(crate) fn conn(&mut self) -> &mut DB::Connection {
        self.conn.as_mut().expect("present until finished").conn()
    }

    /// The statement answered: the connection, back.
    pub(crate) fn finished(mut self) -> Checked<DB> {
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
        // Registered before this returns, so before the caller's undo is
        // sent; dropped when the server has answered (or the task is dropped).
        let done = self
            .owner
            .map(|owner| self.unanswered.register(owner, None));
        let timeout = self.timeout;
        runtime.spawn(async move {
            // A round trip reads the dropped statement's answer first.
            use sqlx::Connection as _;
            if let Ok(Ok(())) = tokio::time::timeout(timeout, conn.conn().ping()).await {
                conn.keep();
            }
            drop(done);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Waits for `owner`'s work from a task of its own: the task.
    fn waiter(unanswered: &Arc<Unanswered>, owner: &'static str) -> tokio::task::JoinHandle<()> {
        let unanswered = unanswered.clone();
        tokio::spawn(async move { unanswered.wait_for(owner).await })
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_owners_statements_wait_for_its_unanswered_work_until_it_is_done() {
        let unanswered = Arc::new(Unanswered::default());
        let (first, second) = (
            unanswered.register("owner", None),
            unanswered.register("owner", None),
        );
        let waiting = waiter(&unanswered, "owner");
        // Another owner's statements go on at once.
        tokio::time::timeout(Duration::from_secs(10), unanswered.wait_for("other"))
            .await
            .expect("another owner does not wait");
        // Longer than any call timeout would be on a loaded machine's clock:
        // the wait is not for a time, but for the work.
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!waiting.is_finished(), "waits while both are running");
        drop(first);
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!waiting.is_finished(), "waits while one is running");
        drop(second);
        tokio::time::timeout(Duration::from_secs(10), waiting)
            .await
            .expect("ends once both are done")
            .expect("no panic");
        assert!(unanswered.owners().is_empty(), "nothing left tracked");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_task_doing_an_owners_work_does_not_wait_for_itself() {
        let unanswered = Arc::new(Unanswered::default());
        let (go, gone) = tokio::sync::oneshot::channel::<()>();
        let attempt = {
            let unanswered = unanswered.clone();
            tokio::spawn(async move {
                gone.await.expect("told to go");
                unanswered.wait_for("owner").await;
            })
        };
        // The caller went away: the attempt's task is registered as the
        // owner's work, running until it ends.
        let done = unanswered.register("owner", Some(attempt.id()));
        let undo = waiter(&unanswered, "owner");
        go.send(()).expect("the attempt waits");
        tokio::time::timeout(Duration::from_secs(10), attempt)
            .await
            .expect("the attempt's own statements go on")
            .expect("no panic");
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!undo.is_finished(), "the undo waits for the attempt");
        drop(done);
        tokio::time::timeout(Duration::from_secs(10), undo)
            .await
            .expect("the undo goes once the attempt is done")
            .expect("no panic");
    }
}
