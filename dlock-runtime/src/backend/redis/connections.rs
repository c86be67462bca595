//! Where the Redis backends' commands go.
//!
//! A redis-crate connection runs its driver task on the runtime that opened it
//! and dies with that runtime. dlock keeps two for each server (for the one
//! server or cluster of `redis://`, for each master of `redlock://`):
//!
//! - the **home** connection, opened on dlock's own I/O runtime, which lives
//!   as long as the process: always usable, from any runtime;
//! - a **local** connection ([`Local`]), opened in the background on the
//!   application's runtime the first time a command comes from there, and
//!   used only by commands from that runtime. They then reach the socket
//!   without a hop between runtimes (a thread wake-up each way, which costs
//!   about a third of the throughput of a lock at concurrency 1 on loopback).
//!   Commands from any other runtime, and from dlock's I/O runtime (the
//!   watchdog's renewals), go home. A command never waits for the local
//!   connection to open: until it is ready, commands go home.
//!
//! A sentinel task on the local connection's runtime marks it dead when that
//! runtime shuts down (each `#[tokio::test]` has its own runtime): commands go
//! home again, and the next runtime that calls gets a local connection of its
//! own. A command that fails because its local connection died under it is
//! sent once more over the home connection.
//!
//! [`Connections`] is the pair for `redis://`, whose home connection is opened
//! with the backend. Redlock keeps its own home connection per master (opened
//! by a reconnect task, see `redlock.rs`) and a [`Local`] next to it.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster_async::ClusterConnection;
use redis::{Client, Cmd, Pipeline, RedisError, RedisFuture, Value};
use tokio_util::sync::CancellationToken;

use super::{Target, Topology, client};

/// One multiplexed connection: to a single server, or to a cluster.
#[derive(Clone)]
pub(super) enum Conn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Conn::Single(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
        }
    }
}

/// How long to wait before opening a local connection again after a failure.
const REOPEN_AFTER: Duration = Duration::from_secs(1);

/// How to open one more connection to a server (or cluster): the home one,
/// and the local ones.
pub(super) struct Opener {
    how: How,
    /// Bounds the opening of a local connection, and every command.
    timeout: Duration,
}

enum How {
    Single {
        client: Client,
        config: Box<ConnectionManagerConfig>,
    },
    Cluster {
        nodes: Vec<String>,
        tls_ca: Option<Vec<u8>>,
    },
}

impl Opener {
    /// A managed connection to one server: every command bounded by
    /// `timeout`, tried once more after a reconnection; reconnections back off
    /// up to `max_delay`.
    pub(super) fn single(client: Client, timeout: Duration, max_delay: Duration) -> Opener {
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(timeout))
            .set_response_timeout(Some(timeout))
            .set_number_of_retries(1)
            .set_max_delay(max_delay);
        Opener {
            how: How::Single {
                client,
                config: Box::new(config),
            },
            timeout,
        }
    }

    fn is_cluster(&self) -> bool {
        matches!(self.how, How::Cluster { .. })
    }

    /// Opens a connection whose driver runs on the current runtime.
    pub(super) async fn open(&self) -> Result<Conn, RedisError> {
        match &self.how {
            How::Cluster { nodes, tls_ca } => Ok(Conn::Cluster(
                cluster_builder(nodes, tls_ca, self.timeout)
                    .build()?
                    .get_async_connection()
                    .await?,
            )),
            How::Single { client, config } => Ok(Conn::Single(
                client
                    .get_connection_manager_with_config((**config).clone())
                    .await?,
            )),
        }
    }
}

/// A cluster client for the seed `nodes`: every command bounded by `timeout`,
/// tried once more after a redirection or a reconnection.
pub(super) fn cluster_builder(
    nodes: &[String],
    tls_ca: &Option<Vec<u8>>,
    timeout: Duration,
) -> redis::cluster::ClusterClientBuilder {
    let mut builder = redis::cluster::ClusterClient::builder(nodes.to_vec())
        .connection_timeout(timeout)
        .response_timeout(timeout)
        .retries(1);
    if let Some(ca) = tls_ca {
        builder = builder.certs(redis::TlsCertificates {
            client_tls: None,
            root_cert: Some(ca.clone()),
        });
    }
    builder
}

enum LocalState {
    Closed {
        reopen_at: Option<Instant>,
    },
    Opening,
    Open {
        conn: Conn,
        alive: CancellationToken,
        /// The runtime that drives it.
        runtime: tokio::runtime::Id,
    },
}

/// The local connection to one server (or cluster), opened lazily on the
/// application's runtime. See the [module docs](self).
pub(super) struct Local {
    opener: Arc<Opener>,
    state: Arc<Mutex<LocalState>>,
}

impl Local {
    /// None open yet: the first command from an application's runtime starts
    /// opening one with `opener`.
    pub(super) fn new(opener: Arc<Opener>) -> Local {
        Local {
            opener,
            state: Arc::new(Mutex::new(LocalState::Closed { reopen_at: None })),
        }
    }

