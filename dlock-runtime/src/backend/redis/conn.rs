//! One connection to one Redis node or cluster, and how one is opened:
//! what the backends' routes ([`connections`](super::connections)), the
//! Sentinel follower and Redlock's nodes are built of.

use std::sync::Arc;
use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster_async::ClusterConnection;
use redis::{Client, Cmd, Pipeline, RedisError, RedisFuture, Value};

use crate::backend::local::Local;
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

    /// Connections to the cluster whose seed nodes are `nodes`: every command
    /// bounded by `timeout`.
    pub(super) fn cluster(
        nodes: Vec<String>,
        tls_ca: Option<Vec<u8>>,
        timeout: Duration,
    ) -> Opener {
        Opener {
            how: How::Cluster { nodes, tls_ca },
            timeout,
        }
    }

    pub(super) fn is_cluster(&self) -> bool {
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
