//! Node names: keys escaped into node names, Curator's protected child
//! names (mutex, read-write lock, semaphore leases), the order of sequence
//! numbers, and who a read-write queue grants.

use std::fmt::Write as _;

/// The lock name of Curator's `InterProcessMutex` children (`_c_{uuid}-lock-{seq}`):
/// dlock's plain locks, which are the write mode of their key.
const LOCK_NAME: &str = "lock-";

/// The lock name of the readers of Curator's `InterProcessReadWriteLock`.
const READ_NAME: &str = "__READ__";

/// The lock name of the writers of Curator's `InterProcessReadWriteLock`.
const WRITE_NAME: &str = "__WRIT__";

/// The lock name of Curator's `InterProcessSemaphoreV2` leases.
pub(super) const LEASE_NAME: &str = "lease-";

/// The child of a key holding its semaphore leases (Curator's layout).
pub(super) const LEASES: &str = "leases";

/// The child of a key where its semaphore's acquirers queue (Curator's
/// layout: the `InterProcessMutex` its `InterProcessSemaphoreV2` takes to
/// create a lease).
pub(super) const LOCKS: &str = "locks";

/// The prefix of Curator's protected names.
const PROTECTED: &str = "_c_";

/// Whether ZooKeeper refuses `c` in a path: the ranges of its programmer's
/// guide, and every character outside the Basic Multilingual Plane, which
/// the (Java) server sees as a surrogate pair, inside the refused
/// U+D800–U+F8FF.
fn forbidden(c: char) -> bool {
    matches!(u32::from(c),
        0x0000..=0x001f | 0x007f..=0x009f | 0xd800..=0xf8ff | 0xfff0..)
}

