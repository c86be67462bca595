//! dlock's metrics through the [`metrics`](https://docs.rs/metrics) facade
//! (cargo feature `metrics`): the application installs a recorder (e.g.
//! `metrics-exporter-prometheus`), dlock only emits. Without a recorder each
//! event costs an atomic load.
//!
//! | name | kind | labels | what |
//! |---|---|---|---|
//! | [`ACQUIRED_TOTAL`] | counter | `backend`, `key` | leases granted |
//! | [`BUSY_TOTAL`] | counter | `backend`, `key` | acquisitions answered busy (skips included) |
//! | [`SKIPPED_TOTAL`] | counter | `backend`, `key` | bodies skipped under `on_busy = "skip"` |
//! | [`RELEASED_TOTAL`] | counter | `backend`, `key` | leases released by their holder |
//! | [`LOST_TOTAL`] | counter | `backend`, `key`, `reason` | leases lost, by [`LossReason`](crate::LossReason) |
//! | [`RENEWALS_TOTAL`] | counter | `backend`, `key`, `outcome` (`renewed`, `failed`) | renewals |
//! | [`HELD`] | gauge | `backend`, `key` | leases held now |
//! | [`WAITING`] | gauge | `backend`, `key` | acquisitions in progress now |
//! | [`WAIT_SECONDS`] | histogram | `backend`, `key`, `outcome` (`acquired`, `busy`, `error`) | time spent acquiring |
//! | [`HOLD_SECONDS`] | histogram | `backend`, `key`, `outcome` (`released`, `lost`) | time from the grant to the release or the loss |
//! | [`LOSS_LATENESS_SECONDS`] | histogram | `backend`, `key`, `reason` | how late a loss reached the holder after the instant it should have (its give-up instant; the ceiling for `max_hold`); zero when the server reported it earlier |
//!
//! `backend` is the backend's name in the registry (`default` for the
//! default one). `key` is the **template** of the attribute's key
//! (`order:{order.id}`; the templates of `keys = [..]` joined by `,`):
//! bounded by construction, never the formatted key. Locks taken with
//! [`lock`](crate::lock()) have no `key` label unless
//! [`LockBuilder::key_label`](crate::LockBuilder::key_label) gives one.

use std::time::Duration;

use metrics::Label;

use super::{Site, WaitOutcome};
use crate::lease::LossReason;

/// Counter: leases granted.
pub const ACQUIRED_TOTAL: &str = "dlock_acquired_total";
/// Counter: acquisitions answered busy, whatever the busy policy.
pub const BUSY_TOTAL: &str = "dlock_busy_total";
/// Counter: bodies not run under `on_busy = "skip"`.
pub const SKIPPED_TOTAL: &str = "dlock_skipped_total";
/// Counter: leases released by their holder.
pub const RELEASED_TOTAL: &str = "dlock_released_total";
/// Counter: leases lost, labelled with their `reason`.
pub const LOST_TOTAL: &str = "dlock_lost_total";
/// Counter: renewals, labelled with their `outcome` (`renewed`, `failed`).
pub const RENEWALS_TOTAL: &str = "dlock_renewals_total";
/// Gauge: leases held now.
pub const HELD: &str = "dlock_held_leases";
/// Gauge: acquisitions in progress now.
pub const WAITING: &str = "dlock_waiting_acquisitions";
/// Histogram: seconds spent acquiring, labelled with the `outcome`.
pub const WAIT_SECONDS: &str = "dlock_wait_seconds";
/// Histogram: seconds from the grant to the release (`outcome="released"`)
/// or the loss (`outcome="lost"`).
pub const HOLD_SECONDS: &str = "dlock_hold_seconds";
/// Histogram: seconds between the instant a holder should have heard of its
/// loss and the instant it did, labelled with the `reason`.
pub const LOSS_LATENESS_SECONDS: &str = "dlock_loss_lateness_seconds";

/// Label key: the backend's name in the registry.
pub const LABEL_BACKEND: &str = "backend";
/// Label key: the key template.
pub const LABEL_KEY: &str = "key";
/// Label key: how an acquisition, a renewal or a hold ended.
pub const LABEL_OUTCOME: &str = "outcome";
/// Label key: the [`LossReason`](crate::LossReason) of a loss.
pub const LABEL_REASON: &str = "reason";

