//! One Redlock master: its home connection, opened by a connection task, its
//! local one, and its pub/sub listener. See **Connections** in the [Redlock
//! backend's docs](super).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use rand::Rng;
use redis::{Client, ScriptInvocation};
use tokio::sync::watch;

use crate::backend::local::Local;
use crate::backend::redis::conn::{Conn, Opener, local};
use crate::backend::redis::connections::{Route, call};
use crate::backend::redis::listener::{Listener, Source};
use crate::error::BackendError;

/// The pause after a node's first failed connection attempt; it doubles after
/// every further failure, up to [`RECONNECT_MAX`] (plus up to a quarter of
/// jitter).
const RECONNECT_FIRST: Duration = Duration::from_millis(100);
/// The longest pause between two connection attempts to a node that has never answered.
const RECONNECT_MAX: Duration = Duration::from_secs(2);
/// The longest pause between two reconnections of an open managed connection.
const MANAGED_RECONNECT_MAX: Duration = Duration::from_millis(200);

/// One master: its home connection, as its connection task publishes it, its
/// local connection, and its pub/sub listener.
pub(super) struct Node {
    /// The node's place in the URL (from 1) and its address, for messages.
    number: usize,
    address: String,
    state: watch::Receiver<NodeState>,
    local: Local<Conn>,
    pub(super) listener: Listener,
}

/// What a node's connection task publishes.
enum NodeState {
    /// The first connection attempt is under way.
    Connecting,
    /// The last attempt failed (why); the next one is scheduled.
    Down(String),
    /// Open: the manager reconnects by itself from now on.
    Up(Conn),
}

impl Node {
    /// Starts the node's connection task and its listener on dlock's I/O runtime.
    pub(super) fn start(number: usize, client: Client, timeout: Duration) -> Node {
        let opener = Arc::new(Opener::single(
            client.clone(),
            timeout,
            MANAGED_RECONNECT_MAX,
        ));
        let (state, receiver) = watch::channel(NodeState::Connecting);
        crate::driver::handle().spawn(keep_connecting(opener.clone(), timeout, state));
        Node {
            number,
            address: client.get_connection_info().addr().to_string(),
            state: receiver,
            local: local(&opener),
            listener: Listener::start(Source::Plain(client), timeout),
        }
    }

    /// The node's home connection, at once, or a transient error while the
    /// node has never answered (its connection task is still trying). Never
    /// waits for a connection.
    pub(super) fn home(&self) -> Result<Conn, BackendError> {
        match &*self.state.borrow() {
            NodeState::Up(conn) => Ok(conn.clone()),
            NodeState::Connecting => Err(BackendError::transient(format!(
                "redlock: node {} ({}) is not connected yet (connecting)",
                self.number, self.address
            ))),
            NodeState::Down(why) => Err(BackendError::transient(format!(
                "redlock: node {} ({}) is down (reconnecting): {why}",
                self.number, self.address
            ))),
        }
    }

    /// Waits until the node's first connection attempt has ended.
    pub(super) async fn first_attempt(&self) {
        let mut state = self.state.clone();
        // An error only if the task is gone, which it is not while `self` lives.
        let _ = state
            .wait_for(|s| !matches!(s, NodeState::Connecting))
            .await;
    }

    /// The connection for a command from the current thread: the local one
    /// when it is open on this runtime, else the home one. A transient error,
    /// at once, while the node has never answered. Never waits for a
    /// connection.
    pub(super) fn route(&self) -> Result<Route, BackendError> {
        let home = self.home()?;
        Ok(Route::pick(&self.local, home))
    }

    /// One call of `invocation` over `route`, sent once more over home if
    /// `route` was a local connection that died under it; both bounded by
    /// `timeout`.
    pub(super) async fn invoke<T: redis::FromRedisValue>(
        &self,
        route: &Route,
        invocation: &ScriptInvocation<'_>,
        timeout: Duration,
    ) -> Result<T, BackendError> {
        within(
            timeout,
            route.send(|| self.home(), |conn| call(conn, invocation)),
        )
        .await
    }

