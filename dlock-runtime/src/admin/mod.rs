//! Operating locks: who holds what, read from the server, and taking a key
//! back from its holders.
//!
//! [`Registry::inspect`], [`Registry::list`] and [`Registry::revoke`] act on
//! the registry's default backend, or on a named one through
//! [`Registry::admin`]. Keys and prefixes are in the user's key space (the
//! registry's prefix is added and removed here). What they show is what the
//! server holds, whichever process took it: every grant carries its holder's
//! host, process id and instance name
//! ([`RegistryBuilder::holder_name`](crate::RegistryBuilder::holder_name)).
//!
//! A revoked holder is not told by a message: its next renewal fails, its
//! [`lost()`](crate::LockGuard::lost) fires (bodies under `on_lost =
//! "cancel"` stop), and the next grant of the key carries a larger fencing
//! token, so the [fencing kit](crate::fence) refuses its late writes.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use crate::backend::{HeldEntry, HoldMode, KeyEntry, LockBackend};
use crate::error::{BackendError, LockError};
use crate::lease::Registry;
use crate::token::FencingToken;

/// A held key, as the server holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct LockInfo {
    key: String,
    holders: Vec<HolderInfo>,
    #[cfg_attr(feature = "serde", serde(skip_serializing_if = "Option::is_none"))]
    waiters: Option<usize>,
}

impl LockInfo {
    /// The key, without the registry's prefix.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// Who holds it: one holder for a lock.
    pub fn holders(&self) -> &[HolderInfo] {
        &self.holders
    }

    /// How many acquisitions wait for it, where the backend knows (ZooKeeper
    /// and etcd queues, PostgreSQL's `pg_locks`); `None` elsewhere.
    pub fn waiters(&self) -> Option<usize> {
        self.waiters
    }
}

/// One holder of a key.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct HolderInfo {
    #[cfg_attr(feature = "serde", serde(skip_serializing_if = "Option::is_none"))]
    host: Option<String>,
    #[cfg_attr(feature = "serde", serde(skip_serializing_if = "Option::is_none"))]
    pid: Option<u32>,
    #[cfg_attr(feature = "serde", serde(skip_serializing_if = "Option::is_none"))]
    name: Option<String>,
    #[cfg_attr(
        feature = "serde",
        serde(
            skip_serializing_if = "Option::is_none",
            serialize_with = "json::token"
        )
    )]
    token: Option<FencingToken>,
    #[cfg_attr(feature = "serde", serde(skip_serializing_if = "Option::is_none"))]
    slot: Option<u32>,
    reader: bool,
    #[cfg_attr(
        feature = "serde",
        serde(
            rename = "granted_at_unix_ms",
            skip_serializing_if = "Option::is_none",
            serialize_with = "json::unix_ms"
        )
    )]
    granted_at: Option<SystemTime>,
    #[cfg_attr(
        feature = "serde",
        serde(
            rename = "expires_in_ms",
            skip_serializing_if = "Option::is_none",
            serialize_with = "json::millis"
        )
    )]
    expires_in: Option<Duration>,
}

impl HolderInfo {
    /// The holder's host name (`None` for a grant without a record dlock can
    /// read, e.g. one made by Curator on ZooKeeper).
    pub fn host(&self) -> Option<&str> {
        self.host.as_deref()
    }

    /// The holder's process id.
    pub fn pid(&self) -> Option<u32> {
        self.pid
    }

    /// The instance name the holder's registry was given
    /// ([`RegistryBuilder::holder_name`](crate::RegistryBuilder::holder_name)
    /// or `DLOCK_HOLDER`).
    pub fn name(&self) -> Option<&str> {
        self.name.as_deref()
    }

    /// The grant's fencing token (`None` on Redlock and for unfenced holds).
    pub fn token(&self) -> Option<FencingToken> {
        self.token
    }

    /// The semaphore slot the holder holds; `None` for a lock.
    pub fn slot(&self) -> Option<u32> {
        self.slot
    }

    /// Whether this is a reader of a read-write lock.
    pub fn is_reader(&self) -> bool {
        self.reader
    }

    /// When the key was granted, on the server's clock, where the server
    /// records it.
    pub fn granted_at(&self) -> Option<SystemTime> {
        self.granted_at
    }

    /// How long the lease has left by the server's clock (`None` for holds
    /// that end with their session, e.g. PostgreSQL's session mode).
    pub fn expires_in(&self) -> Option<Duration> {
        self.expires_in
    }

    fn from_entry(entry: HeldEntry) -> Self {
        let (host, pid, name) = match entry.holder {
            Some(h) => (Some(h.host), Some(h.pid), h.name),
            None => (None, None, None),
        };
        HolderInfo {
            host,
            pid,
            name,
            token: entry.token,
            slot: entry.slot,
            reader: entry.mode == HoldMode::Shared,
            granted_at: entry.granted_at,
            expires_in: entry.expires_in,
        }
    }
}

/// The operator's view of one backend of a registry: what
/// [`Registry::admin`] returns.
#[derive(Debug, Clone)]
pub struct Admin {
    backend: Arc<dyn LockBackend>,
    prefix: String,
}

impl Admin {
    /// Reads who holds `key` from the server: `None` for a free key.
    pub async fn inspect(&self, key: &str) -> Result<Option<LockInfo>, LockError> {
        let stored = self.stored(key)?;
        let entry = self
            .call(|b| async move { b.inspect(&stored).await })
            .await?;
        Ok(entry.and_then(|e| self.info(e)))
    }

