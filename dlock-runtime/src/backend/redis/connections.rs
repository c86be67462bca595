//! Where the Redis backend's commands go.
//!
//! A redis-crate connection runs its driver task on the runtime that opened it
//! and dies with that runtime. dlock keeps two:
//!
//! - the **home** connection, opened on dlock's own I/O runtime, which lives
//!   as long as the process: always usable, from any runtime;
//! - a **local** connection, opened in the background on the application's
//!   runtime the first time a command comes from there, and used only by
//!   commands from that runtime. They then reach the socket without a hop
//!   between runtimes (a thread wake-up each way, which costs about a third
//!   of the throughput of a lock at concurrency 1 on loopback). Commands from
//!   any other runtime go home.
//!
//! A sentinel task on the local connection's runtime marks it dead when that
//! runtime shuts down (each `#[tokio::test]` has its own runtime): commands go
//! home again, and the next runtime that calls gets a local connection of its
//! own. A command that fails because its local connection died under it is
//! sent once more over the home connection.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use redis::RedisError;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster_async::ClusterConnection;
use tokio_util::sync::CancellationToken;

use super::{Target, Topology, client};

/// One multiplexed connection: to a single server, or to a cluster.
#[derive(Clone)]
pub(super) enum Conn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

/// How long to wait before opening a local connection again after a failure.
const REOPEN_AFTER: Duration = Duration::from_secs(1);

/// How to open a connection: what the URL said.
struct Opener {
    cluster: bool,
    nodes: Vec<String>,
    tls_ca: Option<Vec<u8>>,
    timeout: Duration,
}

impl Opener {
    /// Opens a connection whose driver runs on the current runtime.
    async fn open(&self) -> Result<Conn, RedisError> {
        if self.cluster {
            Ok(Conn::Cluster(
                cluster_builder(&self.nodes, &self.tls_ca, self.timeout)
                    .build()?
                    .get_async_connection()
                    .await?,
            ))
        } else {
            let config = ConnectionManagerConfig::new()
                .set_connection_timeout(Some(self.timeout))
                .set_response_timeout(Some(self.timeout))
                .set_number_of_retries(1)
                .set_max_delay(Duration::from_millis(500));
            let manager = client(&self.nodes[0], &self.tls_ca)?
                .get_connection_manager_with_config(config)
                .await?;
            Ok(Conn::Single(manager))
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

enum Local {
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

/// The home connection and the local one. See the [module docs](self).
pub(super) struct Connections {
    opener: Arc<Opener>,
    home: Conn,
    local: Arc<Mutex<Local>>,
}

/// The connection for one command, and how to tell that it died under it.
pub(super) struct Route {
    pub(super) conn: Conn,
    alive: Option<CancellationToken>,
}

impl Route {
    /// Whether this was a local connection whose runtime has shut down since.
    pub(super) fn died(&self) -> bool {
        self.alive.as_ref().is_some_and(|a| a.is_cancelled())
    }
}

impl Connections {
    /// Opens the home connection (on dlock's I/O runtime).
    pub(super) async fn open(target: &Target, timeout: Duration) -> Result<Self, RedisError> {
        let opener = Arc::new(Opener {
            cluster: target.topology == Topology::Cluster,
            nodes: target.nodes.clone(),
            tls_ca: target.tls_ca.clone(),
            timeout,
        });
        let home = crate::driver::run({
            let opener = opener.clone();
            async move { opener.open().await }
        })
        .await?;
        Ok(Connections {
            opener,
            home,
            local: Arc::new(Mutex::new(Local::Closed { reopen_at: None })),
        })
    }

    pub(super) fn is_cluster(&self) -> bool {
        self.opener.cluster
    }

    /// The home connection, usable from anywhere.
    pub(super) fn home(&self) -> Conn {
        self.home.clone()
    }

    /// The connection for a command from the current thread: the local one
    /// when it is open, else the home one (and the local one starts opening).
    pub(super) fn route(&self) -> Route {
        let home = Route {
            conn: self.home.clone(),
            alive: None,
        };
        if crate::driver::on_io_runtime() {
            return home;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return home;
        };
        let mut local = lock(&self.local);
        match &*local {
            // Only from its own runtime: another runtime's connection is
            // driven only while that runtime runs (a current-thread runtime
            // blocked in a synchronous call would stall our command).
            Local::Open {
                conn,
                alive,
                runtime: opened_on,
            } if !alive.is_cancelled() => {
                if *opened_on != runtime.id() {
                    return home;
                }
                return Route {
                    conn: conn.clone(),
                    alive: Some(alive.clone()),
                };
            }
            Local::Opening => return home,
            Local::Closed {
                reopen_at: Some(at),
            } if Instant::now() < *at => return home,
            _ => {}
        }
        *local = Local::Opening;
        drop(local);
        let sentinel = Sentinel {
            local: self.local.clone(),
            alive: CancellationToken::new(),
        };
        let opener = self.opener.clone();
        let runtime_id = runtime.id();
        runtime.spawn(async move {
            match tokio::time::timeout(opener.timeout, opener.open()).await {
                Ok(Ok(conn)) => {
                    *lock(&sentinel.local) = Local::Open {
                        conn,
                        alive: sentinel.alive.clone(),
                        runtime: runtime_id,
                    };
                    // Lives as long as the runtime; dropped when it shuts down.
                    std::future::pending::<()>().await;
                }
                _ => {
                    *lock(&sentinel.local) = Local::Closed {
                        reopen_at: Some(Instant::now() + REOPEN_AFTER),
                    };
                }
            }
        });
        home
    }
}

/// Held by the task that owns the local connection's life: when the task is
/// dropped (its runtime shut down), the connection is marked dead.
struct Sentinel {
    local: Arc<Mutex<Local>>,
    alive: CancellationToken,
}

impl Drop for Sentinel {
    fn drop(&mut self) {
        self.alive.cancel();
        let mut local = lock(&self.local);
        if matches!(*local, Local::Opening) {
            *local = Local::Closed { reopen_at: None };
        }
    }
}

/// The state is a few plain fields: a panic elsewhere cannot leave it half
/// written, so a poisoned lock is still usable.
fn lock(local: &Mutex<Local>) -> MutexGuard<'_, Local> {
    local.lock().unwrap_or_else(|e| e.into_inner())
}
