//! The backend contract and the backends.
//!
//! A backend stores leases: it grants a key to one owner for a limited time,
//! extends that time only for the same owner (compare-and-extend), and frees
//! the key only for the same owner (compare-and-delete). Everything else —
//! waiting budgets, the watchdog, reentrancy, release on drop — lives in the
//! runtime and is the same for every backend.
//!
//! | module | URL | feature |
//! |---|---|---|
//! | [`memory`] | `memory://` | always |
//! | [`sql`] (SQLite) | `sqlite://path` | `sqlite` (default) |
//! | [`redis`] | `redis://`, `rediss://`, `redis+cluster://`, `redis+sentinel://` | `redis` |
//! | [`redis::redlock`] | `redlock://h1:p1,h2:p2,h3:p3` | `redis` |
//! | [`sql::postgres`] | `postgres://`, `postgresql://` | `postgres` |
//! | [`sql::mysql`] (MySQL 8, MariaDB) | `mysql://`, `mariadb://` | `mysql` |
//! | [`zookeeper`] | `zk://h1:p1,h2:p2/chroot` | `zookeeper` |
//! | [`etcd`] | `etcd://h1:p1,h2:p2/prefix` | `etcd` |
//!
//! The wait loop every backend shares is in [`wait`]; [`connect`] opens the
//! backend a URL names.

use std::any::Any;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::future::BoxFuture;
use tokio_util::sync::CancellationToken;

use crate::error::BackendError;
use crate::token::FencingToken;

mod connect;
#[cfg(feature = "etcd")]
pub mod etcd;
pub mod holders;
#[cfg(any(feature = "redis", feature = "postgres", feature = "mysql"))]
mod local;
pub mod memory;
mod mode;
#[cfg(feature = "redis")]
pub mod redis;
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
pub mod sql;
pub mod wait;
#[cfg(feature = "zookeeper")]
pub mod zookeeper;

pub use connect::connect;
pub use holders::{HOLDER_ID_LEN, HeldEntry, HolderRecord, KeyEntry, holder_id};
pub use mode::{HoldMode, MAX_PERMITS};
pub use wait::WakeSource;

/// What the runtime asks a backend for when it acquires a lock.
#[derive(Debug)]
#[non_exhaustive]
pub struct AcquireRequest {
    /// The stored key: the registry's prefix followed by the user's key.
    pub key: String,
    /// A random token unique to this acquisition; only its holder may extend or
    /// release the lease.
    pub owner: String,
    /// How long the lease lasts unless renewed. At least [`MIN_LEASE`](crate::MIN_LEASE).
    pub lease: Duration,
    /// How long the runtime's wait loop waits for a busy key; zero means try
    /// once. A backend's [`try_acquire`](LockBackend::try_acquire) never waits.
    pub wait: Duration,
    /// Cancelled by the backend when it learns on its own that the lease is gone
    /// (a session expired, a connection died). The runtime watches it.
    pub lost: CancellationToken,
    /// Whether the holder wants a fencing token (default `true`). `false`: the
    /// runtime drops whatever token the grant carries, and a backend may skip
    /// work it does only for the token (Redis grants with a plain `SET NX PX`).
    pub fencing: bool,
    /// Who asks: stored by the backend with the grant and read back by
    /// [`inspect`](LockBackend::inspect) and [`list`](LockBackend::list).
    pub holder: Arc<HolderRecord>,
    /// What the request holds of the key: the whole key (a plain lock, the
    /// default), a reader's share, or one permit of a semaphore. A backend
    /// that does not offer `mode` has said so in
    /// [`offers`](LockBackend::offers); the runtime never sends it one.
    pub mode: HoldMode,
}

impl AcquireRequest {
    /// A request to try `key` once for `owner`, for `lease`. For calling a
    /// backend directly (its own tests, benchmarks); the runtime builds these.
    pub fn new(key: impl Into<String>, owner: impl Into<String>, lease: Duration) -> Self {
        AcquireRequest {
            key: key.into(),
            owner: owner.into(),
            lease,
            wait: Duration::ZERO,
            lost: CancellationToken::new(),
            fencing: true,
            holder: HolderRecord::this_process(),
            mode: HoldMode::Exclusive,
        }
    }

