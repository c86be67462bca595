//! What an operator reads and revokes on Redlock: every node is read, and a
//! key is shown as held when a majority of the nodes agree on its owner.
//!
//! Each node's copy of a key stores the owner, a newline and the holder's
//! record, as on one server (see `redis/admin.rs`), without a token (Redlock
//! issues none) or a grant time (the nodes' clocks are independent). How
//! long the key has left is how long the holder keeps its majority: the
//! quorum-th longest remaining TTL among the agreeing nodes. `list` is the
//! union of a `SCAN` of every node.
//!
//! **Revocation.** `revoke` reads the majority owner, then runs one script
//! on every node that, atomically, deletes that owner's copy *only if it is
//! still there*, adds the owner to a mark `<key>\nrevoked` (a set of the
//! owners revoked within their lease, so a successor revoked in turn does
//! not hide an earlier holder's revocation; it lives at least the copy's
//! remaining TTL + 1 s, 60 s + 1 s for a copy without one, and disappears
//! on its own), sends the release message, and answers whether
//! it deleted. The holder is reported only by the revocation that deleted
//! its copies on a majority of the nodes. Two revocations at once delete
//! each copy once between them, so at most one of them reaches a majority
//! and reports the holder: with the holder's copies on every node that
//! answers, exactly one. A split — each deleted the copies of a minority,
//! which needs copies missing or nodes not answering — reports the holder
//! from neither, though it is revoked all the same (no majority of copies
//! is left to it). A revocation that fewer than a majority of the nodes
//! answered is an error (the holder may keep its majority); one that a
//! majority answered but that deleted a minority reports nobody (a release,
//! an expiry or another revocation removed the rest: the holder has no
//! majority left).
//!
//! The holder's renewal (the shared renew script, given the mark) answers
//! per node 1 (extended), 2 (its copy is gone and the mark names it) or 0.
//! A renewal that fails is **revoked** when a majority of the nodes answer
//! 2 — a revocation deleted its copies on a majority, which no expiry,
//! release or takeover does — else lost when a majority refuse it. A mark
//! is never a lock key (a stored key holds no control character), and
//! `list` skips the marks.

use std::collections::{BTreeSet, HashMap};
use std::sync::LazyLock;
use std::time::Duration;

use futures_util::future::join_all;
use redis::Script;

use super::super::admin::held_entry;
use super::RedlockBackend;
use crate::backend::{HeldEntry, KeyEntry};
use crate::error::BackendError;

/// How many keys one `SCAN` step asks for.
const SCAN_COUNT: usize = 1000;

/// What a mark's name adds to its lock key's.
const MARK_SUFFIX: &str = "\nrevoked";

/// `KEYS[1]` lock, `KEYS[2]` its revocation mark; `ARGV[1]` the owner read,
/// `ARGV[2]` release channel. Deletes the owner's copy only if it is still
/// there, marks the owner revoked for longer than the copy had left (so its
/// next renewal on this node answers 2), wakes the waiters, and answers 1;
/// else 0.
static REVOKE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local held = redis.call('GET', KEYS[1])
if held == ARGV[1] or (held and string.sub(held, 1, #ARGV[1] + 1) == ARGV[1] .. '\n') then
  local ttl = redis.call('PTTL', KEYS[1])
  redis.call('DEL', KEYS[1])
  if ttl < 0 then
    ttl = 60000
  end
  redis.call('SADD', KEYS[2], ARGV[1])
  if redis.call('PTTL', KEYS[2]) < ttl + 1000 then
    redis.call('PEXPIRE', KEYS[2], ttl + 1000)
  end
  redis.call('PUBLISH', ARGV[2], '1')
  return 1
end
return 0
",
    )
});

/// The key that marks the revoked owner of the lock key `key` on a node.
pub(super) fn revocation_mark(key: &str) -> String {
    format!("{key}{MARK_SUFFIX}")
}

/// Whether a node's key is a revocation mark, not a lock key.
fn is_mark(name: &str) -> bool {
    name.ends_with(MARK_SUFFIX)
}

impl RedlockBackend {
    /// Every node's copy of `key` (value and remaining ms), `None` where a
    /// node has none or did not answer.
    async fn copies(&self, key: &str) -> Vec<Option<(String, i64)>> {
        let mut pipe = redis::pipe();
        pipe.cmd("GET").arg(key).cmd("PTTL").arg(key);
        let pipe = &pipe;
        join_all(self.nodes.iter().map(|node| async move {
            let route = node.route().ok()?;
            let (value, ttl): (Option<String>, i64) =
                node.query(&route, pipe, self.timeout).await.ok()?;
            value.map(|v| (v, ttl))
        }))
        .await
    }

