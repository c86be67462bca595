//! Why a lease was lost.

use std::fmt;

/// Why a held lease was lost: on [`LockGuard::loss_reason`](crate::LockGuard::loss_reason),
/// [`CurrentLock::loss_reason`](crate::CurrentLock::loss_reason), the `dlock
/// lease lost` tracing event (field `reason`), [`Stats::lost_by_reason`](crate::Stats::lost_by_reason)
/// and the metrics' `reason` label ([`as_str`](LossReason::as_str)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum LossReason {
    /// Not renewed by its give-up instant (the local end of the lease minus a
    /// safety margin, before the server's expiry): the server was unreachable,
    /// failing or too slow to answer the renewals in time.
    Expired,
    /// The server answered a renewal (or `hold_at_least`'s extension) that the
    /// key is no longer ours: it expired there, was deleted by hand, or was
    /// taken over.
    Gone,
    /// An operator revoked the key ([`LockBackend::revoke`](crate::LockBackend::revoke)):
    /// the server answered a renewal with [`Renewal::Revoked`](crate::backend::Renewal::Revoked).
    Revoked,
    /// The hold reached its `max_hold` ceiling: the renewals stopped.
    MaxHold,
    /// A hold taken with `watchdog = false` reached the end of its lease (its hard cap).
    HardCap,
    /// The backend learned on its own that the lease is gone: its session
    /// expired (ZooKeeper, etcd) or its connection ended (PostgreSQL and
    /// MySQL session mode).
    SessionEnded,
    /// The registry shut down ([`Registry::shutdown`](crate::Registry::shutdown)):
    /// the holder is told to stop, and the lease is released.
    Shutdown,
}

impl LossReason {
    /// Every reason, in declaration order.
    pub const ALL: [LossReason; 7] = [
        LossReason::Expired,
        LossReason::Gone,
        LossReason::Revoked,
        LossReason::MaxHold,
        LossReason::HardCap,
        LossReason::SessionEnded,
        LossReason::Shutdown,
    ];

    /// A short stable name: `expired`, `gone`, `revoked`, `max_hold`,
    /// `hard_cap`, `session_ended`, `shutdown` (the metrics' `reason` label).
    pub fn as_str(self) -> &'static str {
        match self {
            LossReason::Expired => "expired",
            LossReason::Gone => "gone",
            LossReason::Revoked => "revoked",
            LossReason::MaxHold => "max_hold",
            LossReason::HardCap => "hard_cap",
            LossReason::SessionEnded => "session_ended",
            LossReason::Shutdown => "shutdown",
        }
    }

    /// What it means, for the tracing event.
    pub(crate) fn describe(self) -> &'static str {
        match self {
            LossReason::Expired => {
                "not renewed by its give-up instant (before the server's expiry)"
            }
            LossReason::Gone => "the key is no longer ours on the server",
            LossReason::Revoked => "the key was revoked on the server",
            LossReason::MaxHold => "the hold reached its max_hold ceiling",
            LossReason::HardCap => "the lease reached its hard cap (watchdog = false)",
            LossReason::SessionEnded => "the backend's session or connection ended",
            LossReason::Shutdown => "the registry is shutting down",
        }
    }

    pub(crate) fn index(self) -> usize {
        self as usize
    }
}

impl fmt::Display for LossReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_reason_has_its_own_index_and_name() {
        for (i, reason) in LossReason::ALL.into_iter().enumerate() {
            assert_eq!(reason.index(), i);
        }
        let mut names: Vec<_> = LossReason::ALL.iter().map(|r| r.as_str()).collect();
        names.dedup();
        assert_eq!(names.len(), LossReason::ALL.len());
    }
}
