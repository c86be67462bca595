//! Replica acknowledgement of grants (`?replicas=N`); see the [Redis
//! backend's docs](super).

use std::time::Duration;

use redis::RedisError;

use super::conn::Conn;
use super::connections::Connections;
use super::scripts::millis;
use super::slots;
use super::url::Target;
use crate::error::BackendError;

/// `?replicas=N`: a grant counts once `N` replicas have acknowledged it
/// (`WAIT N timeout` after the acquire script, on the connection that sent it).
///
/// The grants go over a connection of their own: `WAIT` blocks the
/// connection's later commands on the server until it answers, and a replica
/// that is down would otherwise hold up the renewals and releases sharing it.
pub(super) struct ReplicaAcks {
    pub(super) replicas: u32,
    /// `WAIT`'s own timeout: half the command timeout, so the server answers
    /// (with the count so far) before the client gives up on the command.
    wait: Duration,
    conns: Connections,
}

impl ReplicaAcks {
    /// Opens the grants' own connection to the server (or cluster) `target`
    /// names: `replicas` acknowledgements asked for, commands bounded by
    /// `timeout`.
    pub(super) async fn open(
        target: &Target,
        replicas: u32,
        timeout: Duration,
    ) -> Result<ReplicaAcks, BackendError> {
        Ok(ReplicaAcks {
            replicas,
            wait: timeout / 2,
            conns: Connections::open(target, timeout).await?,
        })
    }

    /// The grants' own connection.
    pub(super) fn home(&self) -> Conn {
        self.conns.home()
    }

    /// A script call over the grants' own connection (behind Sentinel,
    /// sent once more to the new primary if it moved).
    pub(super) async fn call<T: redis::FromRedisValue>(
        &self,
        invocation: &redis::ScriptInvocation<'_>,
    ) -> Result<T, BackendError> {
        self.conns
            .send(|conn| super::connections::call(conn, invocation))
            .await
    }

    /// Any command `send` builds, over the grants' own connection (behind
    /// Sentinel, sent once more to the new primary if it moved).
    pub(super) async fn send<T, F, Sent>(&self, send: F) -> Result<T, BackendError>
    where
        F: Fn(Conn) -> Sent,
        Sent: std::future::Future<Output = Result<T, RedisError>>,
    {
        self.conns.send(send).await
    }

    /// `WAIT replicas timeout` on the connection that sent the grant (on a
    /// cluster, to the master of the key's slot): an error unless at least
    /// `replicas` replicas acknowledged every write sent before it.
    pub(super) async fn acknowledged(&self, lock_key: &str) -> Result<(), BackendError> {
        let mut wait = redis::cmd("WAIT");
        wait.arg(self.replicas).arg(millis(self.wait));
        let answer: Result<i64, RedisError> = match self.conns.home() {
            Conn::Single(mut c) => wait.query_async(&mut c).await,
            Conn::Cluster(mut c) => {
                use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
                let slot = slots::key_slot(lock_key.as_bytes());
                let route = RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(
                    Route::new(slot, SlotAddr::Master),
                ));
                c.route_command(wait, route)
                    .await
                    .and_then(|v| redis::from_redis_value(v).map_err(RedisError::from))
            }
        };
        match answer {
            Ok(n) if n >= i64::from(self.replicas) => Ok(()),
            Ok(n) => Err(BackendError::transient(format!(
                "redis: only {n} of the {} replicas asked for (`replicas={}`) acknowledged the \
                 grant within {:?}; undone",
                self.replicas, self.replicas, self.wait
            ))),
            Err(e) => Err(BackendError::transient(format!(
                "redis: the replicas' acknowledgement (`WAIT {}`) failed: {e}; grant undone",
                self.replicas
            ))),
        }
    }
}