    /// Asks for `mode` instead of the whole key.
    pub fn with_mode(mut self, mode: HoldMode) -> Self {
        self.mode = mode;
        self
    }

    /// Waits up to `wait` for a busy key.
    pub fn with_wait(mut self, wait: Duration) -> Self {
        self.wait = wait;
        self
    }

    /// `false`: the holder needs no fencing token (see [`fencing`](Self::fencing)).
    pub fn with_fencing(mut self, fencing: bool) -> Self {
        self.fencing = fencing;
        self
    }

    /// Stamps the grant with `holder` instead of this process's unnamed record.
    pub fn with_holder(mut self, holder: Arc<HolderRecord>) -> Self {
        self.holder = holder;
        self
    }
}

/// A lease granted by a backend.
///
/// Backends build it with [`Lease::new`]; the runtime sets
/// [`valid_until`](Lease::valid_until) from the instant *before* the request
/// was sent, so rounding and safety margins are the same for every backend.
#[non_exhaustive]
pub struct Lease {
    /// The stored key.
    pub key: String,
    /// The owner token of the acquisition.
    pub owner: String,
    /// The fencing token, if the backend has a safe one.
    pub token: Option<FencingToken>,
    /// A conservative local bound on the lease's end, set by the runtime: the
    /// instant before the request was sent, plus the lease, minus the
    /// backend's [`drift`](LockBackend::drift).
    pub valid_until: Instant,
    /// Backend-specific state kept with the lease (a node path, a dedicated connection).
    pub extra: Option<Arc<dyn Any + Send + Sync>>,
    /// Set by the runtime when an earlier attempt of the same acquisition
    /// went unanswered ([`Attempt::Unavailable`]): that attempt's command may
    /// still reach the server after this grant, even after its release, and
    /// take the key again for the same owner. A backend whose attempts may
    /// travel over different connections releases such a lease over each of
    /// them, behind whatever is still in flight there.
    pub after_unanswered: bool,
    /// What the lease holds of the key (the request's [`mode`](AcquireRequest::mode)).
    pub mode: HoldMode,
    /// The semaphore slot a [`HoldMode::Permit`] grant took (`0..permits`),
    /// set by the backend with [`with_slot`](Lease::with_slot); `None` for
    /// other modes. A lease the runtime builds to undo an abandoned attempt
    /// has no slot: a backend's release then frees whatever permit the owner
    /// holds on the key.
    pub slot: Option<u32>,
}

impl Lease {
    /// The lease `request` asked for, with the fencing token the backend issued
    /// (`None` only where the backend has no safe token).
    pub fn new(request: &AcquireRequest, token: Option<FencingToken>) -> Self {
        Lease {
            key: request.key.clone(),
            owner: request.owner.clone(),
            token,
            valid_until: Instant::now(),
            extra: None,
            after_unanswered: false,
            mode: request.mode,
            slot: None,
        }
    }

    /// The semaphore slot this grant took.
    pub fn with_slot(mut self, slot: u32) -> Self {
        self.slot = Some(slot);
        self
    }

    /// Keeps backend-specific state with the lease.
    pub fn with_extra(mut self, extra: Arc<dyn Any + Send + Sync>) -> Self {
        self.extra = Some(extra);
        self
    }
}

impl fmt::Debug for Lease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lease")
            .field("key", &self.key)
            .field("token", &self.token)
            .field("mode", &self.mode)
            .field("slot", &self.slot)
            .field("valid_until", &self.valid_until)
            .finish_non_exhaustive()
    }
}

/// The answer to one attempt ([`LockBackend::try_acquire`]).
#[derive(Debug)]
#[non_exhaustive]
pub enum Attempt {
    /// The key is ours.
    Held(Lease),
    /// Someone else holds the key.
    Busy {
        /// When it is worth trying again without a wake-up: the holder's
        /// remaining lease, or a back-off. `None`: only when woken (or polled).
        retry_in: Option<Duration>,
    },
    /// The backend could not decide now (a server down or restarting, too
    /// few Redlock nodes answered). The wait loop tries again after
    /// `retry_in`, doubled for every further unavailable answer in a row (up
    /// to [`wait::UNAVAILABLE_BACKOFF_MAX`]); if the wait budget runs out
    /// first, `error` is the answer instead of [`LockError::Busy`](crate::LockError::Busy).
    Unavailable {
        /// Why.
        error: BackendError,
        /// When to try again.
        retry_in: Duration,
    },
}

