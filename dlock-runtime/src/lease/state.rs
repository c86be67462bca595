//! The lease state machine: every phase change of a held lease, in one type.
//!
//! ```text
//!             begin_renewal              finish_renewal(Renewed / Failed, before give-up)
//!   Held ─────────────────────▶ Renewing ───────────────────────────────────────▶ Held
//!    │  ╲                          │  ╲ finish_renewal(Lost), or give-up instant passed
//!    │   ╲ give-up instant passed  │   ╲
//!    │    ╲────────────────────────┼────▶ Lost
//!    │ request_release             │ request_release (its answer no longer reschedules;
//!    ▼                             ▼  hold_at_least waits for it before it shortens the key)
//!  ReleaseRequested ◀──────────────┘◀─── Lost (request_release: still sent, owner-checked)
//!    │ finish_release
//!    ▼
//!  Released
//! ```
//!
//! Pure: no I/O, no clock reads (every method takes `now`), so the
//! interleavings are unit-tested below. The watchdog only schedules by
//! [`LeaseState::due`]; [`HeldLease`](super::held::HeldLease) does the I/O.
//!
//! Two rules make it safe under failures:
//!
//! - **Loss is time-driven.** A lease not renewed by its give-up instant (its
//!   local validity minus the safety margin, before the server's expiry) is
//!   lost at that instant — whether a renewal is still on the wire or not.
//! - **A release request is final.** From then on no renewal is begun, and the
//!   answer of one already on the wire reschedules nothing.

use std::time::{Duration, Instant};

use crate::time::{give_up_at, renew_period, retry_after};

/// Where a lease is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Held; the watchdog renews it when due.
    Held,
    /// A renewal is on the wire.
    Renewing,
    /// Lost (expired, taken over, not renewed in time); the key may be held elsewhere.
    Lost,
    /// Release asked for (by `release()`, `Drop`, the attribute or shutdown):
    /// no renewal will be sent again.
    ReleaseRequested,
    /// The release (or `hold_at_least`'s shortening) is done.
    Released,
}

/// What the watchdog must do for a lease, and when.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Due {
    /// Begin a renewal at this instant (a batch window early is fine).
    Renew(Instant),
    /// Declare the lease lost at this instant unless it has been renewed (never early).
    GiveUp(Instant),
}

impl Due {
    pub(crate) fn at(self) -> Instant {
        match self {
            Due::Renew(at) | Due::GiveUp(at) => at,
        }
    }
}

/// A renewal in flight: which one, and when its request was sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RenewalTicket {
    generation: u64,
    pub(crate) sent: Instant,
}

/// Which instant ended a lease that time ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TimeLoss {
    /// Its give-up instant passed without a renewal.
    GiveUp,
    /// Its `max_hold` ceiling passed.
    Ceiling,
}

/// What a renewal came back with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RenewalAnswer {
    /// Extended by the lease length (minus the backend's drift) from `sent`.
    Renewed {
        /// The backend's drift for this lease.
        drift: Duration,
    },
    /// The server says the key is not ours.
    Lost,
    /// No answer (error, timeout): retried until the give-up instant.
    Failed,
}

/// What [`LeaseState::finish_renewal`] decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Finished {
    /// Held again, valid longer.
    Renewed,
    /// Held, to be retried soon.
    Retry,
    /// Lost now.
    Lost,
    /// The answer came for a lease that moved on (released, or already lost
    /// at its give-up instant): nothing changes.
    Ignored,
}

/// What a release request found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ReleaseStart {
    /// The lease had been lost: the release is still sent (owner-checked),
    /// and the holder is told `Lost`.
    pub(crate) was_lost: bool,
}

/// The state of one held lease. See the [module docs](self).
#[derive(Debug)]
pub(crate) struct LeaseState {
    phase: Phase,
    lease: Duration,
    renews: bool,
    valid_until: Instant,
    next_renewal: Instant,
    generation: u64,
    /// A renewal is on the wire (begun, not yet answered).
    renewal_in_flight: bool,
    lost: bool,
    /// `max_hold`: no renewal from this instant on, and the lease counts as lost.
    ceiling: Option<Instant>,
}

impl LeaseState {
    /// A lease granted until `valid_until`, renewed by the watchdog when `renews`.
    pub(crate) fn new(valid_until: Instant, lease: Duration, renews: bool, now: Instant) -> Self {
        let mut state = LeaseState {
            phase: Phase::Held,
            lease,
            renews,
            valid_until,
            next_renewal: now + renew_period(lease),
            generation: 0,
            renewal_in_flight: false,
            lost: false,
            ceiling: None,
        };
        state.next_renewal = state.next_renewal.min(state.give_up_at());
        state
    }