/// Describes every metric to the installed recorder (units and help texts).
/// Optional: call it once after installing the recorder.
pub fn describe() {
    use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
    describe_counter!(ACQUIRED_TOTAL, "dlock leases granted");
    describe_counter!(BUSY_TOTAL, "dlock acquisitions answered busy");
    describe_counter!(
        SKIPPED_TOTAL,
        "dlock bodies skipped because the lock was busy"
    );
    describe_counter!(RELEASED_TOTAL, "dlock leases released by their holder");
    describe_counter!(LOST_TOTAL, "dlock leases lost while held");
    describe_counter!(RENEWALS_TOTAL, "dlock lease renewals");
    describe_gauge!(HELD, "dlock leases held now");
    describe_gauge!(WAITING, "dlock acquisitions in progress");
    describe_histogram!(
        WAIT_SECONDS,
        Unit::Seconds,
        "time spent acquiring a dlock lock"
    );
    describe_histogram!(HOLD_SECONDS, Unit::Seconds, "time a dlock lease was held");
    describe_histogram!(
        LOSS_LATENESS_SECONDS,
        Unit::Seconds,
        "how late the loss of a dlock lease reached its holder"
    );
}

fn labels(site: &Site, extra: Option<(&'static str, &'static str)>) -> Vec<Label> {
    let mut labels = Vec::with_capacity(3);
    labels.push(Label::new(LABEL_BACKEND, site.backend.clone()));
    if let Some(key) = &site.key_label {
        labels.push(Label::new(LABEL_KEY, key.clone()));
    }
    if let Some((k, v)) = extra {
        labels.push(Label::new(k, v));
    }
    labels
}

pub(super) fn waiting(site: &Site, delta: f64) {
    metrics::gauge!(WAITING, labels(site, None)).increment(delta);
}

pub(super) fn busy(site: &Site) {
    metrics::counter!(BUSY_TOTAL, labels(site, None)).increment(1);
}

pub(super) fn waited(site: &Site, outcome: WaitOutcome, waited: Duration) {
    let labels = labels(site, Some((LABEL_OUTCOME, outcome.as_str())));
    metrics::histogram!(WAIT_SECONDS, labels).record(waited.as_secs_f64());
}

pub(super) fn skipped(site: &Site) {
    metrics::counter!(SKIPPED_TOTAL, labels(site, None)).increment(1);
}

pub(super) fn acquired(site: &Site) {
    let labels = labels(site, None);
    metrics::counter!(ACQUIRED_TOTAL, labels.clone()).increment(1);
    metrics::gauge!(HELD, labels).increment(1.0);
}

pub(super) fn released(site: &Site, held_for: Duration) {
    let labels = labels(site, None);
    metrics::counter!(RELEASED_TOTAL, labels.clone()).increment(1);
    metrics::gauge!(HELD, labels).decrement(1.0);
    let labels = self::labels(site, Some((LABEL_OUTCOME, "released")));
    metrics::histogram!(HOLD_SECONDS, labels).record(held_for.as_secs_f64());
}

pub(super) fn lost(site: &Site, reason: LossReason, held_for: Duration, late: Duration) {
    metrics::gauge!(HELD, labels(site, None)).decrement(1.0);
    let with_reason = labels(site, Some((LABEL_REASON, reason.as_str())));
    metrics::counter!(LOST_TOTAL, with_reason.clone()).increment(1);
    metrics::histogram!(LOSS_LATENESS_SECONDS, with_reason).record(late.as_secs_f64());
    let labels = labels(site, Some((LABEL_OUTCOME, "lost")));
    metrics::histogram!(HOLD_SECONDS, labels).record(held_for.as_secs_f64());
}

pub(super) fn renewal(site: &Site, renewed: bool) {
    let outcome = if renewed { "renewed" } else { "failed" };
    let labels = labels(site, Some((LABEL_OUTCOME, outcome)));
    metrics::counter!(RENEWALS_TOTAL, labels).increment(1);
}