    /// The held keys that start with `prefix` (bytewise, the empty prefix
    /// for every key), in key order, at most `limit`.
    pub async fn list(&self, prefix: &str, limit: usize) -> Result<Vec<LockInfo>, LockError> {
        if prefix.chars().any(char::is_control) {
            return Err(LockError::invalid_key(
                prefix,
                "a prefix to list cannot contain control characters",
            ));
        }
        if limit == 0 {
            return Ok(Vec::new());
        }
        let stored = format!("{}{prefix}", self.prefix);
        let entries = self
            .call(|b| async move { b.list(&stored, limit).await })
            .await?;
        Ok(entries.into_iter().filter_map(|e| self.info(e)).collect())
    }

    /// Takes `key` from every holder on the server and answers who held it
    /// (empty for a free key). Each holder's next renewal fails and its
    /// `lost()` fires; the next grant's fencing token is larger than every
    /// revoked one.
    pub async fn revoke(&self, key: &str) -> Result<Vec<HolderInfo>, LockError> {
        let stored = self.stored(key)?;
        let held = self
            .call(|b| async move { b.revoke(&stored).await })
            .await?;
        tracing::warn!(key = %key, holders = held.len(), "dlock key revoked");
        Ok(held.into_iter().map(HolderInfo::from_entry).collect())
    }

    fn stored(&self, key: &str) -> Result<String, LockError> {
        crate::key::check(key, &self.prefix)?;
        let stored = format!("{}{key}", self.prefix);
        self.backend
            .check_key(&stored)
            .map_err(|reason| LockError::invalid_key(key, reason))?;
        Ok(stored)
    }

    /// A backend's entry in the user's key space; `None` for a key outside
    /// the registry's prefix or without holders.
    fn info(&self, entry: KeyEntry) -> Option<LockInfo> {
        let key = entry.key.strip_prefix(&self.prefix)?.to_owned();
        if entry.holders.is_empty() {
            return None;
        }
        Some(LockInfo {
            key,
            holders: entry
                .holders
                .into_iter()
                .map(HolderInfo::from_entry)
                .collect(),
            waiters: entry.waiters,
        })
    }

    /// Runs a backend call, on dlock's I/O runtime where the backend asks.
    async fn call<T, F, Fut>(&self, call: F) -> Result<T, LockError>
    where
        T: Send + 'static,
        F: FnOnce(Arc<dyn LockBackend>) -> Fut,
        Fut: Future<Output = Result<T, BackendError>> + Send + 'static,
    {
        let backend = self.backend.clone();
        let kind = backend.kind();
        let future = call(backend.clone());
        let answer = if backend.needs_io_runtime() && !crate::driver::on_io_runtime() {
            crate::driver::run(future).await
        } else {
            future.await
        };
        answer.map_err(|e| e.into_lock_error(kind))
    }
}

/// `url` with its secrets replaced by `***` (the password in the user info,
/// `?password=`-like query parameters and URLs nested in the query), as
/// dlock's own errors show URLs: for tools that print the URL they were given.
pub fn redact_url(url: &str) -> String {
    crate::error::redact_url(url)
}

impl Registry {
    /// The operator's view of the backend named `backend` (`None`: the
    /// default one), for [`inspect`](Admin::inspect), [`list`](Admin::list)
    /// and [`revoke`](Admin::revoke).
    pub fn admin(&self, backend: Option<&str>) -> Result<Admin, LockError> {
        Ok(Admin {
            backend: self.backend(backend)?.backend.clone(),
            prefix: self.key_prefix().to_owned(),
        })
    }

    /// Reads who holds `key` on the default backend, from the server: `None`
    /// for a free key. See [`Admin::inspect`].
    pub async fn inspect(&self, key: &str) -> Result<Option<LockInfo>, LockError> {
        self.admin(None)?.inspect(key).await
    }

    /// The held keys of the default backend that start with `prefix`, in key
    /// order, at most `limit`. See [`Admin::list`].
    pub async fn list(&self, prefix: &str, limit: usize) -> Result<Vec<LockInfo>, LockError> {
        self.admin(None)?.list(prefix, limit).await
    }

    /// Takes `key` on the default backend from every holder. See
    /// [`Admin::revoke`].
    pub async fn revoke(&self, key: &str) -> Result<Vec<HolderInfo>, LockError> {
        self.admin(None)?.revoke(key).await
    }
}

/// How the `serde` feature writes tokens, instants and durations: numbers.
#[cfg(feature = "serde")]
mod json {
    use std::time::{Duration, SystemTime, UNIX_EPOCH};

    use serde::Serializer;

    use crate::token::FencingToken;

    pub(super) fn token<S: Serializer>(t: &Option<FencingToken>, s: S) -> Result<S::Ok, S::Error> {
        match t {
            Some(t) => s.serialize_u64(t.get()),
            None => s.serialize_none(),
        }
    }

    pub(super) fn unix_ms<S: Serializer>(t: &Option<SystemTime>, s: S) -> Result<S::Ok, S::Error> {
        match t.and_then(|t| t.duration_since(UNIX_EPOCH).ok()) {
            Some(d) => s.serialize_u64(u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
            None => s.serialize_none(),
        }
    }

    pub(super) fn millis<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        match d {
            Some(d) => s.serialize_u64(u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
            None => s.serialize_none(),
        }
    }
}
