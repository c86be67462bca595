//! What every SQL backend shares for [`inspect`](crate::backend::LockBackend::inspect),
//! [`list`](crate::backend::LockBackend::list) and
//! [`revoke`](crate::backend::LockBackend::revoke) on the lease table: the
//! range a prefix covers, and a row read back as a [`HeldEntry`].
//!
//! **Columns.** Three nullable columns beside the lease: `holder` (the
//! [`HolderRecord`] in its one-line text form), `granted_at` (when the row
//! was granted to its owner, on the database's clock: milliseconds since
//! the epoch on SQLite, a `timestamptz` on PostgreSQL, microseconds in
//! `granted_us` on MySQL) and
//! `revoked` (the last owner an operator revoked). Tables created by earlier
//! versions lack them: each backend adds them when it connects (`ALTER TABLE
//! … ADD COLUMN`, an addition that concurrent processes may race: a column
//! another process added meanwhile counts as added). A role that may not
//! alter the table gets a configuration error at connect naming the
//! statements to run (the exported `DDL` has the columns). MySQL's lease
//! mode writes the record once per registry into `<table>_procs` instead
//! and reads it back by a join (see `mysql`); its `holder` column keeps the
//! record of owners of another form.
//! Session mode keeps the stored key, the holder record and the grant time
//! in the key's `<table>_fence` row instead, written by the lock statement
//! and added to old tables the same way.
//!
//! **Revocation** frees the row the way a release does — `owner = NULL`,
//! the expiry now — and writes the revoked owner into `revoked`; the row and
//! its token stay, so the next grant's hybrid token is larger than the
//! revoked one. It is owner-checked: the row is read, then freed only if the
//! same owner still holds it (a grant in between is left alone and read
//! again). A renewal that finds its row gone reads `revoked` to tell a
//! revocation from an expiry. The revoked holder's release matches no row.
//! Session mode ends the holder's connection instead, after marking the
//! grant's end in the counter table, which is how the holder tells a
//! revocation from another end of its connection and how two revocations
//! at once end it once (see `session.rs`).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::backend::{HeldEntry, HolderRecord};
use crate::token::FencingToken;

/// How many times a revocation reads the row again when its holder changed
/// between the read and the write.
pub(super) const REVOKE_ATTEMPTS: usize = 5;

/// The smallest string above every string that starts with `prefix`, in
/// code-point (UTF-8 byte) order: `None` when there is none (an empty
/// prefix, or one made only of `char::MAX`). `list` reads the range
/// `prefix <= key < successor`, which an index on the key serves.
pub(super) fn prefix_successor(prefix: &str) -> Option<String> {
    let mut chars: Vec<char> = prefix.chars().collect();
    while let Some(last) = chars.pop() {
        let next = match last as u32 + 1 {
            0xD800 => Some('\u{E000}'),
            n => char::from_u32(n),
        };
        if let Some(next) = next {
            chars.push(next);
            return Some(chars.into_iter().collect());
        }
    }
    None
}

/// One lease-table row as the admin statements read it (public in the
/// PostgreSQL and MySQL dialects' trait).
#[derive(Debug, Clone)]
#[cfg_attr(
    not(any(feature = "postgres", feature = "mysql")),
    allow(unreachable_pub)
)]
pub struct Row {
    /// The stored key.
    pub key: String,
    /// The owner token.
    pub owner: String,
    /// The holder record's text, if the grant stored one.
    pub holder: Option<String>,
    /// The fencing token.
    pub token: i64,
    /// When the row was granted, since the epoch, in the dialect's unit.
    pub granted_at: Option<i64>,
    /// What is left of the lease, in milliseconds.
    pub expires_in_ms: i64,
}

impl Row {
    /// The row as a holder entry; `granted_unit` is the length of one unit
    /// of `granted_at`.
    pub(super) fn entry(&self, granted_unit: Duration) -> HeldEntry {
        let mut entry = HeldEntry::new(self.owner.clone());
        entry.holder = self.holder.as_deref().and_then(HolderRecord::decode);
        entry.token = u64::try_from(self.token).ok().map(FencingToken::new);
        entry.granted_at = self
            .granted_at
            .and_then(|n| u64::try_from(n).ok())
            .and_then(|n| since_epoch(granted_unit, n));
        entry.expires_in = Some(Duration::from_millis(self.expires_in_ms.max(0) as u64));
        entry
    }
}

/// `n` units since the epoch; `None` past what `SystemTime` holds.
fn since_epoch(unit: Duration, n: u64) -> Option<SystemTime> {
    let nanos = u64::try_from(unit.as_nanos()).ok()?.checked_mul(n)?;
    UNIX_EPOCH.checked_add(Duration::from_nanos(nanos))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_successors_bound_the_prefix_range() {
        assert_eq!(prefix_successor(""), None);
        assert_eq!(prefix_successor("dlock:a").as_deref(), Some("dlock:b"));
        assert_eq!(prefix_successor("a\u{D7FF}").as_deref(), Some("a\u{E000}"));
        assert_eq!(prefix_successor("ab\u{10FFFF}").as_deref(), Some("ac"));
        assert_eq!(prefix_successor("\u{10FFFF}"), None);
        let (low, high) = ("dlock:x", prefix_successor("dlock:x").unwrap());
        for inside in ["dlock:x", "dlock:x:1", "dlock:x\u{10FFFF}"] {
            assert!(inside >= low && inside < high.as_str(), "{inside}");
        }
        for outside in ["dlock:w", "dlock:y", "dlock:"] {
            assert!(!(outside >= low && outside < high.as_str()), "{outside}");
        }
    }
}
