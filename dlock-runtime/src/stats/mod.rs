//! What a registry's locks did: the counters behind [`Registry::stats`](crate::Registry::stats)
//! (always on: a few atomic additions per lock) and, with the `metrics`
//! feature, the same events through the [`metrics`](crate::metrics) facade.

use std::borrow::Cow;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::lease::LossReason;

#[cfg(feature = "metrics")]
pub mod metrics;

/// A snapshot of what a registry's locks did since it was built; see
/// [`Registry::stats`](crate::Registry::stats).
///
/// Leases count one per key: a hold of several keys is several leases, and
/// a nested (reentrant) hold shares its outer lease and counts nothing. Every
/// lease granted ends once, released or lost, so
/// `acquired == held + released + lost` whenever no lock is taken or
/// released while the snapshot is read.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Stats {
    /// Leases granted by a backend.
    pub acquired: u64,
    /// Acquisitions answered busy (the `wait` budget ran out), whatever the
    /// busy policy: skips included.
    pub busy: u64,
    /// Bodies not run because the lock was busy under `on_busy = "skip"`
    /// (also counted in `busy`).
    pub skipped: u64,
    /// Leases whose release their holder asked for while they were still
    /// held (by `release()`, a dropped guard, the attribute, shutdown).
    pub released: u64,
    /// Leases lost while held, every reason together.
    pub lost: u64,
    /// Leases lost, per reason: `(reason, count)` for every [`LossReason`],
    /// in the order of [`LossReason::ALL`].
    pub lost_by_reason: Vec<(LossReason, u64)>,
    /// Renewals the backend confirmed.
    pub renewals: u64,
    /// Renewals that failed (an error or no answer in time; retried until the
    /// give-up instant). A renewal answered "not ours" is a loss instead.
    pub renewal_failures: u64,
    /// Leases held now (granted, neither released nor lost).
    pub held: u64,
    /// Acquisitions in progress now: waiting for a busy key, or for the
    /// backend's answer.
    pub waiting: u64,
}

impl Stats {
    /// The count of losses for one reason.
    pub fn lost_for(&self, reason: LossReason) -> u64 {
        self.lost_by_reason
            .iter()
            .find(|(r, _)| *r == reason)
            .map_or(0, |(_, n)| *n)
    }
}

/// A registry's counters.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    acquired: AtomicU64,
    busy: AtomicU64,
    skipped: AtomicU64,
    released: AtomicU64,
    lost: [AtomicU64; LossReason::ALL.len()],
    renewals: AtomicU64,
    renewal_failures: AtomicU64,
    held: AtomicU64,
    waiting: AtomicU64,
}

/// Where an event happened: the registry's counters and the metrics' labels.
#[derive(Debug, Clone)]
pub(crate) struct Site {
    pub(crate) counters: Arc<Counters>,
    /// The backend's name in the registry (`default` for the default one).
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    pub(crate) backend: Arc<str>,
    /// The `key` label: the attribute's key template, or what
    /// [`LockBuilder::key_label`](crate::LockBuilder::key_label) set.
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    pub(crate) key_label: Option<Cow<'static, str>>,
}

/// How an acquisition ended, for the wait-time histogram.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WaitOutcome {
    Acquired,
    Busy,
    Failed,
}

impl WaitOutcome {
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            WaitOutcome::Acquired => "acquired",
            WaitOutcome::Busy => "busy",
            WaitOutcome::Failed => "error",
        }
    }
}

fn add(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

impl crate::Registry {
    /// What this registry's locks did since it was built: counters of
    /// leases acquired, released and lost (by [`LossReason`]), busy answers,
    /// skipped bodies, renewals, and how many leases are held and
    /// acquisitions in progress now. Synchronous and cheap (atomic loads):
    /// read it as often as needed. See [`Stats`] for what each counts.
    pub fn stats(&self) -> Stats {
        self.inner.counters.snapshot()
    }
}

impl Counters {
    pub(crate) fn snapshot(&self) -> Stats {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let lost_by_reason: Vec<(LossReason, u64)> = LossReason::ALL
            .into_iter()
            .map(|r| (r, get(&self.lost[r.index()])))
            .collect();
        Stats {
            acquired: get(&self.acquired),
            busy: get(&self.busy),
            skipped: get(&self.skipped),
            released: get(&self.released),
            lost: lost_by_reason.iter().map(|(_, n)| n).sum(),
            lost_by_reason,
            renewals: get(&self.renewals),
            renewal_failures: get(&self.renewal_failures),
            held: get(&self.held),
            waiting: get(&self.waiting),
        }
    }
}

impl Site {
    /// An acquisition began; the returned guard ends it (counted in `waiting`
    /// until dropped).
    pub(crate) fn waiting(&self) -> Waiting<'_> {
        add(&self.counters.waiting);
        #[cfg(feature = "metrics")]
        metrics::waiting(self, 1.0);
        Waiting(self)
    }

    /// An acquisition ended after `waited`.
    pub(crate) fn waited(&self, outcome: WaitOutcome, waited: Duration) {
        if outcome == WaitOutcome::Busy {
            add(&self.counters.busy);
            #[cfg(feature = "metrics")]
            metrics::busy(self);
        }
        #[cfg(feature = "metrics")]
        metrics::waited(self, outcome, waited);
        #[cfg(not(feature = "metrics"))]
        let _ = waited;
    }

    /// A body was skipped (`on_busy = "skip"`).
    pub(crate) fn skipped(&self) {
        add(&self.counters.skipped);
        #[cfg(feature = "metrics")]
        metrics::skipped(self);
    }

    /// A lease was granted.
    pub(crate) fn acquired(&self) {
        add(&self.counters.acquired);
        add(&self.counters.held);
        #[cfg(feature = "metrics")]
        metrics::acquired(self);
    }

    /// A held lease's release was asked for, after `held_for`.
    pub(crate) fn released(&self, held_for: Duration) {
        add(&self.counters.released);
        self.counters.held.fetch_sub(1, Ordering::Relaxed);
        #[cfg(feature = "metrics")]
        metrics::released(self, held_for);
        #[cfg(not(feature = "metrics"))]
        let _ = held_for;
    }

    /// A held lease was lost after `held_for`; the holder heard of it `late`
    /// after the instant it should have (its give-up instant, or its ceiling).
    pub(crate) fn lost(&self, reason: LossReason, held_for: Duration, late: Duration) {
        add(&self.counters.lost[reason.index()]);
        self.counters.held.fetch_sub(1, Ordering::Relaxed);
        #[cfg(feature = "metrics")]
        metrics::lost(self, reason, held_for, late);
        #[cfg(not(feature = "metrics"))]
        let _ = (held_for, late);
    }

    /// A renewal was confirmed (`true`) or failed (`false`).
    pub(crate) fn renewal(&self, renewed: bool) {
        add(if renewed {
            &self.counters.renewals
        } else {
            &self.counters.renewal_failures
        });
        #[cfg(feature = "metrics")]
        metrics::renewal(self, renewed);
    }
}

/// An acquisition in progress (see [`Site::waiting`]).
pub(crate) struct Waiting<'a>(&'a Site);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.counters.waiting.fetch_sub(1, Ordering::Relaxed);
        #[cfg(feature = "metrics")]
        metrics::waiting(self.0, -1.0);
    }
}