    #[cfg(test)]
    pub(crate) fn phase(&self) -> Phase {
        self.phase
    }

    #[cfg(test)]
    pub(crate) fn valid_until(&self) -> Instant {
        self.valid_until
    }

    /// The instant at which the lease counts as lost unless renewed.
    pub(crate) fn give_up_at(&self) -> Instant {
        give_up_at(self.valid_until, self.lease)
    }

    /// Caps the hold at `at` (`max_hold`), or earlier if it is capped already:
    /// from then on no renewal is begun and the lease counts as lost.
    pub(crate) fn cap_at(&mut self, at: Instant) {
        let at = self.ceiling.map_or(at, |c| c.min(at));
        self.ceiling = Some(at);
        self.next_renewal = self.next_renewal.min(at);
    }

    /// The `max_hold` ceiling, if any.
    pub(crate) fn ceiling(&self) -> Option<Instant> {
        self.ceiling
    }

    /// The instant time ends the lease unless renewed: its give-up instant,
    /// or its ceiling if that comes first.
    fn deadline(&self) -> Instant {
        let give_up = self.give_up_at();
        self.ceiling.map_or(give_up, |c| c.min(give_up))
    }

    /// Whether time has ended the lease by `now`, and which instant did.
    pub(crate) fn time_loss(&self, now: Instant) -> Option<TimeLoss> {
        match self.ceiling {
            Some(c) if c <= now && c <= self.give_up_at() => Some(TimeLoss::Ceiling),
            _ if self.give_up_at() <= now => Some(TimeLoss::GiveUp),
            _ => None,
        }
    }

    /// When the next renewal is due (meaningful while held).
    pub(crate) fn next_renewal(&self) -> Instant {
        self.next_renewal
    }

    /// Brings a held lease's next renewal forward to `at` if it is due later
    /// (renewing early is always safe): the keys of one hold, taken one after
    /// the other, are then renewed in one batch.
    pub(crate) fn renew_no_later_than(&mut self, at: Instant) {
        if self.phase == Phase::Held {
            self.next_renewal = self.next_renewal.min(at);
        }
    }

    pub(crate) fn due(&self) -> Option<Due> {
        match self.phase {
            Phase::Held if self.renews => Some(if self.next_renewal < self.deadline() {
                Due::Renew(self.next_renewal)
            } else {
                Due::GiveUp(self.deadline())
            }),
            Phase::Held | Phase::Renewing => Some(Due::GiveUp(self.deadline())),
            Phase::Lost | Phase::ReleaseRequested | Phase::Released => None,
        }
    }

    /// Whether the lease is known lost at `now` (also once its give-up
    /// instant or its ceiling has passed, before the watchdog has looked).
    pub(crate) fn is_lost(&self, now: Instant) -> bool {
        self.lost
            || (matches!(
                self.phase,
                Phase::Held | Phase::Renewing | Phase::ReleaseRequested
            ) && now >= self.deadline())
    }

    /// Time-driven loss: a held or renewing lease whose give-up instant (or
    /// ceiling) has passed is lost now. `Some` (which instant) if this call
    /// made it lost.
    pub(crate) fn expire(&mut self, now: Instant) -> Option<TimeLoss> {
        if !matches!(self.phase, Phase::Held | Phase::Renewing) {
            return None;
        }
        let loss = self.time_loss(now)?;
        self.mark_lost();
        Some(loss)
    }

    /// Lost for a reason the backend or the watchdog found. True if this call made it lost.
    pub(crate) fn mark_lost(&mut self) -> bool {
        let fresh = !self.lost;
        self.lost = true;
        if matches!(self.phase, Phase::Held | Phase::Renewing) {
            self.phase = Phase::Lost;
        }
        fresh
    }

    /// Starts a renewal if one is due by `due_by` (`now` plus the batch window).
    pub(crate) fn begin_renewal(&mut self, now: Instant, due_by: Instant) -> Option<RenewalTicket> {
        if self.phase != Phase::Held
            || !self.renews
            || now >= self.deadline()
            || self.next_renewal > due_by
        {
            return None;
        }
        self.phase = Phase::Renewing;
        self.generation += 1;
        self.renewal_in_flight = true;
        Some(RenewalTicket {
            generation: self.generation,
            sent: now,
        })
    }

