//! What keeps a SQL backend's state bounded and its leases in the units the
//! statements take: the collection of old free rows, lease lengths in
//! milliseconds (or microseconds), and the waiters that registered a wake-up
//! source (for back-off and wake-up marks).

#[cfg(any(feature = "postgres", feature = "mysql"))]
use std::collections::HashMap;
#[cfg(any(feature = "postgres", feature = "mysql"))]
use std::sync::Arc;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::backend::ceil_millis;

/// How long free rows are kept by default before they are collected.
pub(crate) const DEFAULT_RETENTION: Duration = Duration::from_secs(600);

/// How often, at most, a backend collects free rows.
const COLLECT_EVERY: Duration = Duration::from_secs(60);

/// A lease (or a retention) in whole milliseconds for a statement: rounded up
/// ([`ceil_millis`]), and small enough that the server's date arithmetic
/// cannot overflow.
pub(crate) fn millis(d: Duration) -> i64 {
    i64::try_from(ceil_millis(d))
        .unwrap_or(i64::MAX)
        .min(MAX_SQL_MILLIS)
}

/// About 1,000 years: the longest lease a SQL backend stores (a
/// `timestamptz` ends in the year 294276, MySQL's microseconds at 2^63).
const MAX_SQL_MILLIS: i64 = 1000 * 365 * 24 * 3600 * 1000;

/// The same in microseconds (MySQL stores microseconds).
#[cfg(feature = "mysql")]
pub(crate) fn micros(d: Duration) -> i64 {
    millis(d) * 1000
}

/// Deletes free rows now and then: at most once a minute (or once a
/// retention, if shorter), rows free or expired for longer than the
/// retention. Safe with hybrid tokens: a key locked again after its row was
/// deleted gets a token above every old one (the clock has moved on).
#[derive(Debug)]
pub(crate) struct Collector {
    pub(crate) retention: Duration,
    last: Mutex<Instant>,
}

impl Collector {
    pub(crate) fn new(retention: Duration) -> Self {
        Collector {
            retention,
            last: Mutex::new(Instant::now()),
        }
    }

    /// Whether it is time to collect; if so, the next time is a period away.
    pub(crate) fn due(&self) -> bool {
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        if last.elapsed() < COLLECT_EVERY.min(self.retention) {
            return false;
        }
        *last = Instant::now();
        true
    }
}

/// The waiters of this backend that registered a wake-up source (the wait
/// loop does so after their first busy answer), with how many times each has
/// looked since: for the back-off of backends that poll, and for the marks
/// PostgreSQL waiters set on a key. An entry lives as long as its waiter's
/// wake-up source, so the map holds O(current waiters).
#[cfg(any(feature = "postgres", feature = "mysql"))]
#[derive(Debug, Default)]
pub(crate) struct Contenders {
    map: Mutex<HashMap<String, u32>>,
}

/// The first back-off of a polling waiter; it doubles up to the backend's cap.
#[cfg(any(feature = "postgres", feature = "mysql"))]
const FIRST_BACKOFF: Duration = Duration::from_millis(5);

#[cfg(any(feature = "postgres", feature = "mysql"))]
impl Contenders {
    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<String, u32>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers `owner` until the returned guard is dropped (keep it in the
    /// waiter's [`WakeSource`](crate::backend::WakeSource)).
    pub(crate) fn register(self: &Arc<Self>, owner: &str) -> Contender {
        self.map().insert(owner.to_owned(), 0);
        Contender {
            contenders: self.clone(),
            owner: owner.to_owned(),
        }
    }

    /// Whether `owner` waits with a registered wake-up source.
    #[cfg(feature = "postgres")]
    pub(crate) fn is_registered(&self, owner: &str) -> bool {
        self.map().contains_key(owner)
    }

    /// The next back-off of `owner`: 5 ms, doubling up to `cap`; `None` if it
    /// has not registered (its first attempt, or it does not wait at all).
    pub(crate) fn next_backoff(&self, owner: &str, cap: Duration) -> Option<Duration> {
        let mut map = self.map();
        let looked = map.get_mut(owner)?;
        let backoff = FIRST_BACKOFF
            .saturating_mul(1 << (*looked).min(16))
            .min(cap);
        *looked = looked.saturating_add(1);
        Some(backoff)
    }

    /// Registered waiters right now.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.map().len()
    }
}

/// A registered waiter; dropping it unregisters.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) struct Contender {
    contenders: Arc<Contenders>,
    owner: String,
}

#[cfg(any(feature = "postgres", feature = "mysql"))]
impl Drop for Contender {
    fn drop(&mut self) {
        self.contenders.map().remove(&self.owner);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sql_millis_round_up_and_stay_in_range() {
        assert_eq!(millis(Duration::from_micros(1500)), 2);
        assert_eq!(millis(Duration::MAX), MAX_SQL_MILLIS);
    }

    #[cfg(any(feature = "postgres", feature = "mysql"))]
    #[test]
    fn contenders_back_off_and_leave_with_their_wake_source() {
        let contenders = Arc::new(Contenders::default());
        let cap = Duration::from_millis(50);
        assert_eq!(contenders.next_backoff("a", cap), None, "not registered");
        let a = contenders.register("a");
        let b = contenders.register("b");
        let backoffs: Vec<_> = (0..6)
            .map(|_| contenders.next_backoff("a", cap).unwrap().as_millis())
            .collect();
        assert_eq!(backoffs, [5, 10, 20, 40, 50, 50]);
        assert_eq!(contenders.len(), 2);
        drop(a);
        assert_eq!(contenders.next_backoff("a", cap), None);
        drop(b);
        assert_eq!(contenders.len(), 0);
    }
}
