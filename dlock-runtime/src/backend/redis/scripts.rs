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

/// `KEYS[1..n-1]` locks (one hash slot), `KEYS[n]` their fence counter;
/// `ARGV` as [`ACQUIRE`]'s. Takes every lock or none: answers `{1, token of
/// each}` or `{0, index of a busy lock from 1, its holder's remaining ms}`.
/// Each lock is taken by [`ACQUIRE`]'s own text, run as a function.
pub(super) static ACQUIRE_ALL: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        &include_str!("acquire_all.lua").replace("--ACQUIRE--", include_str!("acquire.lua")),
    )
});

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

/// Any mode (see `acquire_held.lua`): `KEYS[1]` lock, `KEYS[2]` fence
/// counter, `KEYS[3]` waiting-writer mark; `ARGV[1]` owner, `ARGV[2]` lease
/// (ms), `ARGV[3]` the holder's record, `ARGV[4]` the mode (`x`, `r`, or the
/// number of permits), `ARGV[5]` release channel. Answers `{1, token, slot or
/// -1}`, `{0, retry ms}` or `{2, what holds the key}`.
pub(super) static ACQUIRE_HELD: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("acquire_held.lua")));

/// [`ACQUIRE_HELD`] for Redis Cluster: `SPUBLISH` (see [`RELEASE_SHARDED`]).
pub(super) static ACQUIRE_HELD_SHARDED: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&include_str!("acquire_held.lua").replace("'PUBLISH'", "'SPUBLISH'"))
});

/// A reader's or a permit's renewal: `KEYS[1]` lock, `KEYS[2]` its
/// revocation mark; `ARGV[1]` owner, `ARGV[2]` ttl (ms), `ARGV[3]` the
/// holder's field. Answers as [`RENEW`].
pub(super) static RENEW_HELD: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("renew_held.lua")));

/// Release in any mode: `KEYS[1]` lock, `KEYS[2]` waiting-writer mark;
/// `ARGV[1]` owner, `ARGV[2]` release channel, `ARGV[3]` the holder's field
/// (empty: whatever the owner holds). Answers 1 if anything was removed.
pub(super) static RELEASE_HELD: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("release_held.lua")));

/// [`RELEASE_HELD`] for Redis Cluster: `SPUBLISH`.
pub(super) static RELEASE_HELD_SHARDED: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&include_str!("release_held.lua").replace("'PUBLISH'", "'SPUBLISH'"))
});

/// Whether `error` is the server's `WRONGTYPE`: a plain lock's script met
/// the hash of readers or permits (see `acquire_held.lua`).
pub(super) fn is_wrong_type(error: &BackendError) -> bool {
    error.to_string().contains("WRONGTYPE")
}

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
    fn the_several_key_script_runs_the_single_key_script_for_each_lock() {
        let script =
            include_str!("acquire_all.lua").replace("--ACQUIRE--", include_str!("acquire.lua"));
        assert!(script.contains(include_str!("acquire.lua")));
        assert!(!script.contains("--ACQUIRE--"));
        assert!(script.contains("acquire_one({KEYS[i], KEYS[#KEYS]}, ARGV)"));
    }

    #[test]
    fn the_cluster_scripts_publish_to_the_shard() {
        for script in [
            include_str!("acquire_held.lua"),
            include_str!("release_held.lua"),
        ] {
            let sharded = script.replace("'PUBLISH'", "'SPUBLISH'");
            assert!(sharded.contains("redis.call('SPUBLISH', ARGV["));
            assert!(!sharded.contains("redis.call('PUBLISH'"));
        }
    }

    #[test]
    fn the_cluster_release_script_publishes_to_the_shard() {
        let sharded = include_str!("release.lua").replace("'PUBLISH'", "'SPUBLISH'");
        assert!(sharded.contains("redis.call('SPUBLISH', ARGV[2], '1')"));
        assert!(!sharded.contains("redis.call('PUBLISH'"));
    }
}
