//! How the command shows locks to a person: aligned tables, a detail block,
//! durations in the largest units that matter.

use std::fmt::Write as _;
use std::time::{Duration, SystemTime};

use dlock_runtime::{HolderInfo, LockInfo};

/// The table's column titles.
const HEADER: [&str; 6] = [
    "KEY",
    "HOLDER",
    "HELD FOR",
    "EXPIRES IN",
    "TOKEN",
    "WAITERS",
];

/// A duration as a person reads it: `0.4s`, `3.2s`, `42s`, `4m12s`,
/// `2h03m`, `3d04h`.
pub(crate) fn duration(d: Duration) -> String {
    let secs = d.as_secs();
    if secs < 10 {
        // Tenths, rounded down, so that a lease never looks longer than it is.
        let tenths = d.as_millis() / 100;
        format!("{}.{}s", tenths / 10, tenths % 10)
    } else if secs < 60 {
        format!("{secs}s")
    } else if secs < 3600 {
        format!("{}m{:02}s", secs / 60, secs % 60)
    } else if secs < 86_400 {
        format!("{}h{:02}m", secs / 3600, secs % 3600 / 60)
    } else {
        format!("{}d{:02}h", secs / 86_400, secs % 86_400 / 3600)
    }
}

/// Who holds it: `name (host pid N)`, `host pid N` without an instance name,
/// `unknown` for a grant without a holder record; readers and semaphore
/// slots marked.
pub(crate) fn holder(h: &HolderInfo) -> String {
    let mut out = match (h.host(), h.pid()) {
        (Some(host), Some(pid)) => format!("{host} pid {pid}"),
        (Some(host), None) => host.to_owned(),
        (None, Some(pid)) => format!("pid {pid}"),
        (None, None) => String::new(),
    };
    out = match (h.name(), out.is_empty()) {
        (Some(name), false) => format!("{name} ({out})"),
        (Some(name), true) => name.to_owned(),
        (None, false) => out,
        (None, true) => "unknown".to_owned(),
    };
    if h.is_reader() {
        out.push_str(" [reader]");
    }
    if let Some(slot) = h.slot() {
        let _ = write!(out, " [slot {slot}]");
    }
    out
}

/// How long it has been held, by `now` against the server's grant time
/// (zero when the clocks disagree the other way); `-` where unknown.
pub(crate) fn held_for(h: &HolderInfo, now: SystemTime) -> String {
    match h.granted_at() {
        Some(at) => duration(now.duration_since(at).unwrap_or_default()),
        None => "-".to_owned(),
    }
}

/// How long the lease has left; `session` for holds that end with their
/// connection.
pub(crate) fn expires_in(h: &HolderInfo) -> String {
    match h.expires_in() {
        Some(d) => duration(d),
        None => "session".to_owned(),
    }
}

/// The fencing token, `-` for unfenced holds.
pub(crate) fn token(h: &HolderInfo) -> String {
    h.token()
        .map_or_else(|| "-".to_owned(), |t| t.get().to_string())
}

/// The waiters, `-` where the backend does not know them.
pub(crate) fn waiters(info: &LockInfo) -> String {
    info.waiters()
        .map_or_else(|| "-".to_owned(), |n| n.to_string())
}

/// The aligned table of `locks`, one row per holder (a read lock's readers
/// each on their own row, the key and waiters on the first), ending in a
/// newline.
pub(crate) fn table(locks: &[LockInfo], now: SystemTime) -> String {
    let mut rows: Vec<[String; 6]> = vec![HEADER.map(str::to_owned)];
    for info in locks {
        for (i, h) in info.holders().iter().enumerate() {
            let first = i == 0;
            rows.push([
                if first {
                    info.key().to_owned()
                } else {
                    String::new()
                },
                holder(h),
                held_for(h, now),
                expires_in(h),
                token(h),
                if first { waiters(info) } else { String::new() },
            ]);
        }
    }
    let mut widths = [0usize; 6];
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    for row in &rows {
        let mut line = String::new();
        for (i, (cell, w)) in row.iter().zip(widths).enumerate() {
            if i > 0 {
                line.push_str("  ");
            }
            let _ = write!(line, "{cell:<w$}");
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// `dlock show`'s block: one field a line, every holder.
pub(crate) fn detail(info: &LockInfo, now: SystemTime) -> String {
    let mut out = format!("key:         {}\n", info.key());
    for h in info.holders() {
        let _ = writeln!(out, "holder:      {}", holder(h));
        let _ = writeln!(out, "token:       {}", token(h));
        match h.granted_at() {
            Some(at) => {
                let _ = writeln!(
                    out,
                    "granted at:  {} (held for {})",
                    humantime::format_rfc3339_seconds(at),
                    held_for(h, now)
                );
            }
            None => out.push_str("granted at:  -\n"),
        }
        let _ = writeln!(out, "expires in:  {}", expires_in(h));
    }
    let _ = writeln!(out, "waiters:     {}", waiters(info));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_use_the_largest_units_that_matter() {
        let cases = [
            (Duration::ZERO, "0.0s"),
            (Duration::from_millis(380), "0.3s"),
            (Duration::from_millis(9_999), "9.9s"),
            (Duration::from_secs(10), "10s"),
            (Duration::from_secs(59), "59s"),
            (Duration::from_secs(60), "1m00s"),
            (Duration::from_secs(4 * 60 + 12), "4m12s"),
            (Duration::from_secs(2 * 3600 + 3 * 60 + 59), "2h03m"),
            (Duration::from_secs(3 * 86_400 + 4 * 3600 + 5), "3d04h"),
        ];
        for (d, text) in cases {
            assert_eq!(duration(d), text, "{d:?}");
        }
    }

    #[tokio::test]
    async fn a_held_key_is_one_row_under_aligned_titles() {
        let registry = dlock_runtime::Registry::builder()
            .default_backend(dlock_runtime::MemoryBackend::new())
            .holder_name("api-1")
            .build();
        let guard = registry.lock("orders:42").acquire().await.expect("held");
        let locks = registry.list("", 10).await.expect("listed");
        let text = table(&locks, SystemTime::now());
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 2, "{text}");
        let row = lines[1];
        assert!(row.starts_with("orders:42  api-1 ("), "{row}");
        assert!(
            row.contains(&format!(" pid {})", std::process::id())),
            "{row}"
        );
        let token = guard.fencing_token().expect("fenced").get().to_string();
        for title in ["HOLDER", "HELD FOR", "EXPIRES IN", "TOKEN"] {
            let at = lines[0].find(title).expect("title");
            assert_eq!(&row[at - 2..at], "  ", "{title} column:\n{text}");
            assert_ne!(&row[at..=at], " ", "{title} column:\n{text}");
        }
        let at = lines[0].find("TOKEN").expect("title");
        assert!(row[at..].starts_with(&token), "token column:\n{text}");
        guard.release().await.expect("released");
    }

    #[test]
    fn an_empty_table_is_its_header() {
        assert_eq!(
            table(&[], SystemTime::now()),
            "KEY  HOLDER  HELD FOR  EXPIRES IN  TOKEN  WAITERS\n"
        );
    }
}
