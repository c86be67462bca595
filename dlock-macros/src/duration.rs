//! A small humantime-style duration parser, run at compile time.
//!
//! The macro crate may depend only on `syn`, `quote` and `proc-macro2` (a proc-macro
//! is compiled for every user, so its dependency tree is kept minimal), so it cannot
//! use the `humantime` crate that the runtime uses. This parser accepts the subset of
//! humantime's syntax that makes sense for lock timings: one or more
//! `<integer><unit>` groups, optionally separated by whitespace, e.g. `"250ms"`,
//! `"3s"`, `"1m 30s"`, `"1h30m"`.

use std::time::Duration;

/// What every error message ends with: the accepted form.
pub(crate) const EXPECTED: &str =
    "expected e.g. \"250ms\", \"3s\", \"1m 30s\" (units: ns, us, ms, s, m, h, d)";

const NANOS_PER_SEC: u128 = 1_000_000_000;

/// Nanoseconds in one `unit`, or `None` for an unknown unit.
fn unit_nanos(unit: &str) -> Option<u128> {
    Some(match unit {
        "ns" | "nsec" | "nsecs" => 1,
        // U+00B5 MICRO SIGN and U+03BC GREEK SMALL LETTER MU look the same.
        "us" | "\u{b5}s" | "\u{3bc}s" | "usec" | "usecs" => 1_000,
        "ms" | "msec" | "msecs" => 1_000_000,
        "s" | "sec" | "secs" | "second" | "seconds" => NANOS_PER_SEC,
        "m" | "min" | "mins" | "minute" | "minutes" => 60 * NANOS_PER_SEC,
        "h" | "hr" | "hrs" | "hour" | "hours" => 3_600 * NANOS_PER_SEC,
        "d" | "day" | "days" => 86_400 * NANOS_PER_SEC,
        _ => return None,
    })
}

