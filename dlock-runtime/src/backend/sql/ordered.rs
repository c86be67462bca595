//! An owner's undo after the work it undoes: the owner-checked release of
//! an abandoned acquisition, and the removal of its waiting-writer mark,
//! reach the server after every statement of that owner's that may still
//! run there.
//!
//! **Work on dlock's I/O runtime.** A waiting-writer mark is only ever sent
//! from a task there ([`Unanswered::detached`]), as is an attempt a caller
//! hops home for; the owner's later statements wait until that task has
//! ended — for as long as it takes, never for a fixed time a loaded machine
//! can outlast. That wait depends on nothing but dlock's own runtime, which
//! always runs: the task's statements are each bounded by the call timeout,
//! and a statement dropped there (its timeout) is waited for on that
//! runtime too, until the server answered it or its connection closed.
//! Each such record is made before the task starts, so before the caller
//! could go away and before any undo is sent; and it is settled by the task
//! itself, when it ends. So: mark sent → answered (or its connection closed)
//! → record settled → the undo goes out, whichever connection or runtime it
//! takes. The undo cannot miss the mark, nor can the mark land after it.
//!
//! **Work on the caller's runtime.** A statement dropped while it ran on a
//! connection of the caller's runtime is drained by a task on that runtime,
//! which may never run again (a runtime left idle, or shut down). The
//! owner's statements wait for it one call timeout at most: long enough for
//! a server that answers, and never stuck behind a runtime that does not
//! run (the runtime's backstop release, sent from dlock's runtime, then
//! frees what such a statement took). No mark is sent from there.
//!
//! Work done *for* an owner on dlock's runtime (inside
//! [`detached`](Unanswered::detached)) never waits for the owner's records:
//! those are what the undo waits for, and some are settled only once that
//! very work ends.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Mutex, MutexGuard};
use std::time::Instant;

tokio::task_local! {
    /// The owner whose work the current task does on dlock's I/O runtime.
    static DOING: String;
}

/// How many owners may be tracked before those whose work is done are let go.
const PRUNE_AT: usize = 64;

/// Work of owners' the server may still be doing, by owner token.
#[derive(Default)]
pub(crate) struct Unanswered {
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    owners: HashMap<String, Vec<Pending>>,
    /// The number of tracked owners at which the settled ones are let go.
    prune_at: usize,
}

struct Pending {
    /// How long the owner's statements wait for it at most: `None` for work
    /// on dlock's I/O runtime (settled there, always), the call timeout for
    /// a statement drained on the caller's runtime.
    until: Option<Instant>,
    /// Closes when the work is done.
    done: tokio::sync::watch::Receiver<()>,
}

impl Pending {
    fn is_live(&self, now: Instant) -> bool {
        self.done.has_changed().is_ok() && self.until.is_none_or(|until| now < until)
    }
}

/// Dropped when the work it was registered for is done.
pub(crate) type Done = tokio::sync::watch::Sender<()>;

impl Unanswered {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Makes `owner`'s statements wait until the returned sender is
    /// dropped, or until `until` when given. Work settled on dlock's I/O
    /// runtime has no `until`; work settled on any other runtime must have
    /// one (that runtime may never run again).
    pub(crate) fn register(&self, owner: &str, until: Option<Instant>) -> Done {
        let (done, rx) = tokio::sync::watch::channel(());
        let now = Instant::now();
        let mut state = self.state();
        // Work nobody waited for (an owner with no statement after it) is
        // let go once settled; pruned each time the map has doubled, so a
        // registration costs O(1) amortized.
        if state.owners.len() >= state.prune_at.max(PRUNE_AT) {
            state.owners.retain(|_, pending| {
                pending.retain(|p| p.is_live(now));
                !pending.is_empty()
            });
            state.prune_at = state.owners.len() * 2;
        }
        let pending = state.owners.entry(owner.to_owned()).or_default();
        pending.retain(|p| p.is_live(now));
        pending.push(Pending { until, done: rx });
        done
    }

