//! What an operator reads and revokes on etcd.
//!
//! Each entry `{prefix}/{escaped key}/{name}` carries its holder's record
//! ([`HolderRecord::encode`]) as its value (a granted permit's, then its
//! slot). The holders are, by the first entry's kind: a writer, the first
//! entry alone; readers, every reader before the first writer; permits,
//! those of the first `n` entries whose grant wrote their slot. The other
//! entries are waiters. A holder's fencing token is its entry's mod
//! revision (the revision it was put or granted at); slot claims
//! (`{prefix}/%slots/…`) are outside every queue, so they are never listed
//! as keys. etcd keeps no wall clock for a key (a revision only), so
//! the time of a grant is not known; how long it has left is the remaining
//! TTL of the session's etcd lease the entry is under (when its holder's
//! process dies, the entry goes with that lease; while it runs, dlock's own
//! lease is kept by the holder's watchdog).
//!
//! **Revocation** deletes each holder's entry (guarded by its create
//! revision; a permit's slot claim with it) and, in the same transaction,
//! puts a *mark* for it:
//! `{prefix}/%revoked/{escaped key}/{owner}` (outside every queue: no
//! escaped key is `%revoked`, so no waiter counts it and `inspect` / `list`
//! skip it), whose value is the revoked entry's create revision. The next
//! waiter's watch fires as on a release. The holder's next renewal reads its
//! entry gone, then reads and deletes the mark, and answers
//! [`Renewal::Revoked`](crate::backend::Renewal::Revoked) when the mark names
//! that very entry (an entry that expired, was deleted by hand or went with
//! its session has no mark: [`Renewal::Lost`](crate::backend::Renewal::Lost)).
//! The mark is bounded: it is put under the holder's own etcd lease (the
//! session lease its entry was under), so it goes with the holder's session
//! at the latest, and the holder deletes it earlier — at that renewal, or
//! at its release (or the reaper's delete, or an abandoned acquisition's)
//! when the entry is already gone. Nothing is stored for an entry that is
//! under no lease.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{Compare, CompareOp, GetOptions, KeyValue, PutOptions, Txn, TxnOp};

use super::acquire::record_and_slot;
use super::session::timed_out;
use super::url::{EntryKind, is_escaped, parse_entry, revocation_mark};
use super::{Inner, backend_error, lease_gone};
use crate::backend::{HeldEntry, HolderRecord, KeyEntry};
use crate::error::BackendError;
use crate::token::FencingToken;

/// The stored key that [`escape`](super::url::escape) escaped.
fn unescape(escaped: &str) -> String {
    escaped.replace("%2F", "/").replace("%25", "%")
}

/// One key's queue as read: its entries in create-revision order.
struct Queue {
    entries: Vec<(KeyValue, EntryKind)>,
}

impl Queue {
    /// The holders (see the [module docs](self)) and the number of
    /// waiters; `None` for a queue with no holder.
    fn holders(&self) -> Option<(Vec<&(KeyValue, EntryKind)>, usize)> {
        let (_, kind) = self.entries.first()?;
        let held: Vec<&(KeyValue, EntryKind)> = match *kind {
            EntryKind::Writer => self.entries.iter().take(1).collect(),
            EntryKind::Reader => self
                .entries
                .iter()
                .take_while(|(_, k)| *k == EntryKind::Reader)
                .collect(),
            EntryKind::Permit(n) => self
                .entries
                .iter()
                .take(n as usize)
                .filter(|(e, _)| slot_of_entry(e).is_some())
                .collect(),
        };
        let waiters = self.entries.len() - held.len();
        (!held.is_empty()).then_some((held, waiters))
    }
}

/// The slot a permit's entry carries once granted.
fn slot_of_entry(entry: &KeyValue) -> Option<u32> {
    record_and_slot(entry.value_str().ok()?).1
}

impl Inner {
    /// Every entry under `range` (a prefix), grouped by escaped key.
    async fn read_queues(
        self: &Arc<Self>,
        range: &str,
    ) -> Result<BTreeMap<String, Queue>, BackendError> {
        let session = self.session().await?;
        let mut kv = session.client.kv_client();
        let response = session
            .call(kv.get(range, Some(GetOptions::new().with_prefix())))
            .await
            .map_err(|e| backend_error("inspect", e))?;
        let root = format!("{}/", self.target.prefix);
        let mut queues: BTreeMap<String, Queue> = BTreeMap::new();
        for entry in response.kvs() {
            let Ok(name) = entry.key_str() else { continue };
            // `{escaped key}/{owner}`, one segment each: not a mark, nor
            // an entry of a backend whose prefix is under this one.
            let Some((escaped, kind)) = name
                .strip_prefix(root.as_str())
                .and_then(|n| n.split_once('/'))
                .filter(|(key, _)| is_escaped(key))
                .and_then(|(key, name)| Some((key, parse_entry(name)?.0)))
            else {
                continue;
            };
            queues
                .entry(unescape(escaped))
                .or_insert_with(|| Queue {
                    entries: Vec::new(),
                })
                .entries
                .push((entry.clone(), kind));
        }
        for queue in queues.values_mut() {
            queue.entries.sort_by_key(|(e, _)| e.create_revision());
        }
        Ok(queues)
    }