/// Parses `text` (the contents of a string literal) into a [`Duration`].
///
/// The error is a complete, user-facing message that quotes `text`, says what is
/// wrong and lists the accepted form.
pub(crate) fn parse(text: &str) -> Result<Duration, String> {
    let fail = |detail: &str| format!("invalid duration `{text}`: {detail}; {EXPECTED}");

    let mut rest = text.trim();
    if rest.is_empty() {
        return Err(format!("empty duration: {EXPECTED}"));
    }

    let mut total: u128 = 0;
    while !rest.is_empty() {
        // The number.
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        if digits == 0 {
            let detail = if rest.starts_with('-') {
                "negative durations are not allowed".to_owned()
            } else {
                format!("expected a number at `{rest}`")
            };
            return Err(fail(&detail));
        }
        let (number, after) = rest.split_at(digits);
        let value: u128 = number
            .parse()
            .map_err(|_| fail(&format!("the number `{number}` is too large")))?;

        // The unit (whitespace between the number and its unit is tolerated).
        let after = after.trim_start();
        let unit_len = after
            .char_indices()
            .find(|&(_, c)| !c.is_alphabetic())
            .map_or(after.len(), |(i, _)| i);
        let (unit, after) = after.split_at(unit_len);
        if unit.is_empty() {
            let detail = if after.starts_with(['.', ',']) {
                "fractions are not supported, use a smaller unit (e.g. \"1500ms\" for 1.5s)"
                    .to_owned()
            } else {
                format!("the number `{number}` has no unit")
            };
            return Err(fail(&detail));
        }
        let Some(per_unit) = unit_nanos(unit) else {
            return Err(fail(&format!("unknown unit `{unit}`")));
        };

        total = value
            .checked_mul(per_unit)
            .and_then(|nanos| total.checked_add(nanos))
            .ok_or_else(|| fail("too large"))?;
        rest = after.trim_start();
    }

    let secs = u64::try_from(total / NANOS_PER_SEC).map_err(|_| fail("too large"))?;
    let nanos = u32::try_from(total % NANOS_PER_SEC).map_err(|_| fail("too large"))?;
    Ok(Duration::new(secs, nanos))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(text: &str) -> Duration {
        parse(text).unwrap_or_else(|e| panic!("{text:?} should parse: {e}"))
    }

    fn err(text: &str) -> String {
        match parse(text) {
            Ok(d) => panic!("{text:?} should not parse, got {d:?}"),
            Err(e) => e,
        }
    }

    #[test]
    fn single_units() {
        assert_eq!(ok("0s"), Duration::ZERO);
        assert_eq!(ok("7ns"), Duration::from_nanos(7));
        assert_eq!(ok("7us"), Duration::from_micros(7));
        assert_eq!(ok("7\u{b5}s"), Duration::from_micros(7));
        assert_eq!(ok("7\u{3bc}s"), Duration::from_micros(7));
        assert_eq!(ok("250ms"), Duration::from_millis(250));
        assert_eq!(ok("3s"), Duration::from_secs(3));
        assert_eq!(ok("3sec"), Duration::from_secs(3));
        assert_eq!(ok("3secs"), Duration::from_secs(3));
        assert_eq!(ok("1second"), Duration::from_secs(1));
        assert_eq!(ok("3seconds"), Duration::from_secs(3));
        assert_eq!(ok("2m"), Duration::from_secs(120));
        assert_eq!(ok("2min"), Duration::from_secs(120));
        assert_eq!(ok("2mins"), Duration::from_secs(120));
        assert_eq!(ok("1minute"), Duration::from_secs(60));
        assert_eq!(ok("2minutes"), Duration::from_secs(120));
        assert_eq!(ok("1h"), Duration::from_secs(3600));
        assert_eq!(ok("1hr"), Duration::from_secs(3600));
        assert_eq!(ok("2hrs"), Duration::from_secs(7200));
        assert_eq!(ok("1hour"), Duration::from_secs(3600));
        assert_eq!(ok("2hours"), Duration::from_secs(7200));
        assert_eq!(ok("1d"), Duration::from_secs(86_400));
        assert_eq!(ok("1day"), Duration::from_secs(86_400));
        assert_eq!(ok("2days"), Duration::from_secs(172_800));
    }

    #[test]
    fn combined_groups() {
        assert_eq!(ok("1m 30s"), Duration::from_secs(90));
        assert_eq!(ok("1m30s"), Duration::from_secs(90));
        assert_eq!(ok("1h30m"), Duration::from_secs(5400));
        assert_eq!(ok("1s 500ms"), Duration::from_millis(1500));
        assert_eq!(
            ok("1d 2h 3m 4s 5ms 6us 7ns"),
            Duration::new(93_784, 5_006_007)
        );
        assert_eq!(ok("  3s  "), Duration::from_secs(3));
        assert_eq!(ok("3 s"), Duration::from_secs(3));
        assert_eq!(ok("1500ms"), Duration::from_millis(1500));
        assert_eq!(ok("1000000000ns"), Duration::from_secs(1));
    }

    #[test]
    fn limits() {
        assert_eq!(ok(&format!("{}s", u64::MAX)), Duration::new(u64::MAX, 0));
        assert_eq!(
            ok(&format!("{}s 999999999ns", u64::MAX)),
            Duration::new(u64::MAX, 999_999_999)
        );
        assert!(err(&format!("{}s 1s", u64::MAX)).contains("too large"));
        assert!(err(&format!("{}d", u64::MAX)).contains("too large"));
        assert!(err("9999999999999999999999999999999999999999999s").contains("too large"));
    }

    #[test]
    fn errors_name_the_problem_and_the_accepted_form() {
        assert_eq!(
            err("3 seconds x"),
            "invalid duration `3 seconds x`: expected a number at `x`; \
             expected e.g. \"250ms\", \"3s\", \"1m 30s\" (units: ns, us, ms, s, m, h, d)"
        );
        assert!(err("").starts_with("empty duration: expected e.g."));
        assert!(err("   ").starts_with("empty duration"));
        assert!(err("3").contains("the number `3` has no unit"));
        assert!(err("3x").contains("unknown unit `x`"));
        assert!(err("3S").contains("unknown unit `S`"));
        assert!(err("3 weeks").contains("unknown unit `weeks`"));
        assert!(err("1.5s").contains("fractions are not supported"));
        assert!(err("-1s").contains("negative"));
        assert!(err("s").contains("expected a number at `s`"));
        assert!(err("1s,2s").contains("expected a number at `,2s`"));
        assert!(err("3x").ends_with(EXPECTED));
    }
}
