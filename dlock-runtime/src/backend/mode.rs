//! What one grant holds of its key: the whole key, a reader's share, or one
//! permit of a semaphore.

use std::fmt;

/// The most permits a semaphore may have.
pub const MAX_PERMITS: u32 = 1024;

/// What a request asks for, and what a [`Lease`](super::Lease) holds, of
/// its key (DESIGN §7).
///
/// Compatibility on one key, decided by the backend on the server:
///
/// | held \ asked | `Exclusive` | `Shared` | `Permit { n }` |
/// |---|---|---|---|
/// | nothing | granted | granted unless a writer waits | granted (slot 0) |
/// | `Exclusive` | busy | busy | mismatch |
/// | `Shared` | busy (the writer then waits, and holds new readers back) | granted unless a writer waits | mismatch |
/// | `Permit { m }` | mismatch | mismatch | `m == n`: a free slot or busy; else mismatch |
///
/// A *mismatch* is a [`BackendError::config`](crate::BackendError::config)
/// naming both (the caller gets [`LockError::Config`](crate::LockError::Config)),
/// answered only while the key has holders: once every holder is gone any
/// mode is accepted.
///
/// A plain lock is [`Exclusive`](HoldMode::Exclusive): the write mode of its
/// key and a semaphore of one permit (the runtime turns `permits(1)` into
/// it). Fencing tokens increase strictly per key for `Exclusive` and
/// `Shared` grants together (one sequence per key), and per (key, slot) for
/// permits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum HoldMode {
    /// The key alone: a plain lock, the write mode of a read-write lock.
    /// **Writers are preferred**: a request that finds readers leaves a
    /// mark (until it is granted, gives up or is released) that makes new
    /// `Shared` requests wait behind it.
    #[default]
    Exclusive,
    /// A reader's share: any number of readers at once, never beside a
    /// writer, and not while a writer waits.
    Shared,
    /// One of `permits` (2 ..= [`MAX_PERMITS`]) permits: at most that many
    /// holders at once, each on its own slot `0..permits`
    /// ([`Lease::slot`](super::Lease::slot)).
    Permit {
        /// How many permits the semaphore has.
        permits: u32,
    },
}

impl HoldMode {
    /// The number of holders this mode allows at once (`1` for
    /// `Exclusive`, `None` for `Shared`: any number of readers).
    pub fn permits(self) -> Option<u32> {
        match self {
            HoldMode::Exclusive => Some(1),
            HoldMode::Shared => None,
            HoldMode::Permit { permits } => Some(permits),
        }
    }

    /// The text of the mismatch error every backend answers when `asked`
    /// meets holders of `held` on `key` (the user's key or the stored key).
    pub fn mismatch(key: &str, held: HoldMode, asked: HoldMode) -> String {
        format!(
            "`{key}` is held as {held}, and this call asks for it as {asked}: every holder \
             of a key must use the same kind of lock and number of permits (a plain lock \
             counts as 1 permit); a different one is accepted once every holder is gone"
        )
    }
}

impl fmt::Display for HoldMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HoldMode::Exclusive => f.write_str("a lock (1 permit, or the write mode)"),
            HoldMode::Shared => f.write_str("a read lock"),
            HoldMode::Permit { permits } => write!(f, "a semaphore of {permits} permits"),
        }
    }
}
