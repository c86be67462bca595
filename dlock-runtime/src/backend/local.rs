//! A connection (or pool) on the application's runtime, beside the one on
//! dlock's own I/O runtime.
//!
//! A network client's connection runs on the runtime that opened it and dies
//! with that runtime. A backend that talks over one keeps two:
//!
//! - the **home** one, opened on dlock's I/O runtime, which lives as long as
//!   the process: always usable, from any runtime (from another, by a hop
//!   to dlock's runtime or to the connection's driver task there);
//! - a **local** one ([`Local`]), opened in the background on the
//!   application's runtime the first time a call comes from there, and used
//!   only by calls from that runtime: they then reach the socket without a
//!   hop between runtimes (a thread wake-up each way). Calls from any other
//!   runtime, and from dlock's I/O runtime (the watchdog's renewals), go
//!   home. A call never waits for the local one to open: until it is ready,
//!   calls go home.
//!
//! A sentinel task on the local one's runtime marks it dead when that runtime
//! shuts down (each `#[tokio::test]` has its own runtime); the next runtime
//! that calls gets a local one of its own. An opening that fails is tried
//! again by a call at least [`REOPEN_AFTER`] later.
//!
//! Each backend keeps what is its own beside it: how to open one (a Redis
//! multiplexed connection, a `sqlx` pool) and what to do with a call whose
//! local connection died under it.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use futures_util::future::BoxFuture;
use tokio_util::sync::CancellationToken;

/// How long to wait before opening a local one again after a failure.
const REOPEN_AFTER: Duration = Duration::from_secs(1);

/// Opens one more connection (or pool) on the current runtime; `None` if it
/// failed.
type Open<T> = Arc<dyn Fn() -> BoxFuture<'static, Option<T>> + Send + Sync>;

/// The local connection (or pool) `T`, opened lazily on the application's
/// runtime. See the [module docs](self).
pub(crate) struct Local<T> {
    open: Open<T>,
    /// Bounds the opening.
    timeout: Duration,
    state: Arc<Mutex<State<T>>>,
}

/// A local connection (or pool) open on the current thread's runtime.
pub(crate) struct Opened<T> {
    pub(crate) value: T,
    /// Cancelled once its runtime has shut down: a call that failed on it
    /// may then be sent again over the home one (the Redis backends do).
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) alive: CancellationToken,
}

enum State<T> {
    Closed {
        reopen_at: Option<Instant>,
    },
    Opening,
    Open {
        value: T,
        alive: CancellationToken,
        /// The runtime that drives it.
        runtime: tokio::runtime::Id,
    },
}

impl<T: Clone + Send + 'static> Local<T> {
    /// None open yet: the first call from an application's runtime starts
    /// opening one with `open`, bounded by `timeout`.
    pub(crate) fn new<E, F>(timeout: Duration, open: F) -> Local<T>
    where
        F: Fn() -> BoxFuture<'static, Result<T, E>> + Send + Sync + 'static,
        E: 'static,
    {
        Local {
            open: Arc::new(move || {
                let opening = open();
                Box::pin(async move { opening.await.ok() })
            }),
            timeout,
            state: Arc::new(Mutex::new(State::Closed { reopen_at: None })),
        }
    }

    /// The local one for a call from the current thread, if one is open on
    /// this thread's runtime; `None` means: go home (always so on dlock's I/O
    /// runtime). When none is open or opening (and the last failure is more
    /// than [`REOPEN_AFTER`] ago), this starts opening one in the background
    /// on this runtime; it never waits for it.
    pub(crate) fn get(&self) -> Option<Opened<T>> {
        if crate::driver::on_io_runtime() {
            return None;
        }
        let runtime = tokio::runtime::Handle::try_current().ok()?;
        let mut state = lock(&self.state);
        match &*state {
            // Only from its own runtime: another runtime's connection is
            // driven only while that runtime runs (a current-thread runtime
            // blocked in a synchronous call would stall our call).
            State::Open {
                value,
                alive,
                runtime: opened_on,
            } if !alive.is_cancelled() => {
                return (*opened_on == runtime.id()).then(|| Opened {
                    value: value.clone(),
                    alive: alive.clone(),
                });
            }
            State::Opening => return None,
            State::Closed {
                reopen_at: Some(at),
            } if Instant::now() < *at => return None,
            _ => {}
        }
        *state = State::Opening;
        drop(state);
        let sentinel = Sentinel {
            state: self.state.clone(),
            alive: CancellationToken::new(),
        };
        let (open, timeout, runtime_id) = (self.open.clone(), self.timeout, runtime.id());
        runtime.spawn(async move {
            match tokio::time::timeout(timeout, open()).await {
                Ok(Some(value)) => {
                    *lock(&sentinel.state) = State::Open {
                        value,
                        alive: sentinel.alive.clone(),
                        runtime: runtime_id,
                    };
                    // Lives as long as the runtime; dropped when it shuts down.
                    std::future::pending::<()>().await;
                }
                _ => {
                    *lock(&sentinel.state) = State::Closed {
                        reopen_at: Some(Instant::now() + REOPEN_AFTER),
                    };
                }
            }
        });
        None
    }
}