/// The answer to one attempt at several keys in one step
/// ([`LockBackend::try_acquire_all`]): all of them, or none.
#[derive(Debug)]
#[non_exhaustive]
pub enum AttemptAll {
    /// Every key is ours: one lease per request, in the requests' order.
    Held(Vec<Lease>),
    /// A key is held elsewhere, and none was taken.
    Busy {
        /// The index (in the requests) of a busy key: the wait loop sleeps
        /// on that key's wake-up source.
        key: usize,
        /// When it is worth trying again without a wake-up (that key's
        /// holder's remaining lease, or a back-off), as in [`Attempt::Busy`].
        retry_in: Option<Duration>,
    },
    /// The backend could not decide now, as in [`Attempt::Unavailable`].
    Unavailable {
        /// Why.
        error: BackendError,
        /// When to try again.
        retry_in: Duration,
    },
}

/// The answer to a renewal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Renewal {
    /// The lease was extended by the requested time, measured from the
    /// server's receipt of the request (the runtime measures it from before
    /// the request was sent, minus the backend's [`drift`](LockBackend::drift)).
    Renewed,
    /// The key is no longer ours (expired, deleted, taken over).
    Lost,
    /// The key is no longer ours because an operator revoked it
    /// ([`LockBackend::revoke`]); reported as such where the backend can tell
    /// a revocation from an expiry, else [`Lost`](Renewal::Lost).
    Revoked,
}

