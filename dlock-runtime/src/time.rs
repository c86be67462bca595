//! The timing rules of a lease, in one place: when it is renewed, when a
//! holder must give it up, and instant arithmetic that never panics.

use std::time::{Duration, Instant};

/// The shortest lease dlock accepts. Below it the watchdog's renewal period
/// (a third of the lease) would be shorter than the window in which it
/// batches renewals, and the safety margin shorter than a loopback round trip.
/// The attribute rejects a smaller `lease` at compile time; the builder
/// answers [`LockError::Config`](crate::LockError::Config).
pub const MIN_LEASE: Duration = Duration::from_millis(100);

/// About a century: what "forever" saturates to.
const FAR: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// `at + by`, saturating at a far future instant instead of panicking
/// (`wait(Duration::MAX)` means "forever").
pub(crate) fn saturating_add(at: Instant, by: Duration) -> Instant {
    at.checked_add(by.min(FAR))
        .or_else(|| at.checked_add(FAR))
        .unwrap_or(at)
}

/// How often a held lease is renewed: a third of its length.
pub(crate) fn renew_period(lease: Duration) -> Duration {
    lease / 3
}

/// How long before the local end of a lease its holder gives it up when it
/// could not be renewed: a tenth of the lease, at most one second.
pub(crate) fn safety_margin(lease: Duration) -> Duration {
    (lease / 10).min(Duration::from_secs(1))
}

/// The instant at which a lease valid until `valid_until` counts as lost
/// unless renewed: before the server's expiry, by the safety margin.
pub(crate) fn give_up_at(valid_until: Instant, lease: Duration) -> Instant {
    valid_until
        .checked_sub(safety_margin(lease))
        .unwrap_or(valid_until)
}

/// How soon a failed renewal is tried again.
pub(crate) fn retry_after(lease: Duration) -> Duration {
    (lease / 15).max(Duration::from_millis(5))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn saturates() {
        let now = Instant::now();
        assert!(saturating_add(now, Duration::MAX) > now + Duration::from_secs(3600 * 24 * 365));
        assert_eq!(
            saturating_add(now, Duration::from_secs(1)),
            now + Duration::from_secs(1)
        );
    }

    #[test]
    fn margins() {
        assert_eq!(safety_margin(MIN_LEASE), Duration::from_millis(10));
        assert_eq!(
            safety_margin(Duration::from_secs(60)),
            Duration::from_secs(1)
        );
        assert!(renew_period(MIN_LEASE) > Duration::from_millis(30));
        let now = Instant::now();
        assert!(give_up_at(now + MIN_LEASE, MIN_LEASE) < now + MIN_LEASE);
    }
}
