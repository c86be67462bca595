//! Fencing tokens.

use std::fmt;

/// A number that strictly increases each time a key is acquired on a backend.
///
/// Pass it with every write the lock protects; the storage rejects a write whose
/// token is lower than the highest it has seen. A holder that paused past its
/// lease (GC, SIGSTOP, a slow network) then cannot overwrite the work of the
/// holder that came after it, which a lease alone cannot promise.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FencingToken(u64);

impl FencingToken {
    /// Wraps a raw token value (as stored by the backend).
    pub const fn new(value: u64) -> Self {
        FencingToken(value)
    }

    /// The raw value.
    pub const fn get(self) -> u64 {
        self.0
    }
}

impl From<FencingToken> for u64 {
    fn from(token: FencingToken) -> u64 {
        token.0
    }
}

impl fmt::Debug for FencingToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "FencingToken({})", self.0)
    }
}

impl fmt::Display for FencingToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}
