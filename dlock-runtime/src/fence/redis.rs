//! Fenced writes on Redis, single server or Cluster: one script call each,
//! the fence kept in the written key's hash slot.
//!
//! [`set`] keeps the largest token that wrote `key` in the string
//! [`fence_key`]`(key)`, [`hset`] the largest per field of a hash in the
//! hash [`hash_fence_key`]`(key)`. Both fence keys carry a hash tag that
//! Redis Cluster maps to `key`'s own slot, so the script touches one slot
//! and runs on the shard that owns `key`.
//!
//! **Bounded.** A fence expires [`DEFAULT_RETENTION`]
//! after the last write through it (the TTL is renewed by each write; the
//! value's own TTL, if any, is not touched, and `SET` clears it as a plain
//! `SET` does). Deleting the value key, or its expiry, leaves the fence in
//! place: a stale holder's write is still refused for the retention after
//! the last fenced write. Once the fence has expired, the next write passes
//! whatever its token; see [`fence`](super) for when that is safe.

use std::sync::LazyLock;
use std::time::Duration;

use redis::Script;
use redis::aio::ConnectionLike;

use super::DEFAULT_RETENTION;
use crate::backend::redis::scripts::redis_error;
use crate::backend::redis::slots::slot_tag;
use crate::{FencingToken, LockError};

static SET: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("set.lua")));
static HSET: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("hset.lua")));

/// Where [`set`] keeps `key`'s fence: `dlock-fenced:{<n>}:<key>`, in the
/// same Redis Cluster slot as `key`.
pub fn fence_key(key: &str) -> String {
    format!("dlock-fenced:{{{}}}:{key}", slot_tag(key.as_bytes()))
}

/// Where [`hset`] keeps the fences of `key`'s fields: the hash
/// `dlock-fenced-h:{<n>}:<key>`, in the same slot as `key`.
pub fn hash_fence_key(key: &str) -> String {
    format!("dlock-fenced-h:{{{}}}:{key}", slot_tag(key.as_bytes()))
}

/// Sets `key` to `value` only if `token` is at least the largest token that
/// wrote `key` through the fence (equal passes), in one round trip; keeps
/// the larger token.
///
/// [`LockError::Fenced`] (with the token seen) when a larger one already
/// wrote: nothing was written. [`LockError::Backend`] when the call failed
/// (then the write may or may not have happened, as with any Redis write
/// whose answer was lost; writing again with the same token is safe).
pub async fn set<C>(
    conn: &mut C,
    key: &str,
    value: impl AsRef<[u8]>,
    token: FencingToken,
) -> Result<(), LockError>
where
    C: ConnectionLike + Send,
{
    let mut call = SET.key(key);
    call.key(fence_key(key)).arg(value.as_ref());
    fenced_call(conn, call, key, token).await
}

/// [`set`] with the token of the lock the current task holds — the lock
/// whose key is `key` if the call chain holds one, else the innermost
/// ([`current()`](crate::current)), as
/// [`Fence::check_current`](super::Fence::check_current) chooses;
/// [`LockError::Lost`] when another lock of the call chain is known lost;
/// [`LockError::Config`] outside a held scope or when the chosen lock has no
/// token (Redlock).
pub async fn set_current<C>(
    conn: &mut C,
    key: &str,
    value: impl AsRef<[u8]>,
) -> Result<(), LockError>
where
    C: ConnectionLike + Send,
{
    let token = super::current_token(key)?;
    set(conn, key, value, token).await
}

/// Sets `field` of the hash `key` to `value` only if `token` is at least the
/// largest token that wrote this field through the fence (equal passes), in
/// one round trip. Each field is fenced on its own; the fences of one hash
/// expire together, [`DEFAULT_RETENTION`] after
/// the last fenced write to any of its fields.
///
/// [`LockError::Fenced`] names the resource as `key` and `field` joined by
/// `#`.
pub async fn hset<C>(
    conn: &mut C,
    key: &str,
    field: &str,
    value: impl AsRef<[u8]>,
    token: FencingToken,
) -> Result<(), LockError>
where
    C: ConnectionLike + Send,
{
    let mut call = HSET.key(key);
    call.key(hash_fence_key(key)).arg(field).arg(value.as_ref());
    fenced_call(conn, call, &format!("{key}#{field}"), token).await
}

/// Runs a fenced-write script with its last two arguments (the token and the
/// fence's retention) added.
async fn fenced_call<C>(
    conn: &mut C,
    mut call: redis::ScriptInvocation<'_>,
    resource: &str,
    token: FencingToken,
) -> Result<(), LockError>
where
    C: ConnectionLike + Send,
{
    call.arg(token.get()).arg(millis(DEFAULT_RETENTION));
    let seen: Option<String> = call
        .invoke_async(conn)
        .await
        .map_err(|e| redis_error(e).into_lock_error("redis"))?;
    verdict(resource, token, seen)
}

fn verdict(resource: &str, token: FencingToken, seen: Option<String>) -> Result<(), LockError> {
    match seen {
        None => Ok(()),
        Some(seen) => Err(LockError::Fenced {
            resource: resource.to_owned(),
            token,
            seen: seen.parse().ok().map(FencingToken::new),
        }),
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fences_are_in_their_keys_slot() {
        for key in ["balance", "{user:7}:balance", "a{b}c", "{}", "x{"] {
            // One tag per slot: equal tags, equal slots.
            let slot = slot_tag(key.as_bytes());
            assert_eq!(slot_tag(fence_key(key).as_bytes()), slot, "{key}");
            assert_eq!(slot_tag(hash_fence_key(key).as_bytes()), slot, "{key}");
        }
        assert_ne!(fence_key("a"), fence_key("b"));
        assert!(fence_key("balance").ends_with(":balance"));
    }

    #[test]
    fn a_refusal_carries_the_token_seen() {
        assert!(verdict("k", FencingToken::new(3), None).is_ok());
        match verdict(
            "k",
            FencingToken::new(3),
            Some("18446744073709551615".into()),
        ) {
            Err(LockError::Fenced {
                resource,
                token,
                seen,
            }) => {
                assert_eq!(resource, "k");
                assert_eq!(token.get(), 3);
                assert_eq!(seen, Some(FencingToken::new(u64::MAX)));
            }
            other => panic!("{other:?}"),
        }
    }
}
