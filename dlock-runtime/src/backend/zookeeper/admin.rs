//! What an operator reads and revokes on ZooKeeper.
//!
//! A stored key `K` is the container node `{chroot}/{escaped K}` (see the
//! module docs for the escaping), its lock children are its queue. A dlock
//! child's data is the owner token, a newline and the holder's record
//! ([`HolderRecord::encode`]); a Curator child's data is its client's IP
//! address, so a Curator holder is shown without a record, under its node's
//! name. The holder is the child created first (lowest `czxid`; its fencing
//! token is the one its grant wrote after the record, else its `czxid`),
//! the other children are its waiters, and the grant's time
//! is the child's `ctime` (the server's clock). A child lives as long as its
//! session, so how long it has left is not known (`expires_in` is `None`).
//! `list` reads the chroot's children whose unescaped name starts with the
//! prefix. Revocation deletes the holder's child: its waiters' watches fire
//! as on a release, and the holder's next renewal finds its node gone while
//! its session lives, which it reports as revoked.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use zookeeper_client::{Error as ZkError, Stat};

use super::semaphore::{LeaseNode, lease_info};
use super::session::Session;
use super::{Inner, backend_error, path};
use crate::backend::{HeldEntry, HoldMode, HolderRecord, KeyEntry};
use crate::error::BackendError;
use crate::token::FencingToken;

/// The data of a dlock lock child: the owner, a newline, the holder's record.
pub(super) fn node_data(owner: &str, holder: &HolderRecord) -> Vec<u8> {
    format!("{owner}\n{}", holder.encode()).into_bytes()
}

/// The start of the line a grant appends to its node's data when its
/// fencing token is not the node's `czxid`.
const TOKEN_LINE: &str = "dlock-token ";

/// A lock child's data with the grant's fencing token on a line of its own.
pub(super) fn with_token(data: &[u8], token: i64) -> Vec<u8> {
    let mut data = data.to_vec();
    data.extend_from_slice(format!("\n{TOKEN_LINE}{token}").as_bytes());
    data
}

/// The fencing token a grant wrote into its node's data, and the data
/// before it.
fn token_of(data: &[u8]) -> Option<(u64, &[u8])> {
    let at = data.iter().rposition(|b| *b == b'\n')?;
    let line = std::str::from_utf8(&data[at + 1..]).ok()?;
    Some((line.strip_prefix(TOKEN_LINE)?.parse().ok()?, &data[..at]))
}