    /// The renewal begun with `ticket` is about to go on the wire: true if it
    /// still may. A release asked for (or a loss) since it was begun cancels
    /// it — it is never sent — so "no renewal after a release request" holds
    /// also for a batch that was waiting to be sent.
    pub(crate) fn commit_renewal(&mut self, ticket: RenewalTicket) -> bool {
        if ticket.generation != self.generation {
            return false;
        }
        if self.phase == Phase::Renewing {
            return true;
        }
        self.renewal_in_flight = false;
        false
    }

    /// Takes a renewal's answer. Only the answer to the renewal in flight
    /// counts, and only while the lease is still renewing.
    pub(crate) fn finish_renewal(
        &mut self,
        ticket: RenewalTicket,
        answer: RenewalAnswer,
        now: Instant,
    ) -> Finished {
        if ticket.generation != self.generation {
            return Finished::Ignored;
        }
        self.renewal_in_flight = false;
        if self.phase != Phase::Renewing {
            return Finished::Ignored;
        }
        match answer {
            RenewalAnswer::Renewed { .. } if now >= self.give_up_at() => {
                // The holder was already told (`is_lost` reads the clock) that
                // the lease is gone: a late renewal cannot bring it back.
                self.mark_lost();
                Finished::Lost
            }
            RenewalAnswer::Renewed { drift } => {
                let renewed_until = ticket.sent + self.lease.saturating_sub(drift);
                self.valid_until = self.valid_until.max(renewed_until);
                if now >= self.give_up_at() {
                    // Answered too late to count: the holder has had to give up.
                    self.mark_lost();
                    return Finished::Lost;
                }
                self.phase = Phase::Held;
                self.next_renewal = (now + renew_period(self.lease)).min(self.deadline());
                Finished::Renewed
            }
            RenewalAnswer::Lost => {
                self.mark_lost();
                Finished::Lost
            }
            RenewalAnswer::Failed => {
                if now >= self.give_up_at() {
                    self.mark_lost();
                    return Finished::Lost;
                }
                self.phase = Phase::Held;
                self.next_renewal = (now + retry_after(self.lease)).min(self.deadline());
                Finished::Retry
            }
        }
    }

    /// Asks for the release. `None` if it was asked for already. From here on
    /// no renewal is begun and no answer reschedules anything.
    pub(crate) fn request_release(&mut self, now: Instant) -> Option<ReleaseStart> {
        self.expire(now);
        match self.phase {
            Phase::ReleaseRequested | Phase::Released => None,
            Phase::Held | Phase::Renewing | Phase::Lost => {
                self.phase = Phase::ReleaseRequested;
                Some(ReleaseStart {
                    was_lost: self.lost,
                })
            }
        }
    }

    /// Whether the release has been asked for.
    pub(crate) fn release_requested(&self) -> bool {
        matches!(self.phase, Phase::ReleaseRequested | Phase::Released)
    }

    /// Whether the release must wait for a renewal still on the wire (so that
    /// a late renewal cannot re-extend a key `hold_at_least` just shortened).
    pub(crate) fn renewal_in_flight(&self) -> bool {
        self.phase == Phase::ReleaseRequested && self.renewal_in_flight
    }