    /// Waits until the work registered for `owner` is done (each record for
    /// its `until` at most), unless the current task is itself doing work
    /// for `owner` (see the module docs).
    pub(crate) async fn wait_for(&self, owner: &str) {
        if DOING.try_with(|doing| doing == owner).unwrap_or(false) {
            return;
        }
        loop {
            // Looked up again after each wait: work may register more work
            // of the owner's before it ends (an attempt, its mark).
            let next = {
                let now = Instant::now();
                let mut state = self.state();
                let Some(pending) = state.owners.get_mut(owner) else {
                    return;
                };
                pending.retain(|p| p.is_live(now));
                match pending.first() {
                    Some(p) => (p.until, p.done.clone()),
                    None => {
                        state.owners.remove(owner);
                        return;
                    }
                }
            };
            let (until, mut done) = next;
            // Ends when the sender is dropped (no value is ever sent).
            match until {
                Some(until) => {
                    let _ = tokio::time::timeout_at(until.into(), done.changed()).await;
                }
                None => {
                    let _ = done.changed().await;
                }
            }
        }
    }

    /// Runs `work`, `owner`'s, in a task on dlock's I/O runtime that the
    /// caller's going away does not stop, and answers its output. The
    /// owner's statements wait until it has ended — registered before the
    /// task is spawned, so before this can be dropped — but for the task's
    /// own, which do not wait for the owner's records at all.
    pub(crate) async fn detached<T, F>(&self, owner: &str, work: F) -> T
    where
        T: Send + 'static,
        F: Future<Output = T> + Send + 'static,
    {
        let done = self.register(owner, None);
        let task = crate::driver::handle().spawn(DOING.scope(owner.to_owned(), async move {
            let output = work.await;
            drop(done);
            output
        }));
        match task.await {
            Ok(output) => output,
            // The runtime never aborts its tasks: a join error is a panic.
            Err(err) => std::panic::resume_unwind(err.into_panic()),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;

    /// Waits for `owner`'s work from a task of its own.
    fn waiter(unanswered: &Arc<Unanswered>, owner: &'static str) -> tokio::task::JoinHandle<()> {
        let unanswered = unanswered.clone();
        tokio::spawn(async move { unanswered.wait_for(owner).await })
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_owners_statements_wait_for_its_work_on_dlocks_runtime_until_it_is_done() {
        let unanswered = Arc::new(Unanswered::default());
        let (first, second) = (
            unanswered.register("owner", None),
            unanswered.register("owner", None),
        );
        let waiting = waiter(&unanswered, "owner");
        tokio::time::timeout(Duration::from_secs(10), unanswered.wait_for("other"))
            .await
            .expect("another owner does not wait");
        // The wait is not for a time, but for the work.
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
        assert!(unanswered.state().owners.is_empty(), "nothing left tracked");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn work_settled_on_another_runtime_is_waited_for_until_its_bound() {
        let unanswered = Arc::new(Unanswered::default());
        let started = Instant::now();
        // Never settled: its runtime does not run again.
        let _stuck = unanswered.register("owner", Some(started + Duration::from_millis(300)));
        tokio::time::timeout(Duration::from_secs(10), unanswered.wait_for("owner"))
            .await
            .expect("the wait ends at the bound");
        assert!(started.elapsed() >= Duration::from_millis(300), "waited");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn detached_work_goes_on_after_its_caller_left_and_the_owner_waits_for_it() {
        let unanswered = Arc::new(Unanswered::default());
        let (go, gone) = tokio::sync::oneshot::channel::<()>();
        let (ran, mut ran_rx) = tokio::sync::mpsc::unbounded_channel();
        let caller = {
            let unanswered = unanswered.clone();
            tokio::spawn(async move {
                let inner = unanswered.clone();
                unanswered
                    .detached("owner", async move {
                        // Its own statements do not wait for the owner's work.
                        inner.wait_for("owner").await;
                        gone.await.expect("told to go");
                        ran.send(()).expect("the test listens");
                    })
                    .await;
            })
        };
        tokio::time::sleep(Duration::from_millis(100)).await;
        // The caller goes away; the work does not.
        caller.abort();
        let _ = caller.await;
        let undo = waiter(&unanswered, "owner");
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!undo.is_finished(), "the undo waits for the work");
        go.send(()).expect("the work waits");
        tokio::time::timeout(Duration::from_secs(10), undo)
            .await
            .expect("the undo goes once the work is done")
            .expect("no panic");
        assert!(ran_rx.try_recv().is_ok(), "the work ran to its end first");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn settled_owners_are_let_go_once_many_are_tracked() {
        let unanswered = Unanswered::default();
        for i in 0..PRUNE_AT * 4 {
            drop(unanswered.register(&format!("owner-{i}"), None));
        }
        let tracked = unanswered.state().owners.len();
        assert!(tracked <= PRUNE_AT, "{tracked} owners tracked");
    }
}