/// A container's name read back as the stored key ([`path::escape_key`]
/// reversed); `None` for a name it could not have written.
fn unescape_key(name: &str) -> Option<String> {
    let bytes = name.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = name.get(i + 1..i + 3)?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// A lock child read: its name, data and stat.
struct Child {
    name: String,
    data: Vec<u8>,
    stat: Stat,
}

impl Child {
    fn held_entry(&self) -> HeldEntry {
        let (token, data) = match token_of(&self.data) {
            Some((token, data)) => (Some(token), data),
            None => (u64::try_from(self.stat.czxid).ok(), &self.data[..]),
        };
        let text = std::str::from_utf8(data).ok();
        let split = text.and_then(|t| t.split_once('\n'));
        let owner = split.map_or(self.name.as_str(), |(owner, _)| owner);
        let mut entry = HeldEntry::new(owner);
        entry.holder = split.and_then(|(_, record)| HolderRecord::decode(record));
        entry.token = token.map(FencingToken::new);
        entry.granted_at = u64::try_from(self.stat.ctime)
            .ok()
            .map(|ms| SystemTime::UNIX_EPOCH + Duration::from_millis(ms));
        if path::is_reader(&self.name) {
            entry.mode = HoldMode::Shared;
        }
        entry
    }
}

impl Inner {
    /// The lock children of `container`, in creation order (by `czxid`,
    /// which agrees with the sequence numbers wherever they are in order),
    /// read in one multi-read. Empty for a missing container.
    async fn children_of(
        &self,
        session: &Arc<Session>,
        container: &str,
    ) -> Result<Vec<Child>, ZkError> {
        let children = session
            .read_children(container, |n| path::sequence_of(n).is_some())
            .await?;
        Ok(children
            .into_iter()
            .map(|(name, data, stat)| Child { name, data, stat })
            .collect())
    }

    /// The entry of the stored `key` whose container is `container`.
    async fn key_entry(
        &self,
        session: &Arc<Session>,
        key: &str,
        container: &str,
    ) -> Result<Option<KeyEntry>, BackendError> {
        let children = self
            .children_of(session, container)
            .await
            .map_err(|e| backend_error("inspect", e))?;
        let held = path::holders(&children, |c| c.name.as_str());
        if held == 0 {
            return self.permits_entry(session, key, container).await;
        }
        let holders = children[..held].iter().map(Child::held_entry).collect();
        let mut entry = KeyEntry::new(key, holders);
        entry.waiters = Some(children.len() - held);
        Ok(Some(entry))
    }

    /// The holder and waiters of the stored `key`.
    pub(super) async fn inspect_key(
        self: &Arc<Self>,
        key: &str,
    ) -> Result<Option<KeyEntry>, BackendError> {
        let session = self.session().await?;
        let container = format!("/{}", path::escape_key(key));
        self.key_entry(&session, key, &container).await
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
        let session = self.session().await?;
        let names = session
            .call(|c| c.list_children("/"))
            .await
            .map_err(|e| backend_error("list", e))?;
        let mut keys: Vec<(String, String)> = names
            .into_iter()
            .filter_map(|name| {
                let key = unescape_key(&name)?;
                key.starts_with(prefix).then(|| (key, format!("/{name}")))
            })
            .collect();
        keys.sort_unstable();
        let mut listed = Vec::new();
        for (key, container) in keys {
            if let Some(entry) = self.key_entry(&session, &key, &container).await? {
                listed.push(entry);
                if listed.len() == limit {
                    break;
                }
            }
        }
        Ok(listed)
    }

    /// Deletes the holders' children of the stored `key` (the writer, or
    /// every reader granted; each at the version read).
    pub(super) async fn revoke_key(
        self: &Arc<Self>,
        key: &str,
    ) -> Result<Vec<HeldEntry>, BackendError> {
        let session = self.session().await?;
        let container = format!("/{}", path::escape_key(key));
        let children = self
            .children_of(&session, &container)
            .await
            .map_err(|e| backend_error("revoke", e))?;
        let held = path::holders(&children, |c| c.name.as_str());
        if held == 0 {
            return self.revoke_permits(&session, &container).await;
        }
        let mut revoked = Vec::new();
        for child in &children[..held] {
            let node = format!("{container}/{}", child.name);
            let mut deleted = session
                .call(|c| c.delete(&node, Some(child.stat.version)))
                .await;
            if matches!(deleted, Err(ZkError::BadVersion)) {
                // Its grant recorded its token since it was read.
                deleted = session.call(|c| c.delete(&node, None)).await;
            }
            match deleted {
                Ok(()) => revoked.push(child.held_entry()),
                // Released (or revoked) meanwhile.
                Err(ZkError::NoNode) => {}
                Err(err) => return Err(backend_error("revoke", err)),
            }
        }
        Ok(revoked)
    }
}

impl Inner {
    /// The lease nodes of a semaphore key and how many of them hold: as
    /// many as the permits a dlock lease names (every lease when none does).
    async fn permit_holders(
        &self,
        session: &Arc<Session>,
        container: &str,
    ) -> Result<(Vec<LeaseNode>, usize), ZkError> {
        let leases = self
            .read_leases(session, &format!("{container}/{}", path::LEASES))
            .await?;
        let permits = leases
            .iter()
            .find_map(|l| lease_info(&l.data))
            .map_or(leases.len(), |(permits, _, _)| permits as usize);
        let held = permits.min(leases.len());
        Ok((leases, held))
    }

    /// The entry of a semaphore key: its permit holders, its other leases
    /// as waiters.
    async fn permits_entry(
        &self,
        session: &Arc<Session>,
        key: &str,
        container: &str,
    ) -> Result<Option<KeyEntry>, BackendError> {
        let (leases, held) = self
            .permit_holders(session, container)
            .await
            .map_err(|e| backend_error("inspect", e))?;
        if held == 0 {
            return Ok(None);
        }
        let mut entry = KeyEntry::new(key, leases[..held].iter().map(lease_entry).collect());
        entry.waiters = Some(leases.len() - held);
        Ok(Some(entry))
    }

    /// Deletes every permit holder's lease of a semaphore key.
    async fn revoke_permits(
        &self,
        session: &Arc<Session>,
        container: &str,
    ) -> Result<Vec<HeldEntry>, BackendError> {
        let (leases, held) = self
            .permit_holders(session, container)
            .await
            .map_err(|e| backend_error("revoke", e))?;
        let mut revoked = Vec::new();
        for lease in &leases[..held] {
            let node = format!("{container}/{}/{}", path::LEASES, lease.name);
            match session
                .call(|c| c.delete(&node, Some(lease.stat.version)))
                .await
            {
                Ok(()) => revoked.push(lease_entry(lease)),
                Err(ZkError::NoNode) => {}
                Err(err) => return Err(backend_error("revoke", err)),
            }
        }
        Ok(revoked)
    }
}

/// A permit holder as an operator sees it: a dlock lease with its record,
/// permits and slot; a Curator lease under its node's name.
fn lease_entry(lease: &LeaseNode) -> HeldEntry {
    let child = Child {
        name: lease.name.clone(),
        data: lease_info(&lease.data)
            .map_or_else(|| lease.data.clone(), |(_, _, rest)| rest.to_vec()),
        stat: lease.stat,
    };
    let mut entry = child.held_entry();
    let (permits, slot) =
        lease_info(&lease.data).map_or((None, None), |(p, s, _)| (Some(p), Some(s)));
    entry.mode = HoldMode::Permit {
        permits: permits.unwrap_or(2),
    };
    entry.slot = slot;
    entry
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn container_names_read_back_as_keys() {
        for key in ["dlock:a/b", "100%", "zookeeper", ".", "é 😀", "a\u{1}b"] {
            assert_eq!(
                unescape_key(&path::escape_key(key)).as_deref(),
                Some(key),
                "{key}"
            );
        }
        assert_eq!(unescape_key("%zz"), None);
    }

    #[test]
    fn curator_children_show_without_a_record() {
        let stat = Stat {
            czxid: 7,
            mzxid: 7,
            pzxid: 7,
            ctime: 1_700_000_000_000,
            mtime: 1_700_000_000_000,
            version: 0,
            cversion: 0,
            aversion: 0,
            ephemeral_owner: 1,
            data_length: 9,
            num_children: 0,
        };
        let curator = Child {
            name: "_c_x-lock-0000000001".to_owned(),
            data: b"127.0.0.1".to_vec(),
            stat,
        };
        let entry = curator.held_entry();
        assert_eq!(entry.owner, "_c_x-lock-0000000001");
        assert_eq!(entry.holder, None);
        assert_eq!(entry.token, Some(FencingToken::new(7)));
        let record = HolderRecord::new("web", 3, None);
        let ours = Child {
            name: "_c_y-lock-0000000002".to_owned(),
            data: node_data("abc", &record),
            stat,
        };
        let entry = ours.held_entry();
        assert_eq!((entry.owner.as_str(), entry.holder), ("abc", Some(record)));
    }

    #[test]
    fn a_token_recorded_by_a_grant_is_shown_instead_of_the_czxid() {
        let stat = Stat {
            czxid: 7,
            mzxid: 9,
            pzxid: 7,
            ctime: 0,
            mtime: 0,
            version: 1,
            cversion: 0,
            aversion: 0,
            ephemeral_owner: 1,
            data_length: 0,
            num_children: 0,
        };
        let record = HolderRecord::new("web", 3, None);
        let granted = Child {
            name: "_c_y-__READ__0000000002".to_owned(),
            data: with_token(&node_data("abc", &record), 42),
            stat,
        };
        let entry = granted.held_entry();
        assert_eq!(entry.token, Some(FencingToken::new(42)));
        assert_eq!((entry.owner.as_str(), entry.holder), ("abc", Some(record)));
        assert_eq!(entry.mode, HoldMode::Shared);
        assert_eq!(token_of(b"abc\nweb"), None);
        assert_eq!(token_of(b"abc\ndlock-token x"), None);
    }
}