/// Held by the task that owns the local one's life: when the task is dropped
/// (its runtime shut down), it is marked dead (and let go when the next
/// runtime opens its own).
struct Sentinel<T> {
    state: Arc<Mutex<State<T>>>,
    alive: CancellationToken,
}

impl<T> Drop for Sentinel<T> {
    fn drop(&mut self) {
        // Under the lock: a call never finds it dead and starts opening a
        // new one that this would then mark closed.
        let mut state = lock(&self.state);
        self.alive.cancel();
        if matches!(*state, State::Opening) {
            *state = State::Closed { reopen_at: None };
        }
    }
}

/// The state is a few plain fields: a panic elsewhere cannot leave it half
/// written, so a poisoned lock is still usable.
fn lock<T>(state: &Mutex<State<T>>) -> MutexGuard<'_, State<T>> {
    state.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};

    use super::*;

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime")
    }

    /// Polls `local` from the current runtime until it answers, within 10 s.
    async fn opened<T: Clone + Send + 'static>(local: &Local<T>) -> Opened<T> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(opened) = local.get() {
                return opened;
            }
            assert!(Instant::now() < deadline, "the local one never opened");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// A local "connection" that says which opening it was.
    fn counting(opens: &Arc<AtomicU32>) -> Local<u32> {
        let opens = opens.clone();
        Local::new(Duration::from_secs(5), move || {
            let n = opens.fetch_add(1, Ordering::SeqCst) + 1;
            Box::pin(async move { Ok::<_, ()>(n) })
        })
    }

    #[test]
    fn each_runtime_gets_its_own_after_the_last_one_shut_down() {
        let opens = Arc::new(AtomicU32::new(0));
        let local = counting(&opens);
        let first = runtime();
        let alive = first.block_on(async {
            assert!(local.get().is_none(), "it opens in the background");
            let opened = opened(&local).await;
            assert_eq!(opened.value, 1);
            assert!(!opened.alive.is_cancelled());
            assert_eq!(local.get().map(|o| o.value), Some(1), "opened once");
            opened.alive
        });
        // Another runtime, while the first lives: home, and nothing opened.
        runtime().block_on(async {
            assert!(local.get().is_none());
        });
        assert_eq!(opens.load(Ordering::SeqCst), 1);
        drop(first);
        assert!(alive.is_cancelled(), "its runtime shut down");
        let second = runtime().block_on(async { opened(&local).await.value });
        assert_eq!(second, 2, "the next runtime opens its own");
    }

    #[test]
    fn dlock_runtime_goes_home() {
        let opens = Arc::new(AtomicU32::new(0));
        let local = counting(&opens);
        let at_home = runtime().block_on(crate::driver::run(async move {
            (0..3).all(|_| local.get().is_none())
        }));
        assert!(at_home, "dlock's own runtime uses the home one");
        assert_eq!(opens.load(Ordering::SeqCst), 0, "and opens none");
    }

    #[test]
    fn a_failed_opening_is_tried_again_after_a_pause() {
        let opens = Arc::new(AtomicU32::new(0));
        let counter = opens.clone();
        let local = Local::new(Duration::from_secs(5), move || {
            let n = counter.fetch_add(1, Ordering::SeqCst) + 1;
            Box::pin(async move { if n == 1 { Err("refused") } else { Ok(n) } })
        });
        runtime().block_on(async {
            assert!(local.get().is_none());
            let deadline = Instant::now() + Duration::from_secs(10);
            let reopen_at = loop {
                if let State::Closed {
                    reopen_at: Some(at),
                } = *lock(&local.state)
                {
                    break at;
                }
                assert!(Instant::now() < deadline, "the opening never failed");
                tokio::time::sleep(Duration::from_millis(5)).await;
            };
            let again = local.get();
            if Instant::now() < reopen_at {
                assert!(again.is_none());
                assert_eq!(
                    opens.load(Ordering::SeqCst),
                    1,
                    "not again before the pause"
                );
            }
            assert_eq!(opened(&local).await.value, 2);
            assert!(
                Instant::now() >= reopen_at,
                "opened again only after the pause"
            );
        });
    }
}
