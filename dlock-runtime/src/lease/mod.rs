//! A lease's life, from its acquisition to its release, and what looks after
//! it while it is held. Backends know nothing of it: they store leases; this
//! decides when to ask them.
//!
//! | module | what |
//! |---|---|
//! | [`registry`] | the backends a lease is taken through, set once, each registry with its watchdog and shutdown tracker |
//! | [`lock`] | taking a lock: the builder, the acquisition, a nested hold of a lease this call chain holds |
//! | [`guard`] | the guard the holder keeps |
//! | [`held`] | one held lease, shared by its guards and the watchdog: the I/O around its state machine |
//! | [`state`] | the lease's state machine (pure: no I/O, no clock) |
//! | [`loss`] | why a lease was lost |
//! | [`watchdog`] | the renewal scheduler of a registry |
//! | [`context`] | the locks the current task holds: [`current()`](crate::current()), reentrancy |
//! | [`background`] | releases no caller awaits (a dropped guard, an abandoned acquisition) |
//! | [`shutdown`] | the live leases and releases in flight, and the graceful shutdown that waits for them |

mod background;
mod context;
mod guard;
mod held;
mod lock;
mod loss;
mod registry;
mod shutdown;
mod state;
mod watchdog;

pub use context::{CurrentLock, current};
#[cfg(any(
    feature = "postgres",
    feature = "mysql",
    feature = "sqlite",
    feature = "redis"
))]
pub(crate) use context::{TokenFor, token_for};
pub use guard::LockGuard;
pub use lock::{DEFAULT_LEASE, LockBuilder, lock, lock_all};
pub(crate) use lock::{Keys, LockOptions, acquire_counted, count_skipped};
pub use loss::LossReason;
pub use registry::{IntoBackend, Registry, RegistryBuilder, global, init};
pub use shutdown::{ShutdownReport, shutdown};