/// The node name a stored key is kept under: the key itself, with `%`, `/`
/// and every character ZooKeeper refuses percent-encoded (their UTF-8
/// bytes), and the names ZooKeeper gives a meaning (`.`, `..`, `zookeeper`)
/// made ordinary by encoding their first character. Since `%` is always
/// encoded, decoding is unambiguous: two keys never share a node.
pub(super) fn escape_key(key: &str) -> String {
    let mut out = String::with_capacity(key.len());
    let special = matches!(key, "." | ".." | "zookeeper");
    for (i, c) in key.chars().enumerate() {
        if c == '%' || c == '/' || forbidden(c) || (special && i == 0) {
            let mut bytes = [0u8; 4];
            for b in c.encode_utf8(&mut bytes).bytes() {
                let _ = write!(out, "%{b:02X}");
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// Whether `name` is a node name ZooKeeper accepts (one path component).
pub(super) fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name != "."
        && name != ".."
        && !name.contains('/')
        && !name.chars().any(forbidden)
}

/// Whether `path` is an absolute path ZooKeeper accepts (`/` alone is the root).
pub(super) fn valid_path(path: &str) -> bool {
    match path.strip_prefix('/') {
        Some("") => true,
        Some(rest) => rest.split('/').all(valid_name),
        None => false,
    }
}

/// A GUID for Curator's protected names, drawn at random: 128 bits in UUID
/// form.
pub(super) fn new_guid() -> String {
    guid_for(&format!("{:032x}", rand::random::<u128>()))
}

/// The GUID of Curator's protected names for a token: the token itself in
/// UUID form when it is 128 bits of hex, else a 128-bit hash of it.
pub(super) fn guid_for(owner: &str) -> String {
    let hex: String = if owner.len() == 32 && owner.bytes().all(|b| b.is_ascii_hexdigit()) {
        owner.to_ascii_lowercase()
    } else {
        // FNV-1a, twice with different offsets: deterministic, 128 bits.
        let fnv = |offset: u64| {
            owner.bytes().fold(offset, |h, b| {
                (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
            })
        };
        format!(
            "{:016x}{:016x}",
            fnv(0xcbf2_9ce4_8422_2325),
            fnv(0x6c62_272e_07bb_0142)
        )
    };
    format!(
        "{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    )
}

/// The path the create of an acquisition is sent with; the server appends
/// the sequence number. A reader's node is named as Curator's read lock
/// names its own; a writer's (a plain lock) as Curator's `InterProcessMutex`
/// names its own, or (`rw_writers`) as Curator's write lock.
pub(super) fn child_prefix(container: &str, guid: &str, reader: bool, rw_writers: bool) -> String {
    let name = match (reader, rw_writers) {
        (true, _) => READ_NAME,
        (false, false) => LOCK_NAME,
        (false, true) => WRITE_NAME,
    };
    format!("{container}/{PROTECTED}{guid}-{name}")
}

/// The path a semaphore lease's create is sent with (Curator's
/// `InterProcessSemaphoreV2` names).
pub(super) fn lease_prefix(leases: &str, guid: &str) -> String {
    format!("{leases}/{PROTECTED}{guid}-{LEASE_NAME}")
}

/// The start of every child name an acquisition with this GUID creates.
pub(super) fn guid_prefix(guid: &str) -> String {
    format!("{PROTECTED}{guid}-")
}

/// The sequence number of a lock child (`…lock-0000000042`,
/// `…__READ__0000000042`, `…__WRIT__0000000042`, `…lock--2147483648` after
/// the counter wrapped), or `None` for a child that is not a lock node.
/// Like Curator, the number is what follows the lock name.
pub(super) fn sequence_of(name: &str) -> Option<i32> {
    let (at, len) = [LOCK_NAME, READ_NAME, WRITE_NAME]
        .iter()
        .filter_map(|marker| Some((name.rfind(marker)?, marker.len())))
        .max_by_key(|(at, _)| *at)?;
    digits_of(&name[at + len..])
}

/// The sequence number of a semaphore lease (`…lease-0000000042`).
pub(super) fn lease_sequence_of(name: &str) -> Option<i32> {
    let at = name.rfind(LEASE_NAME)?;
    digits_of(&name[at + LEASE_NAME.len()..])
}

/// Whether a lock child is a reader's (Curator's read lock names it
/// `__READ__`); every other lock child excludes readers: dlock's plain
/// locks and writers (`lock-`) and Curator's writers (`__WRIT__`).
pub(super) fn is_reader(name: &str) -> bool {
    match (
        name.rfind(READ_NAME),
        name.rfind(WRITE_NAME),
        name.rfind(LOCK_NAME),
    ) {
        (Some(read), write, lock) => {
            write.is_none_or(|w| w < read) && lock.is_none_or(|l| l < read)
        }
        (None, _, _) => false,
    }
}

fn digits_of(digits: &str) -> Option<i32> {
    let unsigned = digits.strip_prefix('-').unwrap_or(digits);
    if unsigned.is_empty() || !unsigned.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse::<i32>().ok()
}

/// Whether the sequence numbers of these lock children give their creation
/// order: every one is in `0..2147483647`. The server numbers the children
/// of one container in the order it creates them, so below its counter's
/// end sequence order is creation order (and a reaped container's children
/// are all gone before its counter starts again). At the end it is not:
/// ZooKeeper 3.8 gives every later child `2147483647` (its data tree keeps
/// the counter there), a create pipelined behind another one gets
/// `-2147483648` and up (the wrapped value of the request processor), and
/// other versions wrap for good.
pub(super) fn in_sequence_order(sequences: impl IntoIterator<Item = i32>) -> bool {
    sequences
        .into_iter()
        .all(|seq| (0..i32::MAX).contains(&seq))
}

/// Where our node stands among the children of its key.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Position<'a> {
    /// Ours is the earliest lock node: we hold the key.
    Holder,
    /// The lock node just ahead of ours (the one to watch).
    Behind(&'a str),
    /// Our node is not among the children (deleted, or its session ended).
    Missing,
}

/// Our position in `queue`: the key's lock children, each with its rank in
/// creation order (its sequence number when [`in_sequence_order`], else its
/// `czxid`; ranks are distinct). A writer (`reader == false`) waits for
/// every node ahead of it, a reader only for the writers ahead of it — so a
/// reader queued behind a waiting writer waits for it (writers preferred,
/// first come first served); each watches the nearest node it waits for.
pub(super) fn position<'a>(queue: &'a [(String, i64)], ours: &str, reader: bool) -> Position<'a> {
    let Some(our_rank) = rank_of(queue, ours) else {
        return Position::Missing;
    };
    match blockers(queue, our_rank, reader).max_by_key(|(_, rank)| *rank) {
        None => Position::Holder,
        Some((name, _)) => Position::Behind(name),
    }
}

fn blockers(
    queue: &[(String, i64)],
    our_rank: i64,
    reader: bool,
) -> impl Iterator<Item = &(String, i64)> {
    queue
        .iter()
        .filter(move |(name, rank)| *rank < our_rank && !(reader && is_reader(name)))
}

fn rank_of(queue: &[(String, i64)], name: &str) -> Option<i64> {
    queue.iter().find(|(n, _)| n == name).map(|(_, rank)| *rank)
}

/// The holders among `queue`'s nodes in creation order: the first node if
/// it is a writer's, else every reader's node ahead of the first writer's.
pub(super) fn holders<T>(ordered: &[T], name: impl Fn(&T) -> &str) -> usize {
    match ordered.first() {
        None => 0,
        Some(first) if !is_reader(name(first)) => 1,
        Some(_) => ordered
            .iter()
            .take_while(|node| is_reader(name(node)))
            .count(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unescape(s: &str) -> String {
        let bytes = s.as_bytes();
        let mut out = Vec::new();
        let mut i = 0;
        while i < bytes.len() {
            if bytes[i] == b'%' {
                out.push(u8::from_str_radix(&s[i + 1..i + 3], 16).unwrap());
                i += 3;
            } else {
                out.push(bytes[i]);
                i += 1;
            }
        }
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn escaping_is_valid_and_reversible() {
        for key in [
            "dlock:order:42",
            ".",
            "..",
            "...",
            "zookeeper",
            "zookeeper2",
            "a/b",
            "a/../b",
            "/",
            "%2F",
            "%",
            "100%",
            "\u{e000}",
            "\u{fffd}",
            "\u{7f}x",
            "\u{85}",
            "ключ 🔒",
            "e\u{301}",
            "",
        ] {
            let escaped = escape_key(key);
            assert_eq!(unescape(&escaped), key, "{key:?} -> {escaped:?}");
            if !key.is_empty() {
                assert!(valid_name(&escaped), "{key:?} -> {escaped:?}");
            }
        }
        assert_eq!(escape_key("a/b"), "a%2Fb");
        assert_eq!(escape_key("%2F"), "%252F");
        assert_eq!(escape_key(".."), "%2E.");
        assert_eq!(escape_key("zookeeper"), "%7Aookeeper");
        assert_eq!(escape_key("\u{e000}"), "%EE%80%80");
        assert_eq!(escape_key("🔒"), "%F0%9F%94%92");
    }

    #[test]
    fn escaping_is_injective_on_fuzzed_keys() {
        use rand::Rng as _;
        use rand::SeedableRng as _;
        let pieces = [
            "%",
            "/",
            ".",
            "..",
            "2F",
            "2E",
            "%2",
            "z",
            "zookeeper",
            "\u{e000}",
            "\u{fffd}",
            "a",
            "A",
            "é",
            "\u{7f}",
            "\u{9f}",
            "_",
            "-",
        ];
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let mut seen = std::collections::HashMap::new();
        for _ in 0..20_000 {
            let n = rng.random_range(1..6);
            let key: String = (0..n)
                .map(|_| pieces[rng.random_range(0..pieces.len())])
                .collect();
            let escaped = escape_key(&key);
            assert!(valid_name(&escaped), "{key:?} -> {escaped:?}");
            if let Some(other) = seen.insert(escaped.clone(), key.clone()) {
                assert_eq!(other, key, "two keys share {escaped:?}");
            }
        }
    }

    #[test]
    fn guids_are_uuid_shaped_and_stable() {
        let owner = "0123456789abcdef0123456789ABCDEF";
        assert_eq!(guid_for(owner), "01234567-89ab-cdef-0123-456789abcdef");
        let other = guid_for("bench-owner-1");
        assert_eq!(other.len(), 36);
        assert_eq!(other, guid_for("bench-owner-1"));
        assert_ne!(other, guid_for("bench-owner-2"));
        let drawn = new_guid();
        assert_eq!(drawn.len(), 36);
        assert_ne!(drawn, new_guid());
        assert_eq!(
            child_prefix("/k", &guid_for(owner), false, false),
            "/k/_c_01234567-89ab-cdef-0123-456789abcdef-lock-"
        );
    }

    #[test]
    fn sequences_parse_like_curator() {
        assert_eq!(sequence_of("_c_x-lock-0000000042"), Some(42));
        assert_eq!(sequence_of("_c_x-lock-2147483647"), Some(i32::MAX));
        assert_eq!(sequence_of("_c_x-lock--2147483648"), Some(i32::MIN));
        assert_eq!(sequence_of("_c_x-lock--000000001"), Some(-1));
        assert_eq!(sequence_of("lock-7"), Some(7));
        assert_eq!(sequence_of("_c_x-lock-"), None);
        assert_eq!(sequence_of("_c_x-lock-12a"), None);
        assert_eq!(sequence_of("other"), None);
        assert_eq!(sequence_of("_c_x-lock-99999999999"), None);
    }

    #[test]
    fn sequence_order_only_below_the_counters_end() {
        assert!(in_sequence_order([0, 1, 42, i32::MAX - 1]));
        assert!(in_sequence_order([]));
        assert!(!in_sequence_order([5, i32::MAX]));
        assert!(!in_sequence_order([i32::MIN, 7]));
        assert!(!in_sequence_order([-1]));
    }

    fn queue(entries: &[(&str, i64)]) -> Vec<(String, i64)> {
        entries.iter().map(|(n, r)| ((*n).to_owned(), *r)).collect()
    }

    #[test]
    fn positions_follow_the_ranks() {
        let q = queue(&[("c", 30), ("a", 10), ("d", 40), ("b", 20)]);
        assert_eq!(position(&q, "a", false), Position::Holder);
        assert_eq!(position(&q, "b", false), Position::Behind("a"));
        assert_eq!(position(&q, "d", false), Position::Behind("c"));
        assert_eq!(position(&q, "z", false), Position::Missing);
    }

    #[test]
    fn equal_and_wrapped_sequences_are_ordered_by_czxid() {
        // What ZooKeeper 3.8 hands out at its counter's end, in creation
        // order: 2147483646, 2147483647, -2147483648 (pipelined), then
        // 2147483647 again and again. Neither the sequences (equal) nor
        // their serial or string order tell who came first; the czxid does.
        let names = [
            "_c_a-lock-2147483646",
            "_c_b-lock-2147483647",
            "_c_c-lock--2147483648",
            "_c_d-lock-2147483647",
            "_c_e-lock-2147483647",
        ];
        let sequences: Vec<i32> = names.iter().map(|n| sequence_of(n).unwrap()).collect();
        assert!(!in_sequence_order(sequences));
        let czxids = [
            0x1_0000_0005,
            0x1_0000_0009,
            0x1_0000_000a,
            0x1_0000_000c,
            0x2_0000_0001,
        ];
        let q: Vec<(String, i64)> = names
            .iter()
            .zip(czxids)
            .rev()
            .map(|(n, z)| ((*n).to_owned(), z))
            .collect();
        assert_eq!(position(&q, names[0], false), Position::Holder);
        for w in names.windows(2) {
            assert_eq!(position(&q, w[1], false), Position::Behind(w[0]));
        }
        // The first holder gone, exactly one node holds.
        let rest: Vec<(String, i64)> = q.iter().filter(|(n, _)| n != names[0]).cloned().collect();
        let holders: Vec<&str> = names[1..]
            .iter()
            .filter(|n| position(&rest, n, false) == Position::Holder)
            .copied()
            .collect();
        assert_eq!(holders, [names[1]]);
    }

    #[test]
    fn readers_wait_only_for_writers_ahead_and_writers_for_everyone() {
        let q = queue(&[
            ("_c_a-__READ__0000000001", 1),
            ("_c_b-lock-0000000002", 2),
            ("_c_c-__READ__0000000003", 3),
            ("_c_d-__WRIT__0000000004", 4),
            ("_c_e-__READ__0000000005", 5),
            ("_c_f-__READ__0000000006", 6),
        ]);
        assert!(is_reader(&q[0].0) && !is_reader(&q[1].0) && !is_reader(&q[3].0));
        assert_eq!(sequence_of("_c_d-__WRIT__0000000004"), Some(4));
        assert_eq!(sequence_of("_c_a-__READ__0000000001"), Some(1));
        assert_eq!(position(&q, &q[0].0, true), Position::Holder);
        // The writer waits for the reader ahead of it.
        assert_eq!(position(&q, &q[1].0, false), Position::Behind(&q[0].0));
        // A reader queued behind a waiting writer waits for that writer.
        assert_eq!(position(&q, &q[2].0, true), Position::Behind(&q[1].0));
        assert_eq!(position(&q, &q[4].0, true), Position::Behind(&q[3].0));
        assert_eq!(holders(&q, |(n, _)| n.as_str()), 1);
        let readers_first = &q[2..];
        assert_eq!(holders(&q[..1], |(n, _)| n.as_str()), 1);
        assert_eq!(holders(readers_first, |(n, _)| n.as_str()), 1);
        let two_readers = queue(&[
            ("_c_e-__READ__5", 5),
            ("_c_f-__READ__6", 6),
            ("_c_g-lock-7", 7),
        ]);
        assert_eq!(holders(&two_readers, |(n, _)| n.as_str()), 2);
        let writer = queue(&[("_c_g-lock-7", 7), ("_c_e-__READ__8", 8)]);
        assert_eq!(holders(&writer, |(n, _)| n.as_str()), 1);
        assert_eq!(holders::<(String, i64)>(&[], |(n, _)| n.as_str()), 0);
    }

    #[test]
    fn leases_parse_like_curator() {
        assert_eq!(lease_sequence_of("_c_x-lease-0000000042"), Some(42));
        assert_eq!(lease_sequence_of("lease-7"), Some(7));
        assert_eq!(lease_sequence_of("_c_x-lock-7"), None);
        assert_eq!(lease_prefix("/k/leases", "g"), "/k/leases/_c_g-lease-");
    }

    #[test]
    fn paths() {
        assert!(valid_path("/"));
        assert!(valid_path("/a/b"));
        assert!(!valid_path("a"));
        assert!(!valid_path("/a/"));
        assert!(!valid_path("/a//b"));
        assert!(!valid_path("/a/./b"));
        assert!(!valid_path("/a/.."));
    }
}