    /// [`invoke`](Self::invoke) for a pipeline.
    pub(super) async fn query<T: redis::FromRedisValue>(
        &self,
        route: &Route,
        pipe: &redis::Pipeline,
        timeout: Duration,
    ) -> Result<T, BackendError> {
        within(
            timeout,
            route.send(
                || self.home(),
                |mut conn| async move { pipe.query_async(&mut conn).await },
            ),
        )
        .await
    }
}

/// `answer`, or a node timeout error after `timeout`.
async fn within<T>(
    timeout: Duration,
    answer: impl Future<Output = Result<T, BackendError>>,
) -> Result<T, BackendError> {
    tokio::time::timeout(timeout, answer)
        .await
        .unwrap_or_else(|_| Err(node_timeout_error(timeout)))
}

/// Connects to one node on dlock's I/O runtime until it answers once, with a
/// capped exponential back-off between attempts, and publishes the outcome of
/// every attempt in `state`. Once open, the managed connection reconnects by
/// itself and the task ends; it also ends when the backend (every receiver of
/// `state`) is dropped.
async fn keep_connecting(opener: Arc<Opener>, timeout: Duration, state: watch::Sender<NodeState>) {
    let mut pause = RECONNECT_FIRST;
    loop {
        let attempt = tokio::time::timeout(timeout, opener.open());
        let outcome = tokio::select! {
            () = state.closed() => return,
            outcome = attempt => outcome,
        };
        match outcome {
            Ok(Ok(conn)) => {
                state.send_replace(NodeState::Up(conn));
                return;
            }
            Ok(Err(err)) => state.send_replace(NodeState::Down(err.to_string())),
            Err(_) => state.send_replace(NodeState::Down(format!(
                "no connection within {}",
                humantime::format_duration(timeout)
            ))),
        };
        let jitter = rand::rng().random_range(Duration::ZERO..=pause / 4);
        tokio::select! {
            () = state.closed() => return,
            () = tokio::time::sleep(pause + jitter) => {}
        }
        pause = (pause * 2).min(RECONNECT_MAX);
    }
}

pub(super) fn node_timeout_error(timeout: Duration) -> BackendError {
    BackendError::transient(format!(
        "redlock: a node did not answer within {}",
        humantime::format_duration(timeout)
    ))
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;

    /// A node that never answered fails at once with a transient error, is
    /// retried by its one connection task with a back-off (not once per call),
    /// and that task ends when the node is dropped.
    #[tokio::test]
    async fn a_node_that_never_answered_fails_fast_and_its_task_ends_with_it() {
        use std::sync::Arc;
        use std::sync::atomic::{AtomicUsize, Ordering};

        // Accepts connections, counts them and closes them at once.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let accepts = Arc::new(AtomicUsize::new(0));
        let counter = accepts.clone();
        tokio::spawn(async move {
            while let Ok((socket, _)) = listener.accept().await {
                counter.fetch_add(1, Ordering::SeqCst);
                drop(socket);
            }
        });
        let timeout = Duration::from_millis(100);
        let client = Client::open(format!("redis://127.0.0.1:{port}/")).unwrap();
        let node = Node::start(3, client, timeout);
        tokio::time::timeout(timeout * 3, node.first_attempt())
            .await
            .expect("the first attempt ends within its bound");
        let started = Instant::now();
        for _ in 0..1000 {
            let Err(err) = node.route() else {
                panic!("a node that never answered has no connection")
            };
            assert!(err.is_retryable(), "{err}");
            assert!(
                err.to_string()
                    .contains(&format!("node 3 (127.0.0.1:{port}) is down (reconnecting)")),
                "{err}"
            );
        }
        assert!(started.elapsed() < Duration::from_millis(100));
        // 1000 calls, a few connection attempts (the task's rounds, two
        // connections each at most, and the listener's).
        tokio::time::sleep(Duration::from_millis(500)).await;
        let seen = accepts.load(Ordering::SeqCst);
        assert!((1..=12).contains(&seen), "{seen} connections");
        drop(node);
        tokio::time::sleep(timeout * 3).await;
        let seen = accepts.load(Ordering::SeqCst);
        tokio::time::sleep(RECONNECT_MAX + Duration::from_millis(700)).await;
        assert_eq!(
            accepts.load(Ordering::SeqCst),
            seen,
            "the connection task outlived its node"
        );
    }
}