    /// The holder a majority of the nodes agree on, if any.
    async fn majority(&self, key: &str) -> Result<Option<HeldEntry>, BackendError> {
        let copies = self.copies(key).await;
        let mut votes: HashMap<String, Vec<(String, i64)>> = HashMap::new();
        for (value, ttl) in copies.into_iter().flatten() {
            let owner = value.split('\n').next().unwrap_or_default().to_owned();
            votes.entry(owner).or_default().push((value, ttl));
        }
        let Some(mut agreeing) = votes.into_values().find(|v| v.len() >= self.quorum) else {
            return Ok(None);
        };
        agreeing.sort_unstable_by_key(|(_, ttl)| std::cmp::Reverse(*ttl));
        let (value, ttl) = &agreeing[self.quorum - 1];
        let mut entry = held_entry(value, *ttl);
        entry.token = None;
        if *ttl <= 0 {
            entry.expires_in = None;
        }
        Ok(Some(entry).filter(|e| e.expires_in.is_none_or(|left| left > Duration::ZERO)))
    }

    /// The holder of `key` on a majority of the nodes.
    pub(super) async fn inspect_key(&self, key: &str) -> Result<Option<KeyEntry>, BackendError> {
        Ok(self
            .majority(key)
            .await?
            .map(|holder| KeyEntry::new(key, vec![holder])))
    }

    /// The keys under `prefix` held on a majority, in key order, at most `limit`.
    pub(super) async fn list_keys(
        &self,
        prefix: &str,
        limit: usize,
    ) -> Result<Vec<KeyEntry>, BackendError> {
        if limit == 0 {
            return Ok(Vec::new());
        }
        let pattern = format!("{}*", super::super::admin::glob_escape(prefix));
        let scans = join_all(self.nodes.iter().map(|node| {
            let pattern = &pattern;
            async move {
                let route = node.route()?;
                let mut found = Vec::new();
                let mut cursor = 0_u64;
                loop {
                    let mut pipe = redis::pipe();
                    pipe.cmd("SCAN")
                        .arg(cursor)
                        .arg("MATCH")
                        .arg(pattern)
                        .arg("COUNT")
                        .arg(SCAN_COUNT);
                    let ((next, keys),): ((u64, Vec<String>),) =
                        node.query(&route, &pipe, self.timeout).await?;
                    found.extend(keys);
                    cursor = next;
                    if cursor == 0 {
                        return Ok::<_, BackendError>(found);
                    }
                }
            }
        }))
        .await;
        let answered = scans.iter().filter(|s| s.is_ok()).count();
        if answered < self.quorum {
            return Err(BackendError::transient(format!(
                "redlock: only {answered} of {} nodes answered the listing, {} needed",
                self.nodes.len(),
                self.quorum
            )));
        }
        let keys: BTreeSet<String> = scans
            .into_iter()
            .flatten()
            .flatten()
            .filter(|name| !is_mark(name))
            .collect();
        let mut listed = Vec::new();
        for key in keys.into_iter().filter(|k| k.starts_with(prefix)) {
            if let Some(holder) = self.majority(&key).await? {
                listed.push(KeyEntry::new(key, vec![holder]));
                if listed.len() == limit {
                    break;
                }
            }
        }
        Ok(listed)
    }

    /// Deletes the majority holder's copy of `key` on every node, each node
    /// in one script; reports the holder if this revocation deleted its
    /// copies on a majority (see the [module docs](self)).
    pub(super) async fn revoke_key(&self, key: &str) -> Result<Vec<HeldEntry>, BackendError> {
        let Some(holder) = self.majority(key).await? else {
            return Ok(Vec::new());
        };
        let mut revoke = REVOKE.key(key);
        revoke
            .key(revocation_mark(key))
            .arg(&holder.owner)
            .arg(format!("{key}:released"));
        let revoke = &revoke;
        let answers = join_all(self.nodes.iter().map(|node| async move {
            let route = node.route()?;
            node.invoke::<i64>(&route, revoke, self.timeout).await
        }))
        .await;
        let answered = answers.iter().filter(|a| a.is_ok()).count();
        let deleted = answers.iter().filter(|a| matches!(a, Ok(1))).count();
        if deleted >= self.quorum {
            return Ok(vec![holder]);
        }
        if answered < self.quorum {
            let why = answers
                .into_iter()
                .find_map(Result::err)
                .map(|e| e.to_string())
                .unwrap_or_default();
            return Err(BackendError::transient(format!(
                "redlock: only {answered} of {} nodes answered the revocation, {} needed; \
                 the holder may keep its majority ({why})",
                self.nodes.len(),
                self.quorum
            )));
        }
        Ok(Vec::new())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn marks_are_told_from_lock_keys() {
        let mark = revocation_mark("dlock:a");
        assert!(is_mark(&mark));
        assert!(!is_mark("dlock:a"));
        assert!(!is_mark("dlock:a:revoked"));
        // A stored key holds no control character: no lock key is a mark.
        assert!(mark.contains('\n'));
    }
}