    /// An entry as a holder: its owner, record, token and what its etcd
    /// lease has left.
    async fn held_entry(self: &Arc<Self>, (entry, kind): &(KeyValue, EntryKind)) -> HeldEntry {
        let owner = entry
            .key_str()
            .ok()
            .and_then(|k| k.rsplit_once('/'))
            .and_then(|(_, name)| parse_entry(name))
            .map_or("", |(_, owner)| owner);
        let mut held = HeldEntry::new(unescape(owner));
        let (record, slot) = entry.value_str().map_or(("", None), record_and_slot);
        held.holder = HolderRecord::decode(record);
        held.token = u64::try_from(entry.mod_revision())
            .ok()
            .map(FencingToken::new);
        held.expires_in = self.lease_left(entry.lease()).await;
        held.mode = kind.mode();
        held.slot = slot;
        held
    }

    /// Every holder of `queue` as shown.
    async fn shown(
        self: &Arc<Self>,
        key: &str,
        holders: &[&(KeyValue, EntryKind)],
        waiters: usize,
    ) -> KeyEntry {
        let mut shown = Vec::with_capacity(holders.len());
        for holder in holders {
            shown.push(self.held_entry(holder).await);
        }
        let mut entry = KeyEntry::new(key, shown);
        entry.waiters = Some(waiters);
        entry
    }

    /// The remaining TTL of etcd lease `id` (`None` if unknown or ended).
    async fn lease_left(self: &Arc<Self>, id: i64) -> Option<Duration> {
        let session = self.session().await.ok()?;
        let mut leases = session.client.lease_client();
        let answer = session.call(leases.time_to_live(id, None)).await.ok()?;
        u64::try_from(answer.ttl())
            .ok()
            .filter(|&s| s > 0)
            .map(Duration::from_secs)
    }

    /// The holder and waiters of the stored `key`.
    pub(super) async fn inspect_key(
        self: &Arc<Self>,
        key: &str,
    ) -> Result<Option<KeyEntry>, BackendError> {
        let queues = self.read_queues(&self.queue_of(key)).await?;
        let Some((holders, waiters)) = queues.get(key).and_then(Queue::holders) else {
            return Ok(None);
        };
        Ok(Some(self.shown(key, &holders, waiters).await))
    }

    /// The held keys under `prefix`, in key order, at most `limit`.
    pub(super) async fn list_keys(
        self: &Arc<Self>,
        prefix: &str,
        limit: usize,
    ) -> Result<Vec<KeyEntry>, BackendError> {
        if limit == 0 {
            return Ok(Vec::new());
        }
        let range = format!("{}/{}", self.target.prefix, super::url::escape(prefix));
        let queues = self.read_queues(&range).await?;
        let mut listed = Vec::new();
        for (key, queue) in &queues {
            if !key.starts_with(prefix) {
                continue;
            }
            let Some((holders, waiters)) = queue.holders() else {
                continue;
            };
            listed.push(self.shown(key, &holders, waiters).await);
            if listed.len() == limit {
                break;
            }
        }
        Ok(listed)
    }

    /// Deletes each holder's entry of the stored `key` (if it is still the
    /// one read: guarded by its create revision) and leaves the mark its
    /// renewal reads (see the [module docs](self)), one transaction per
    /// holder.
    pub(super) async fn revoke_key(
        self: &Arc<Self>,
        key: &str,
    ) -> Result<Vec<HeldEntry>, BackendError> {
        let queues = self.read_queues(&self.queue_of(key)).await?;
        let Some((holders, _)) = queues.get(key).and_then(Queue::holders) else {
            return Ok(Vec::new());
        };
        let session = self.session().await?;
        let mut revoked = Vec::new();
        for holder in holders {
            let held = self.held_entry(holder).await;
            let first = &holder.0;
            let mut kv = session.client.kv_client();
            let mut ops = vec![TxnOp::delete(first.key(), None)];
            if let Some(slot) = slot_of_entry(first) {
                ops.push(TxnOp::delete(format!("{}{slot}", self.slots_of(key)), None));
            }
            let mark = first.key_str().ok().and_then(revocation_mark);
            if let Some(mark) = mark.filter(|_| first.lease() != 0) {
                let under_holders_lease = PutOptions::new().with_lease(first.lease());
                ops.push(TxnOp::put(
                    mark,
                    first.create_revision().to_string(),
                    Some(under_holders_lease),
                ));
            }
            let txn = Txn::new()
                .when([Compare::create_revision(
                    first.key(),
                    CompareOp::Equal,
                    first.create_revision(),
                )])
                .and_then(ops);
            // Not `session.call`: an unknown lease here would be the
            // holder's, not this session's, and must not end this session.
            // (etcd checks the lease only when the entry is still there,
            // that is while its lease is.)
            let answer = tokio::time::timeout(session.op_timeout, kv.txn(txn))
                .await
                .unwrap_or_else(|_| Err(timed_out()));
            match answer {
                Ok(response) if response.succeeded() => revoked.push(held),
                Ok(_) => {}
                // The holder's lease ended in between, and its entry with it.
                Err(err) if lease_gone(&err) => {}
                Err(err) => return Err(backend_error("revoke", err)),
            }
        }
        Ok(revoked)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escaped_keys_read_back() {
        for key in ["a/b%2F", "plain", "%25/%"] {
            assert_eq!(unescape(&super::super::url::escape(key)), key);
        }
    }
}
