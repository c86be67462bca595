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
//! A connection itself, and how one is opened, is in `conn.rs`.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use redis::{RedisError, ScriptInvocation};
use tokio_util::sync::CancellationToken;

use super::conn::{Conn, Opener, client, local};
use super::scripts::redis_error;
use super::sentinel::Followed;
use super::url::{Target, Topology};
use crate::backend::local::Local;
use crate::error::BackendError;

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
            Opener::cluster(target.nodes.clone(), target.tls_ca.clone(), timeout)
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
