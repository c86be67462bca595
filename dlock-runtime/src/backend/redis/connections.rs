//! Where the Redis backends' commands go.
//!
//! A redis-crate connection runs its driver task on the runtime that opened it
//! and dies with that runtime. dlock keeps two for each server (for the one
//! server or cluster of `redis://`, for each master of `redlock://`): the
//! **home** connection, on dlock's own I/O runtime, usable from any runtime,
//! and a **local** one on the application's runtime, used only by commands
//! from there (see [`local`](crate::backend::local); the hop it saves costs
//! about a third of the throughput of a lock at concurrency 1 on loopback).
//! A command that fails because its local connection died under it (its
//! runtime shut down) is sent once more over the home connection.
//!
//! [`Connections`] is the pair for `redis://`, whose home connection is opened
//! with the backend. Redlock keeps its own home connection per master (opened
//! by a reconnect task, see `redlock/node.rs`) and a [`Local`] next to it.
//! Behind Sentinel there is no local connection: the home one goes to the
//! primary as last resolved and is replaced when it moves (`sentinel.rs`).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster_async::ClusterConnection;
use redis::{Client, Cmd, Pipeline, RedisError, RedisFuture, ScriptInvocation, Value};
use tokio_util::sync::CancellationToken;

use super::scripts::redis_error;
use super::sentinel::Followed;
use super::url::{Target, Topology};
use crate::backend::local::Local;
use crate::error::BackendError;

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

pub(super) fn client(node: &str, tls_ca: &Option<Vec<u8>>) -> Result<Client, RedisError> {
    match tls_ca {
        Some(ca) => Client::build_with_tls(
            node,
            redis::TlsCertificates {
                client_tls: None,
                root_cert: Some(ca.clone()),
            },
        ),
        None => Client::open(node),
    }
}

/// rustls needs one process-wide crypto provider; dlock installs ring's unless
/// the application installed one first.
pub(super) fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// The local connection to one server (or cluster), opened by `opener`:
/// none open yet, the first command from an application's runtime starts
/// opening one.
pub(super) fn local(opener: &Arc<Opener>) -> Local<Conn> {
    let opener = opener.clone();
    Local::new(opener.timeout, move || {
        let opener = opener.clone();
        Box::pin(async move { opener.open().await })
    })
}

/// The home connection and the local one of `redis://`. See the
/// [module docs](self).
pub(super) struct Connections {
    home: Home,
    cluster: bool,
}

enum Home {
    /// One server or a cluster: the home connection and the local one.
    Fixed { home: Conn, local: Local<Conn> },
    /// The primary behind Sentinel: its connection on dlock's I/O runtime
    /// only, replaced when the primary moves.
    Followed(Arc<Followed>),
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

    /// The connection for a command from the current thread: `local` when it
    /// is open on this thread's runtime, else `home` (and `local` starts
    /// opening).
    pub(super) fn pick(local: &Local<Conn>, home: Conn) -> Route {
        match local.get() {
            Some(opened) => Route {
                conn: opened.value,
                alive: Some(opened.alive),
            },
            None => Route::home(home),
        }
    }

    /// Whether this is a local connection (not the home one).
    pub(super) fn is_local(&self) -> bool {
        self.alive.is_some()
    }

    /// Whether this was a local connection whose runtime has shut down since.
    pub(super) fn died(&self) -> bool {
        self.alive.as_ref().is_some_and(|a| a.is_cancelled())
    }

    /// Sends a command with `send` over this route, and once more over the
    /// home connection `home()` if this was a local connection that died
    /// under it.
    pub(super) async fn send<T, F, Sent>(
        &self,
        home: impl FnOnce() -> Result<Conn, BackendError>,
        send: F,
    ) -> Result<T, BackendError>
    where
        F: Fn(Conn) -> Sent,
        Sent: Future<Output = Result<T, RedisError>>,
    {
        match send(self.conn.clone()).await {
            Err(_) if self.died() => send(home()?).await.map_err(redis_error),
            answer => answer.map_err(redis_error),
        }
    }
}

/// One call of a script over `conn`.
pub(super) async fn call<T: redis::FromRedisValue>(
    conn: Conn,
    invocation: &ScriptInvocation<'_>,
) -> Result<T, RedisError> {
    match conn {
        Conn::Single(mut c) => invocation.invoke_async(&mut c).await,
        Conn::Cluster(mut c) => invocation.invoke_async(&mut c).await,
    }
}

impl Connections {
    /// Opens the home connection (on dlock's I/O runtime).
    pub(super) async fn open(target: &Target, timeout: Duration) -> Result<Self, BackendError> {
        if target.topology == Topology::Sentinel {
            return Ok(Connections {
                home: Home::Followed(Followed::open(target, timeout).await?),
                cluster: false,
            });
        }
        Self::open_fixed(target, timeout).await.map_err(redis_error)
    }

    async fn open_fixed(target: &Target, timeout: Duration) -> Result<Self, RedisError> {
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
            home: Home::Fixed {
                home,
                local: local(&opener),
            },
            cluster: opener.is_cluster(),
        })
    }

    /// The primary followed through Sentinel, if that is what this is.
    pub(super) fn followed(&self) -> Option<&Arc<Followed>> {
        match &self.home {
            Home::Followed(followed) => Some(followed),
            Home::Fixed { .. } => None,
        }
    }

    /// Sends a command with `send` over [`route`](Self::route), once more
    /// over the home connection if a local one died under it, or, behind
    /// Sentinel, once more to the new primary if it moved.
    pub(super) async fn send<T, F, Sent>(&self, send: F) -> Result<T, BackendError>
    where
        F: Fn(Conn) -> Sent,
        Sent: Future<Output = Result<T, RedisError>>,
    {
        match &self.home {
            Home::Fixed { .. } => self.route().send(|| Ok(self.home()), send).await,
            Home::Followed(followed) => followed.send(send).await,
        }
    }

    /// [`send`](Self::send), and behind Sentinel then a confirmation, asked
    /// of the sentinels after the answer came, that the node which answered
    /// is still the primary of the highest configuration epoch known: else
    /// an error, whatever the node answered (a demoted primary still
    /// accepts writes for a while).
    pub(super) async fn send_confirmed<T, F, Sent>(&self, send: F) -> Result<T, BackendError>
    where
        F: Fn(Conn) -> Sent,
        Sent: Future<Output = Result<T, RedisError>>,
    {
        match &self.home {
            Home::Fixed { .. } => self.send(send).await,
            Home::Followed(followed) => {
                let (answer, generation) = followed.send_on(send).await?;
                followed.vouch(generation).await?;
                Ok(answer)
            }
        }
    }

    pub(super) fn is_cluster(&self) -> bool {
        self.cluster
    }

    /// The home connection, usable from anywhere.
    pub(super) fn home(&self) -> Conn {
        match &self.home {
            Home::Fixed { home, .. } => home.clone(),
            Home::Followed(followed) => followed.current().conn.clone(),
        }
    }

    /// The connection for a command from the current thread: the local one
    /// when it is open, else the home one (and the local one starts opening).
    pub(super) fn route(&self) -> Route {
        match &self.home {
            Home::Fixed { home, local } => Route::pick(local, home.clone()),
            Home::Followed(followed) => Route::home(followed.current().conn.clone()),
        }
    }
}
