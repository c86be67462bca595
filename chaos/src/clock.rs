//! One clock for every process of a run.
//!
//! `std::time::Instant` is `CLOCK_MONOTONIC` on Linux but does not expose its value,
//! so histories written by different processes could not be merged. Reading the
//! clock directly gives nanoseconds that all processes of the machine share.

use nix::time::{ClockId, clock_gettime};

/// Nanoseconds on the machine's monotonic clock.
pub(crate) fn now_ns() -> u64 {
    let t = clock_gettime(ClockId::CLOCK_MONOTONIC).expect("CLOCK_MONOTONIC is always there");
    u64::try_from(t.tv_sec()).unwrap_or(0) * 1_000_000_000 + u64::try_from(t.tv_nsec()).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    #[test]
    fn moves_forward() {
        let a = super::now_ns();
        std::thread::sleep(std::time::Duration::from_millis(2));
        assert!(super::now_ns() >= a + 2_000_000);
    }
}
