//! What an operator reads and revokes on Redlock: every node is read, and a
//! key is shown as held when a majority of the nodes agree on its owner.
//!
//! Each node's copy of a key stores the owner, a newline and the holder's
//! record, as on one server (see `redis/admin.rs`), without a token (Redlock
//! issues none) or a grant time (the nodes' clocks are independent). How
//! long the key has left is how long the holder keeps its majority: the
//! quorum-th longest remaining TTL among the agreeing nodes. `list` is the
//! union of a `SCAN` of every node. `revoke` deletes the majority owner's
//! copy on every node (owner-checked, with the release message): its next
//! renewal finds no majority and answers lost.

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use futures_util::future::join_all;

use super::super::admin::held_entry;
use super::super::scripts::RELEASE;
use super::RedlockBackend;
use crate::backend::{HeldEntry, KeyEntry};
use crate::error::BackendError;

/// How many keys one `SCAN` step asks for.
const SCAN_COUNT: usize = 1000;

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
        let keys: BTreeSet<String> = scans.into_iter().flatten().flatten().collect();
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

    /// Deletes the majority holder's copy of `key` on every node.
    pub(super) async fn revoke_key(&self, key: &str) -> Result<Vec<HeldEntry>, BackendError> {
        let Some(holder) = self.majority(key).await? else {
            return Ok(Vec::new());
        };
        let mut release = RELEASE.key(key);
        release.arg(&holder.owner).arg(format!("{key}:released"));
        let release = &release;
        join_all(self.nodes.iter().map(|node| async move {
            let route = node.route()?;
            node.invoke::<i64>(&route, release, self.timeout).await
        }))
        .await;
        Ok(vec![holder])
    }
}