    /// The local connection for a command from the current thread, if one is
    /// open on this thread's runtime. `None` means: send it home. When none is
    /// open or opening (and the last failure is more than [`REOPEN_AFTER`]
    /// ago), this starts opening one in the background on this runtime; it
    /// never waits for it.
    pub(super) fn route(&self) -> Option<Route> {
        if crate::driver::on_io_runtime() {
            return None;
        }
        let runtime = tokio::runtime::Handle::try_current().ok()?;
        let mut state = lock(&self.state);
        match &*state {
            // Only from its own runtime: another runtime's connection is
            // driven only while that runtime runs (a current-thread runtime
            // blocked in a synchronous call would stall our command).
            LocalState::Open {
                conn,
                alive,
                runtime: opened_on,
            } if !alive.is_cancelled() => {
                if *opened_on != runtime.id() {
                    return None;
                }
                return Some(Route {
                    conn: conn.clone(),
                    alive: Some(alive.clone()),
                });
            }
            LocalState::Opening => return None,
            LocalState::Closed {
                reopen_at: Some(at),
            } if Instant::now() < *at => return None,
            _ => {}
        }
        *state = LocalState::Opening;
        drop(state);
        let sentinel = Sentinel {
            state: self.state.clone(),
            alive: CancellationToken::new(),
        };
        let opener = self.opener.clone();
        let runtime_id = runtime.id();
        runtime.spawn(async move {
            match tokio::time::timeout(opener.timeout, opener.open()).await {
                Ok(Ok(conn)) => {
                    *lock(&sentinel.state) = LocalState::Open {
                        conn,
                        alive: sentinel.alive.clone(),
                        runtime: runtime_id,
                    };
                    // Lives as long as the runtime; dropped when it shuts down.
                    std::future::pending::<()>().await;
                }
                _ => {
                    *lock(&sentinel.state) = LocalState::Closed {
                        reopen_at: Some(Instant::now() + REOPEN_AFTER),
                    };
                }
            }
        });
        None
    }
}

/// The home connection and the local one of `redis://`. See the
/// [module docs](self).
pub(super) struct Connections {
    home: Conn,
    local: Local,
}

/// The connection for one command, and how to tell that it died under it.
#[derive(Clone)]
pub(super) struct Route {
    pub(super) conn: Conn,
    alive: Option<CancellationToken>,
}

impl Route {
    /// The home connection `conn`.
    pub(super) fn home(conn: Conn) -> Route {
        Route { conn, alive: None }
    }

    /// Whether this is a local connection (not the home one).
    pub(super) fn is_local(&self) -> bool {
        self.alive.is_some()
    }

    /// Whether this was a local connection whose runtime has shut down since.
    pub(super) fn died(&self) -> bool {
        self.alive.as_ref().is_some_and(|a| a.is_cancelled())
    }
}

impl Connections {
    /// Opens the home connection (on dlock's I/O runtime).
    pub(super) async fn open(target: &Target, timeout: Duration) -> Result<Self, RedisError> {
        let opener = Arc::new(if target.topology == Topology::Cluster {
            Opener {
                how: How::Cluster {
                    nodes: target.nodes.clone(),
                    tls_ca: target.tls_ca.clone(),
                },
                timeout,
            }
        } else {
            Opener::single(
                client(&target.nodes[0], &target.tls_ca)?,
                timeout,
                Duration::from_millis(500),
            )
        });
        let home = crate::driver::run({
            let opener = opener.clone();
            async move { opener.open().await }
        })
        .await?;
        Ok(Connections {
            home,
            local: Local::new(opener),
        })
    }

    pub(super) fn is_cluster(&self) -> bool {
        self.local.opener.is_cluster()
    }

    /// The home connection, usable from anywhere.
    pub(super) fn home(&self) -> Conn {
        self.home.clone()
    }

    /// The connection for a command from the current thread: the local one
    /// when it is open, else the home one (and the local one starts opening).
    pub(super) fn route(&self) -> Route {
        self.local
            .route()
            .unwrap_or_else(|| Route::home(self.home.clone()))
    }
}

/// Held by the task that owns the local connection's life: when the task is
/// dropped (its runtime shut down), the connection is marked dead.
struct Sentinel {
    state: Arc<Mutex<LocalState>>,
    alive: CancellationToken,
}

impl Drop for Sentinel {
    fn drop(&mut self) {
        self.alive.cancel();
        let mut state = lock(&self.state);
        if matches!(*state, LocalState::Opening) {
            *state = LocalState::Closed { reopen_at: None };
        }
    }
}

/// The state is a few plain fields: a panic elsewhere cannot leave it half
/// written, so a poisoned lock is still usable.
fn lock(state: &Mutex<LocalState>) -> MutexGuard<'_, LocalState> {
    state.lock().unwrap_or_else(|e| e.into_inner())
}