/// A lock store. Object safe: the registry holds `Arc<dyn LockBackend>`.
///
/// A backend implements **one attempt** ([`try_acquire`](Self::try_acquire)),
/// its **wake-up source** ([`wake_source`](Self::wake_source)), batched
/// renewal ([`renew_all`](Self::renew_all); [`renew`](Self::renew) is a batch
/// of one) and [`release`](Self::release); optionally, several keys in one
/// step ([`try_acquire_all`](Self::try_acquire_all)). The runtime owns the
/// rest, once for every backend: the wait loop ([`wait::acquire`]), the
/// lease's local validity, the watchdog, time-driven loss, reentrancy,
/// release on drop.
///
/// Rules every backend follows:
///
/// - **Atomic and owner-checked**: acquire, renew and release each decide on
///   the server in one step, and renew and release act only for
///   [`Lease::owner`]. Sent twice (a retry, or an abandoned request followed
///   by the runtime's clean-up release), each is harmless.
/// - **Bounded**: every call answers within one network timeout — never hangs.
/// - **Fencing tokens strictly increase per key, even when per-key state is
///   lost** (a row deleted, a counter evicted or lost in a restart, a replica
///   promoted behind its master). Where the backend keeps a counter, issue the
///   larger of the counter + 1 and the server's clock in microseconds (a
///   *hybrid* token), or one counter for all keys. A backend that cannot
///   promise this returns no token (`None`), never a wrong one.
/// - **Bounded state**: what the backend keeps per key (rows, counters, waiter
///   entries) is collected after a bounded retention once the key is free, so
///   `order:{id}`-style keys never grow the server or the process without bound.
/// - **Durations are rounded up** when sent to a server ([`ceil_millis`]), so
///   the server's lease is never shorter than the holder assumes.
pub trait LockBackend: Send + Sync + fmt::Debug + 'static {
    /// The backend's kind, used in errors and traces (`"memory"`, `"sqlite"`, …).
    fn kind(&self) -> &'static str;

    /// Rejects keys this backend cannot store without ambiguity. The key is the
    /// stored key (prefix included); the runtime has already rejected empty keys,
    /// control characters and keys over 1024 bytes.
    fn check_key(&self, key: &str) -> Result<(), String> {
        let _ = key;
        Ok(())
    }

    /// Whether this backend offers `mode` (semaphores, read-write locks):
    /// `Err` says why not, and the runtime answers
    /// [`LockError::Config`](crate::LockError::Config) with it before any
    /// attempt. The default offers [`HoldMode::Exclusive`] only.
    fn offers(&self, mode: HoldMode) -> Result<(), String> {
        match mode {
            HoldMode::Exclusive => Ok(()),
            other => Err(format!(
                "the {} backend does not offer {other}",
                self.kind()
            )),
        }
    }

    /// One attempt to take the key for `request.owner`, for `request.lease`,
    /// in `request.mode`. Never waits for a busy key: the runtime's wait loop
    /// does. Holders of the key in another mode (see [`HoldMode`]) are an
    /// `Err` made with [`BackendError::config`] naming both.
    fn try_acquire<'a>(
        &'a self,
        request: &'a AcquireRequest,
    ) -> BoxFuture<'a, Result<Attempt, BackendError>>;

    /// One attempt to take every key of `requests` in one step (one script,
    /// one transaction): all of them or none, each with its own lease and
    /// fencing token as [`try_acquire`](Self::try_acquire) would issue them.
    /// The requests name distinct keys in the runtime's canonical order and
    /// share their owner, lease, wait and fencing; each has its own `lost`.
    /// Never waits for a busy key: the runtime's wait loop does, on the busy
    /// key's [`wake_source`](Self::wake_source), and then tries the whole
    /// step again.
    ///
    /// `None` (the default): this backend cannot take these keys in one
    /// step (a Redis Cluster whose keys are in different hash slots, session
    /// locks); the runtime then takes them one by one, in the same order.
    /// The answer must not change between calls with the same keys. A dropped
    /// or failed attempt is followed by an owner-checked
    /// [`release`](Self::release) of every key, as for single keys.
    fn try_acquire_all<'a>(
        &'a self,
        requests: &'a [AcquireRequest],
    ) -> Option<BoxFuture<'a, Result<AttemptAll, BackendError>>> {
        let _ = requests;
        None
    }

    /// What wakes this waiter when the holder releases `request.key` (a
    /// release message, a local notification, a watch on the predecessor in a
    /// queue, a polling interval). Called once per waiting acquisition, after
    /// its first busy answer and *before* it tries again, so that a release in
    /// between is not missed. The default has no wake-up: waiters try again
    /// when [`Attempt::Busy`]'s `retry_in` says.
    fn wake_source<'a>(&'a self, request: &'a AcquireRequest) -> BoxFuture<'a, WakeSource> {
        let _ = request;
        Box::pin(std::future::ready(WakeSource::none()))
    }

    /// The wait loop gave up on `request` (its budget ran out while busy or
    /// unavailable): drop whatever the attempts left on the server for it (a
    /// queued node, a waiter mark). Default: nothing. Dropped and failed
    /// acquisitions are followed by an owner-checked [`release`](Self::release)
    /// instead, so a backend that queues must also free a queued entry there.
    fn abandon<'a>(&'a self, request: &'a AcquireRequest) -> BoxFuture<'a, ()> {
        let _ = request;
        Box::pin(std::future::ready(()))
    }

    /// Extends each lease of `batch` to its `ttl` from now, if its
    /// [`owner`](Lease::owner) still holds it: one answer per lease, in the
    /// batch's order. The watchdog sends every renewal due on this backend in
    /// one call, so a backend sends them together where it can (a pipeline,
    /// one statement, one multi-read); one that cannot renews them one by one,
    /// concurrently.
    fn renew_all<'a>(
        &'a self,
        batch: &'a [(&'a Lease, Duration)],
    ) -> BoxFuture<'a, Vec<Result<Renewal, BackendError>>>;

    /// Extends one lease to `ttl` from now, if `lease.owner` still holds it.
    /// The default is a [`renew_all`](Self::renew_all) batch of one.
    fn renew<'a>(
        &'a self,
        lease: &'a Lease,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Renewal, BackendError>> {
        Box::pin(async move {
            let batch = [(lease, ttl)];
            self.renew_all(&batch).await.pop().unwrap_or_else(|| {
                Err(BackendError::permanent(format!(
                    "{}: no answer to a renewal",
                    self.kind()
                )))
            })
        })
    }

    /// Frees the key if `lease.owner` still holds it, and wakes its waiters.
    fn release<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<(), BackendError>>;

    /// How much shorter than the lease the holder must assume it to be, beyond
    /// the time before the request: clock drift between independent servers
    /// (Redlock: 1% of the lease + 2 ms). Zero for a single server.
    fn drift(&self, lease: Duration) -> Duration {
        let _ = lease;
        Duration::ZERO
    }

    /// How long a command whose caller went away may still run and take a
    /// key: the runtime's backstop release of an abandoned acquisition goes
    /// out after it (and [`Registry::shutdown`](crate::Registry::shutdown)
    /// waits for that backstop when it stopped an attempt on the wire). The
    /// default, 3 s, is longer than the network backends' command timeouts
    /// (their abandoned commands are also settled before the owner's release,
    /// where the backend can tell); a backend whose commands may wait longer
    /// where it cannot follow them says so.
    fn abandoned_command_bound(&self) -> Duration {
        Duration::from_secs(3)
    }

    /// Whether the runtime must run this backend's calls on dlock's own I/O
    /// runtime. True for clients that tie a connection to the runtime that
    /// opened it (sqlx pools), so that a registry keeps working after the
    /// runtime it was created on has shut down (each `#[tokio::test]` has its own).
    fn needs_io_runtime(&self) -> bool {
        true
    }

    /// Reads who holds the stored `key` from the server (not from this
    /// process's memory): `None` for a free key (no holder whose lease the
    /// server still counts). Bounded like every call.
    fn inspect<'a>(
        &'a self,
        key: &'a str,
    ) -> BoxFuture<'a, Result<Option<KeyEntry>, BackendError>> {
        let _ = key;
        Box::pin(std::future::ready(Err(unsupported(self.kind(), "inspect"))))
    }

    /// The held keys whose stored key starts with `prefix` (bytewise), in
    /// ascending key order, at most `limit` of them, read from the server.
    fn list<'a>(
        &'a self,
        prefix: &'a str,
        limit: usize,
    ) -> BoxFuture<'a, Result<Vec<KeyEntry>, BackendError>> {
        let _ = (prefix, limit);
        Box::pin(std::future::ready(Err(unsupported(self.kind(), "list"))))
    }

    /// Takes the stored `key` away from every holder on the server and answers
    /// what it removed (empty for a free key). Afterwards each holder's next
    /// renewal answers [`Renewal::Revoked`] (or [`Renewal::Lost`]), its release
    /// is harmless, and the next grant of the key carries a fencing token
    /// larger than every revoked one. Waiters are woken as by a release.
    fn revoke<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<Vec<HeldEntry>, BackendError>> {
        let _ = key;
        Box::pin(std::future::ready(Err(unsupported(self.kind(), "revoke"))))
    }
}

/// The error of a backend that cannot be inspected or revoked.
fn unsupported(kind: &str, what: &str) -> BackendError {
    BackendError::permanent(format!("{kind}: {what} is not supported by this backend"))
}

/// A duration in whole milliseconds, rounded **up** (at least 1): what a
/// backend sends a server as a lease, so the server's lease is never shorter
/// than the holder assumes. Saturates.
pub fn ceil_millis(d: Duration) -> u64 {
    let whole = d.as_millis() + u128::from(!d.subsec_nanos().is_multiple_of(1_000_000));
    u64::try_from(whole).unwrap_or(u64::MAX).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leases_sent_to_servers_round_up() {
        assert_eq!(ceil_millis(Duration::from_millis(1500)), 1500);
        assert_eq!(ceil_millis(Duration::from_micros(1_500_001)), 1501);
        assert_eq!(ceil_millis(Duration::from_nanos(1)), 1);
        assert_eq!(ceil_millis(Duration::ZERO), 1);
        assert_eq!(ceil_millis(Duration::MAX), u64::MAX);
    }
}
