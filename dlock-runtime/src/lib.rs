//! # dlock — one attribute for "only one of these runs at a time, anywhere"
//!
//! ```no_run
//! use dlock_runtime::{distributed_lock, LockError, Registry};
//!
//! #[derive(Debug)]
//! enum AppError { Lock(LockError) }
//! impl From<LockError> for AppError { fn from(e: LockError) -> Self { AppError::Lock(e) } }
//! struct Order { id: u64 }
//!
//! #[distributed_lock(key = "order:{order.id}", wait = "3s", lease = "10s")]
//! async fn pay(order: &Order) -> Result<u64, AppError> {
//!     // Runs in one process at a time for this order, across every machine
//!     // sharing the backend. The lease is renewed while this runs and released
//!     // on return, `?`, panic or cancellation.
//!     let token = dlock_runtime::current().unwrap().fencing_token();
//!     Ok(token.map(u64::from).unwrap_or(0))
//! }
//!
//! # async fn start() -> Result<(), LockError> {
//! // once, at startup
//! dlock_runtime::init(Registry::from_url("sqlite://target/locks.db").await?)?;
//! # Ok(()) }
//! ```
//!
//! The pieces:
//!
//! - [`distributed_lock`]: the attribute (arguments, return types, equivalent code).
//! - [`init`], [`Registry`]: the backends an application locks through, set once.
//! - [`lock()`], [`LockGuard`]: the same locks without the attribute.
//! - [`current()`]: the lock the current task holds, with its [`FencingToken`].
//! - [`backend`]: the [`LockBackend`] trait and the backends.
//! - [`LockError`]: what can go wrong.
//! - [`fence`]: the store-side check that refuses a stale holder's write.
//! - [`Registry::stats`], [`LossReason`] and, with the feature `metrics`, the `metrics` module:
//!   what the locks did, for operators.
//!
//! ## Guarantees, and their limits
//!
//! A lock is a **lease**: it ends by itself after `lease` unless the registry's
//! watchdog renews it (every `lease / 3`) while the holder runs. A process that
//! dies therefore blocks others for at most one lease. A process that *pauses*
//! (GC, SIGSTOP, swap) longer than its lease may wake up believing it still
//! holds the lock while another does: no lease-based lock can prevent that.
//! What prevents the damage is the **fencing token** each acquisition carries —
//! strictly increasing per key — when the protected storage refuses writes
//! with a token lower than one it has seen.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod admin;
pub mod backend;
mod driver;
mod error;
#[cfg(any(
    feature = "postgres",
    feature = "mysql",
    feature = "sqlite",
    feature = "redis"
))]
pub mod fence;
mod key;
mod lease;
mod outcome;
mod stats;
mod time;
mod token;

#[doc(hidden)]
#[path = "private.rs"]
pub mod __private;

pub use admin::{Admin, HolderInfo, LockInfo};
pub use backend::memory::MemoryBackend;
#[cfg(feature = "redis")]
pub use backend::redis::RedisBackend;
#[cfg(feature = "redis")]
pub use backend::redis::redlock::RedlockBackend;

#[cfg(feature = "etcd")]
pub use backend::etcd::EtcdBackend;
#[cfg(feature = "mysql")]
pub use backend::sql::MysqlBackend;
#[cfg(feature = "postgres")]
pub use backend::sql::PostgresBackend;
#[cfg(feature = "sqlite")]
pub use backend::sql::SqliteBackend;
#[cfg(feature = "zookeeper")]
pub use backend::zookeeper::ZooKeeperBackend;
pub use backend::{HoldMode, LockBackend, MAX_PERMITS, connect};
pub use dlock_macros::distributed_lock;
pub use error::{BackendError, LockError};
pub use key::{DEFAULT_PREFIX, MAX_KEY_LEN};
pub use lease::{
    CurrentLock, DEFAULT_LEASE, IntoBackend, LockBuilder, LockGuard, LossReason, Registry,
    RegistryBuilder, ShutdownReport, current, global, init, lock, lock_all, shutdown,
};
pub use outcome::{LockOutcome, SkipOutcome, SkipValue};
pub use stats::Stats;
#[cfg(feature = "metrics")]
pub use stats::metrics;
pub use time::MIN_LEASE;
pub use token::FencingToken;