    /// The release is done. True the first time.
    pub(crate) fn finish_release(&mut self) -> bool {
        let first = self.phase != Phase::Released;
        self.phase = Phase::Released;
        first
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LEASE: Duration = Duration::from_secs(3);
    const MS: Duration = Duration::from_millis(1);

    fn fresh(now: Instant) -> LeaseState {
        LeaseState::new(now + LEASE, LEASE, true, now)
    }

    #[test]
    fn renews_every_third_and_extends_from_the_send() {
        let t0 = Instant::now();
        let mut s = fresh(t0);
        assert_eq!(s.due(), Some(Due::Renew(t0 + Duration::from_secs(1))));
        assert!(s.begin_renewal(t0, t0).is_none(), "not due yet");
        let t1 = t0 + Duration::from_secs(1);
        let ticket = s.begin_renewal(t1, t1).expect("due");
        assert_eq!(s.phase(), Phase::Renewing);
        assert_eq!(s.due(), Some(Due::GiveUp(t0 + LEASE - LEASE / 10)));
        let answer = RenewalAnswer::Renewed { drift: MS * 30 };
        assert_eq!(s.finish_renewal(ticket, answer, t1 + MS), Finished::Renewed);
        assert_eq!(s.valid_until(), t1 + LEASE - MS * 30);
        assert_eq!(s.due(), Some(Due::Renew(t1 + MS + Duration::from_secs(1))));
    }

    #[test]
    fn a_renewal_brought_forward_is_due_then() {
        let t0 = Instant::now();
        let mut s = fresh(t0);
        s.renew_no_later_than(t0 + Duration::from_secs(2));
        assert_eq!(
            s.due(),
            Some(Due::Renew(t0 + Duration::from_secs(1))),
            "never later"
        );
        s.renew_no_later_than(t0 + MS * 400);
        assert_eq!(s.due(), Some(Due::Renew(t0 + MS * 400)));
        assert!(s.begin_renewal(t0 + MS * 400, t0 + MS * 400).is_some());
        s.renew_no_later_than(t0);
        assert_eq!(
            s.phase(),
            Phase::Renewing,
            "a renewal on the wire is left alone"
        );
    }

    #[test]
    fn loss_is_time_driven_while_a_renewal_hangs() {
        let t0 = Instant::now();
        let mut s = fresh(t0);
        let t1 = t0 + Duration::from_secs(1);
        let ticket = s.begin_renewal(t1, t1).unwrap();
        let give_up = s.give_up_at();
        assert!(s.expire(give_up - MS).is_none());
        assert!(!s.is_lost(give_up - MS));
        assert!(
            s.is_lost(give_up),
            "is_lost reads the clock before the watchdog looks"
        );
        assert_eq!(s.expire(give_up), Some(TimeLoss::GiveUp));
        assert_eq!(s.phase(), Phase::Lost);
        // The hung renewal finally answers: too late, nothing changes.
        let late = RenewalAnswer::Renewed {
            drift: Duration::ZERO,
        };
        assert_eq!(
            s.finish_renewal(ticket, late, give_up + MS),
            Finished::Ignored
        );
        assert_eq!(s.phase(), Phase::Lost);
        assert_eq!(s.due(), None);
    }

    #[test]
    fn a_renewal_answered_after_the_give_up_instant_is_a_loss() {
        let t0 = Instant::now();
        let mut s = fresh(t0);
        let t1 = t0 + Duration::from_secs(1);
        let ticket = s.begin_renewal(t1, t1).unwrap();
        // Sent at t1, answered 2.8 s later: the renewal's own validity is
        // already past its give-up instant.
        let answered = t1 + Duration::from_millis(2800);
        let renewed = RenewalAnswer::Renewed {
            drift: Duration::ZERO,
        };
        assert_eq!(s.finish_renewal(ticket, renewed, answered), Finished::Lost);
    }

    #[test]
    fn failures_retry_until_the_give_up_instant_never_later() {
        let t0 = Instant::now();
        let mut s = fresh(t0);
        let mut now = t0 + Duration::from_secs(1);
        let mut retries = 0;
        loop {
            let ticket = s.begin_renewal(now, now).expect("due");
            match s.finish_renewal(ticket, RenewalAnswer::Failed, now + MS) {
                Finished::Retry => retries += 1,
                Finished::Lost => break,
                other => panic!("{other:?}"),
            }
            let due = s.due().unwrap();
            assert!(
                due.at() <= s.give_up_at(),
                "never scheduled past the give-up instant"
            );
            if let Due::GiveUp(at) = due {
                assert!(s.expire(at).is_some());
                break;
            }
            now = due.at();
        }
        assert!(retries > 5);
        assert!(s.is_lost(now));
    }

    #[test]
    fn release_requested_while_renewing_is_final() {
        let t0 = Instant::now();
        let mut s = fresh(t0);
        let t1 = t0 + Duration::from_secs(1);
        let ticket = s.begin_renewal(t1, t1).unwrap();
        let start = s.request_release(t1 + MS).expect("first request");
        assert!(!start.was_lost);
        assert!(s.renewal_in_flight());
        assert_eq!(s.request_release(t1 + MS), None, "asked once");
        assert_eq!(s.due(), None, "nothing left for the watchdog");
        let renewed = RenewalAnswer::Renewed {
            drift: Duration::ZERO,
        };
        assert_eq!(
            s.finish_renewal(ticket, renewed, t1 + MS * 2),
            Finished::Ignored
        );
        assert!(!s.renewal_in_flight());
        assert_eq!(
            s.phase(),
            Phase::ReleaseRequested,
            "not put back on the schedule"
        );
        assert!(s.begin_renewal(t1 + LEASE, t1 + LEASE).is_none());
        assert!(s.finish_release());
        assert!(!s.finish_release());
    }

    #[test]
    fn a_renewal_begun_but_not_yet_sent_is_cancelled_by_a_release_request() {
        let t0 = Instant::now();
        let mut s = fresh(t0);
        let t1 = t0 + Duration::from_secs(1);
        let ticket = s.begin_renewal(t1, t1).unwrap();
        s.request_release(t1).unwrap();
        assert!(s.renewal_in_flight());
        assert!(
            !s.commit_renewal(ticket),
            "never sent after the release request"
        );
        assert!(!s.renewal_in_flight(), "the release need not wait for it");
        // Without a release in between it goes out.
        let mut s = fresh(t0);
        let ticket = s.begin_renewal(t1, t1).unwrap();
        assert!(s.commit_renewal(ticket));
    }

    #[test]
    fn release_of_a_lost_lease_is_still_sent_and_reports_the_loss() {
        let t0 = Instant::now();
        let mut s = fresh(t0);
        assert!(s.mark_lost());
        assert_eq!(s.request_release(t0), Some(ReleaseStart { was_lost: true }));
        // A release asked for after the give-up instant, before the watchdog
        // noticed, also reports the loss.
        let mut s = fresh(t0);
        let late = s.give_up_at();
        assert_eq!(
            s.request_release(late),
            Some(ReleaseStart { was_lost: true })
        );
    }

    #[test]
    fn hard_cap_without_watchdog() {
        let t0 = Instant::now();
        let mut s = LeaseState::new(t0 + LEASE, LEASE, false, t0);
        assert_eq!(s.due(), Some(Due::GiveUp(t0 + LEASE - LEASE / 10)));
        assert!(s.begin_renewal(t0 + LEASE / 2, t0 + LEASE / 2).is_none());
        assert!(s.expire(t0 + LEASE).is_some());
    }

    #[test]
    fn stale_tickets_are_ignored() {
        let t0 = Instant::now();
        let mut s = fresh(t0);
        let t1 = t0 + Duration::from_secs(1);
        let first = s.begin_renewal(t1, t1).unwrap();
        assert_eq!(
            s.finish_renewal(first, RenewalAnswer::Failed, t1),
            Finished::Retry
        );
        let t2 = s.due().unwrap().at();
        let second = s.begin_renewal(t2, t2).unwrap();
        // A duplicate answer to the first renewal changes nothing.
        assert_eq!(
            s.finish_renewal(first, RenewalAnswer::Lost, t2),
            Finished::Ignored
        );
        let renewed = RenewalAnswer::Renewed {
            drift: Duration::ZERO,
        };
        assert_eq!(s.finish_renewal(second, renewed, t2), Finished::Renewed);
    }

    #[test]
    fn the_ceiling_stops_renewals_and_ends_the_lease() {
        let t0 = Instant::now();
        let mut s = fresh(t0);
        let ceiling = t0 + Duration::from_millis(2500);
        s.cap_at(ceiling);
        s.cap_at(t0 + Duration::from_secs(10));
        assert_eq!(s.ceiling(), Some(ceiling), "the earlier ceiling stays");
        let t1 = t0 + Duration::from_secs(1);
        let ticket = s.begin_renewal(t1, t1).expect("renewed before the ceiling");
        let renewed = RenewalAnswer::Renewed {
            drift: Duration::ZERO,
        };
        assert_eq!(s.finish_renewal(ticket, renewed, t1), Finished::Renewed);
        let t2 = t1 + Duration::from_secs(1);
        let ticket = s.begin_renewal(t2, t2).expect("still before the ceiling");
        assert_eq!(s.finish_renewal(ticket, renewed, t2), Finished::Renewed);
        // The next renewal would fall after the ceiling: the ceiling is due instead.
        assert_eq!(s.due(), Some(Due::GiveUp(ceiling)));
        assert!(s.begin_renewal(ceiling, ceiling).is_none());
        assert!(!s.is_lost(ceiling - MS));
        assert!(s.is_lost(ceiling));
        assert_eq!(s.expire(ceiling - MS), None);
        assert_eq!(s.expire(ceiling), Some(TimeLoss::Ceiling));
        assert_eq!(s.phase(), Phase::Lost);
    }

    #[test]
    fn a_give_up_before_the_ceiling_is_a_give_up() {
        let t0 = Instant::now();
        let mut s = fresh(t0);
        s.cap_at(t0 + Duration::from_secs(5));
        let give_up = s.give_up_at();
        assert_eq!(s.time_loss(give_up), Some(TimeLoss::GiveUp));
        assert_eq!(
            s.expire(t0 + Duration::from_secs(6)),
            Some(TimeLoss::GiveUp)
        );
    }
}
