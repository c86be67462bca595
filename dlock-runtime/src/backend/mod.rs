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
//! | [`redis`] | `redis://`, `rediss://`, `redis+cluster://` | `redis` |
//! | [`redlock`] | `redlock://h1:p1,h2:p2,h3:p3` | `redis` |

use std::any::Any;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::future::BoxFuture;
use tokio_util::sync::CancellationToken;

use crate::error::{BackendError, LockError, redact_url};
use crate::token::FencingToken;

pub mod memory;
#[cfg(feature = "redis")]
pub mod redis;
#[cfg(feature = "redis")]
pub mod redlock;
#[cfg(feature = "sqlite")]
pub mod sql;

/// What the runtime asks a backend for when it acquires a lock.
#[derive(Debug)]
#[non_exhaustive]
pub struct AcquireRequest {
    /// The stored key: the registry's prefix followed by the user's key.
    pub key: String,
    /// A random token unique to this acquisition; only its holder may extend or
    /// release the lease.
    pub owner: String,
    /// How long the lease lasts unless renewed.
    pub lease: Duration,
    /// How long the backend may wait for a busy key before answering
    /// [`Acquired::Busy`]; zero means try once.
    pub wait: Duration,
    /// Cancelled by the backend when it learns on its own that the lease is gone
    /// (a session expired, a connection died). The runtime watches it.
    pub lost: CancellationToken,
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
        }
    }

    /// Waits up to `wait` for a busy key.
    pub fn with_wait(mut self, wait: Duration) -> Self {
        self.wait = wait;
        self
    }
}

/// A lease granted by a backend.
pub struct Lease {
    /// The stored key.
    pub key: String,
    /// The owner token of the acquisition.
    pub owner: String,
    /// The fencing token, if the backend has a safe one.
    pub token: Option<FencingToken>,
    /// A conservative local bound on the lease's end: the instant *before* the
    /// request was sent, plus the lease length.
    pub valid_until: Instant,
    /// Backend-specific state kept with the lease (a node path, a dedicated connection).
    pub extra: Option<Arc<dyn Any + Send + Sync>>,
}

impl fmt::Debug for Lease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lease")
            .field("key", &self.key)
            .field("token", &self.token)
            .field("valid_until", &self.valid_until)
            .finish_non_exhaustive()
    }
}

/// The answer to an acquisition.
#[derive(Debug)]
pub enum Acquired {
    /// The key is ours.
    Held(Lease),
    /// The key stayed busy for the whole wait budget.
    Busy,
}

/// The answer to a renewal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Renewal {
    /// The lease was extended; it is valid at least until this instant.
    Renewed {
        /// The new conservative local bound.
        valid_until: Instant,
    },
    /// The key is no longer ours (expired, deleted, taken over).
    Lost,
}

/// A lock store. Object safe: the registry holds `Arc<dyn LockBackend>`.
///
/// Implementations must make [`acquire`](LockBackend::acquire),
/// [`renew`](LockBackend::renew) and [`release`](LockBackend::release) atomic on
/// the server and owner-checked, and must answer within the request's wait
/// budget plus one network timeout — never hang.
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

    /// Takes the key for `request.owner`, waiting up to `request.wait` for it.
    fn acquire<'a>(
        &'a self,
        request: &'a AcquireRequest,
    ) -> BoxFuture<'a, Result<Acquired, BackendError>>;

    /// Extends the lease to `ttl` from now, if `lease.owner` still holds it.
    fn renew<'a>(
        &'a self,
        lease: &'a Lease,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Renewal, BackendError>>;

    /// Renews many leases at once. The default renews them one by one,
    /// concurrently; backends that can batch (pipelines, one statement) override it.
    fn renew_all<'a>(
        &'a self,
        batch: &'a [(&'a Lease, Duration)],
    ) -> BoxFuture<'a, Vec<Result<Renewal, BackendError>>> {
        Box::pin(futures_util::future::join_all(
            batch.iter().map(|(lease, ttl)| self.renew(lease, *ttl)),
        ))
    }

    /// Frees the key if `lease.owner` still holds it, and wakes its waiters.
    fn release<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<(), BackendError>>;

    /// Whether the runtime must run this backend's calls on dlock's own I/O
    /// runtime. True for clients that tie a connection to the runtime that
    /// opened it (sqlx pools), so that a registry keeps working after the
    /// runtime it was created on has shut down (each `#[tokio::test]` has its own).
    fn needs_io_runtime(&self) -> bool {
        true
    }
}

/// The URL schemes dlock knows, for error messages.
const SCHEMES: &str = "memory://, sqlite://path, redis://, rediss://, redis+cluster://, \
     redlock://, zk://, postgres://, mysql://";

/// Opens the backend a URL names.
///
/// `memory://`, `sqlite://path` (feature `sqlite`), `redis://`, `rediss://`,
/// `redis+cluster://` and `redlock://` (feature `redis`) are available in this
/// release; the other schemes of the design (`zk://`, `postgres://`,
/// `mysql://`) are recognised and answer a [`LockError::Config`] that says they
/// are not built yet.
pub async fn connect(url: &str) -> Result<Arc<dyn LockBackend>, LockError> {
    let scheme = url
        .split_once(':')
        .map(|(scheme, _)| scheme.to_ascii_lowercase())
        .ok_or_else(|| {
            LockError::config(format!(
                "`{}` is not a lock URL; expected one of {SCHEMES}",
                redact_url(url)
            ))
        })?;
    match scheme.as_str() {
        "memory" => Ok(Arc::new(memory::MemoryBackend::new())),
        #[cfg(feature = "sqlite")]
        "sqlite" => Ok(Arc::new(sql::SqliteBackend::connect(url).await?)),
        #[cfg(not(feature = "sqlite"))]
        "sqlite" => Err(LockError::config(
            "the `sqlite` backend is disabled: enable the `sqlite` feature of dlock-runtime",
        )),
        #[cfg(feature = "redis")]
        "redis" | "rediss" | "redis+cluster" | "rediss+cluster" => {
            Ok(Arc::new(redis::RedisBackend::connect(url).await?))
        }
        #[cfg(feature = "redis")]
        "redlock" | "redlocks" => Ok(Arc::new(redlock::RedlockBackend::connect(url).await?)),
        #[cfg(not(feature = "redis"))]
        "redis" | "rediss" | "redis+cluster" | "rediss+cluster" | "redlock" | "redlocks" => {
            Err(LockError::config(format!(
                "the `{scheme}` backend is disabled: enable the `redis` feature of dlock-runtime"
            )))
        }
        "zk" | "postgres" | "postgresql" | "mysql" | "mariadb" => Err(LockError::config(format!(
            "the `{scheme}` backend is not built yet in this release of dlock-runtime \
             (available: memory://, sqlite://path, redis://, rediss://, redis+cluster://, \
             redlock://)"
        ))),
        _ => Err(LockError::config(format!(
            "unknown lock URL scheme `{scheme}` in `{}`; expected one of {SCHEMES}",
            redact_url(url)
        ))),
    }
}
