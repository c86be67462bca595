//! What a backend stores about who holds a key, and what it reads back for an
//! operator: the part of the backend contract behind
//! [`LockBackend::inspect`](super::LockBackend::inspect),
//! [`list`](super::LockBackend::list) and [`revoke`](super::LockBackend::revoke).
//!
//! Every grant carries a [`HolderRecord`] (host, process id, optional instance
//! name) in [`AcquireRequest::holder`](super::AcquireRequest::holder); a backend
//! stores it with the grant, in whatever place costs the hot path least (next
//! to the owner token, in a row's column, in a node's data), and reads it back
//! as a [`HeldEntry`] when asked.

use std::fmt;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime};

use super::HoldMode;
use crate::token::FencingToken;

/// Who holds a grant: stamped by the runtime on every acquisition and stored by
/// the backend with the grant.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct HolderRecord {
    /// The holder's host name.
    pub host: String,
    /// The holder's process id.
    pub pid: u32,
    /// The instance name the application gave (`RegistryBuilder::holder_name`,
    /// default from the `DLOCK_HOLDER` environment variable).
    pub name: Option<String>,
}

/// The length of the holder id an owner token the runtime draws starts with
/// (see [`holder_id`]).
pub const HOLDER_ID_LEN: usize = 16;

/// The holder id an owner token starts with: the runtime draws each owner
/// token as 32 lowercase hex digits, the first 16 of them its registry's
/// (drawn at random once per registry, so per holder record), the other 16
/// at random per acquisition. A backend can store a registry's holder record
/// once under this id instead of with every grant. `None` for an owner of
/// another form (one a caller of the backend chose).
pub fn holder_id(owner: &str) -> Option<&str> {
    let hex = |b: &u8| b.is_ascii_digit() || (b'a'..=b'f').contains(b);
    (owner.len() == 2 * HOLDER_ID_LEN && owner.as_bytes().iter().all(hex))
        .then(|| &owner[..HOLDER_ID_LEN])
}

/// The version tag of [`HolderRecord::encode`]'s text form.
const ENCODING_VERSION: &str = "h1";

impl HolderRecord {
    /// A record for `host`, `pid` and an optional instance `name`.
    pub fn new(host: impl Into<String>, pid: u32, name: Option<String>) -> Self {
        HolderRecord {
            host: host.into(),
            pid,
            name,
        }
    }

    /// This process's record without an instance name: the host name (from
    /// the kernel, else `HOSTNAME`, else `unknown`; spaces and control
    /// characters replaced by `_`) and the process id. Read once.
    pub fn this_process() -> Arc<HolderRecord> {
        static RECORD: OnceLock<Arc<HolderRecord>> = OnceLock::new();
        RECORD
            .get_or_init(|| Arc::new(HolderRecord::new(host_name(), std::process::id(), None)))
            .clone()
    }

    /// One line of text that [`decode`](Self::decode) reads back, for backends
    /// that store the record as one string: `h1 <pid> <host>` followed by
    /// ` <name>` when there is one. Host and name are stored as given; a host
    /// cannot contain a space (the runtime replaces spaces and control
    /// characters when it reads the host name), the name may.
    pub fn encode(&self) -> String {
        match &self.name {
            Some(name) => format!("{ENCODING_VERSION} {} {} {name}", self.pid, self.host),
            None => format!("{ENCODING_VERSION} {} {}", self.pid, self.host),
        }
    }

    /// Reads [`encode`](Self::encode)'s text back; `None` for anything else
    /// (a record written by a later version, or by another library).
    pub fn decode(text: &str) -> Option<Self> {
        let mut parts = text.splitn(4, ' ');
        if parts.next()? != ENCODING_VERSION {
            return None;
        }
        let pid = parts.next()?.parse().ok()?;
        let host = parts.next()?;
        if host.is_empty() {
            return None;
        }
        let name = parts.next().map(str::to_owned);
        Some(HolderRecord::new(host, pid, name))
    }
}

/// The host name, without a dependency: the kernel's (Linux), else the
/// `HOSTNAME` or `COMPUTERNAME` variable, else `unknown`; made one word.
fn host_name() -> String {
    let raw = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .or_else(|| std::env::var("COMPUTERNAME").ok())
        .unwrap_or_default();
    let word: String = raw
        .trim()
        .chars()
        .map(|c| {
            if c.is_whitespace() || c.is_control() {
                '_'
            } else {
                c
            }
        })
        .collect();
    if word.is_empty() {
        "unknown".to_owned()
    } else {
        word
    }
}

impl fmt::Display for HolderRecord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.name {
            Some(name) => write!(f, "{name} ({} pid {})", self.host, self.pid),
            None => write!(f, "{} pid {}", self.host, self.pid),
        }
    }
}

/// One holder of a key, as the server stores it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct HeldEntry {
    /// The owner token of the grant.
    pub owner: String,
    /// Who holds it, when the grant carries a record this version can read
    /// (`None` for a grant made by another library, e.g. Curator on ZooKeeper).
    pub holder: Option<HolderRecord>,
    /// The grant's fencing token, where the backend issues one.
    pub token: Option<FencingToken>,
    /// When the key was granted, on the server's clock, where the server
    /// records it.
    pub granted_at: Option<SystemTime>,
    /// How long the lease has left, measured by the server, where it has a
    /// lease of its own (`None` for holds that end with a session or a
    /// connection, like PostgreSQL's session mode).
    pub expires_in: Option<Duration>,
    /// What the holder holds of the key (a reader's share, a permit).
    pub mode: HoldMode,
    /// The semaphore slot of a permit holder.
    pub slot: Option<u32>,
}

impl HeldEntry {
    /// An entry for `owner` with nothing else known yet.
    pub fn new(owner: impl Into<String>) -> Self {
        HeldEntry {
            owner: owner.into(),
            holder: None,
            token: None,
            granted_at: None,
            expires_in: None,
            mode: HoldMode::Exclusive,
            slot: None,
        }
    }
}

/// A held key, as the server stores it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct KeyEntry {
    /// The stored key (the registry's prefix included).
    pub key: String,
    /// Its holders (one for a lock).
    pub holders: Vec<HeldEntry>,
    /// How many acquisitions wait for it, where the backend knows (queued
    /// nodes on ZooKeeper and etcd, waiting sessions in `pg_locks`).
    pub waiters: Option<usize>,
}

impl KeyEntry {
    /// A key with its holders; waiters unknown.
    pub fn new(key: impl Into<String>, holders: Vec<HeldEntry>) -> Self {
        KeyEntry {
            key: key.into(),
            holders,
            waiters: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holder_records_read_back_what_they_wrote() {
        let with_name = HolderRecord::new("web-1", 4242, Some("payments blue".to_owned()));
        assert_eq!(HolderRecord::decode(&with_name.encode()), Some(with_name));
        let without = HolderRecord::new("web-2", 1, None);
        assert_eq!(without.encode(), "h1 1 web-2");
        assert_eq!(HolderRecord::decode(&without.encode()), Some(without));
        assert_eq!(HolderRecord::decode("h2 1 web"), None);
        assert_eq!(HolderRecord::decode("h1 x web"), None);
        assert_eq!(HolderRecord::decode("h1 1"), None);
        assert_eq!(HolderRecord::decode("0a1b2c"), None);
    }
}
