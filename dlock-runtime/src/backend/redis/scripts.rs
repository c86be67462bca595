//! The scripts the Redis backends send, and how their arguments and errors
//! read.

use std::sync::LazyLock;
use std::time::Duration;

use redis::{RedisError, Script};

use crate::backend::ceil_millis;
use crate::error::BackendError;

/// `KEYS[1]` lock, `KEYS[2]` fence counter; `ARGV[1]` owner, `ARGV[2]` lease
/// (ms), `ARGV[3]` the holder's record (stored after the owner, see `admin.rs`).
/// Answers `{1, token}` or `{0, holder's remaining ms}`. Sent twice for one
/// owner (a retry), it grants again (lease from now, a larger token).
pub(super) static ACQUIRE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("acquire.lua")));

/// `KEYS[1]` lock, `KEYS[2]` (optional) its revocation mark; `ARGV[1]` owner,
/// `ARGV[2]` ttl (ms). Answers 1 if extended, 2 if the owner's hold was
/// revoked, else 0.
pub(super) static RENEW: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("renew.lua")));

/// `KEYS[1]` lock; `ARGV[1]` owner, `ARGV[2]` release channel. Answers 1 if
/// deleted. Wakes waiters with `PUBLISH` (one server, Redlock's masters).
pub(super) static RELEASE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("release.lua")));

/// [`RELEASE`] for Redis Cluster: `SPUBLISH`, so the message reaches only
/// the shard of the key (the channel is in the lock key's slot), where a
/// `PUBLISH` would be broadcast to every node.
pub(super) static RELEASE_SHARDED: LazyLock<Script> =
    LazyLock::new(|| Script::new(&include_str!("release.lua").replace("'PUBLISH'", "'SPUBLISH'")));

pub(crate) fn redis_error(err: RedisError) -> BackendError {
    if err.is_timeout()
        || err.is_connection_dropped()
        || err.is_connection_refusal()
        || err.is_io_error()
        || matches!(
            err.code(),
            Some(
                "TRYAGAIN"
                    | "LOADING"
                    | "CLUSTERDOWN"
                    | "MASTERDOWN"
                    // A script running past its time limit: the server is stalled.
                    | "BUSY"
                    // `min-replicas-to-write` not met: replicas reconnecting.
                    | "NOREPLICAS"
            )
        )
    {
        BackendError::transient(err)
    } else {
        BackendError::permanent(err)
    }
}

/// A lease as milliseconds for `PX`/`PEXPIRE`: rounded up, and capped where
/// Redis still accepts it.
pub(super) fn millis(d: Duration) -> u64 {
    ceil_millis(d).min(i64::MAX as u64 / 2)
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_cluster_release_script_publishes_to_the_shard() {
        let sharded = include_str!("release.lua").replace("'PUBLISH'", "'SPUBLISH'");
        assert!(sharded.contains("redis.call('SPUBLISH', ARGV[2], '1')"));
        assert!(!sharded.contains("redis.call('PUBLISH'"));
    }
}
