//! Node names: keys escaped into node names, Curator's protected child
//! names, and the order of sequence numbers (serial-number arithmetic).

use std::fmt::Write as _;

/// The lock name of Curator's `InterProcessMutex` children (`_c_{uuid}-lock-{seq}`).
const LOCK_NAME: &str = "lock-";

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
/// the sequence number.
pub(super) fn child_prefix(container: &str, guid: &str) -> String {
    format!("{container}/{PROTECTED}{guid}-{LOCK_NAME}")
}

/// The start of every child name an acquisition with this GUID creates.
pub(super) fn guid_prefix(guid: &str) -> String {
    format!("{PROTECTED}{guid}-")
}

/// The sequence number of a lock child (`…lock-0000000042`,
/// `…lock--2147483648` after the counter wrapped), or `None` for a child
/// that is not a lock node. Like Curator, the number is what follows the
/// last `lock-`.
pub(super) fn sequence_of(name: &str) -> Option<i32> {
    let at = name.rfind(LOCK_NAME)?;
    let digits = &name[at + LOCK_NAME.len()..];
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
/// `czxid`; ranks are distinct).
pub(super) fn position<'a>(queue: &'a [(String, i64)], ours: &str) -> Position<'a> {
    let Some(our_rank) = rank_of(queue, ours) else {
        return Position::Missing;
    };
    match queue
        .iter()
        .filter(|(_, rank)| *rank < our_rank)
        .max_by_key(|(_, rank)| *rank)
    {
        None => Position::Holder,
        Some((name, _)) => Position::Behind(name),
    }
}

fn rank_of(queue: &[(String, i64)], name: &str) -> Option<i64> {
    queue.iter().find(|(n, _)| n == name).map(|(_, rank)| *rank)
}

/// How many lock nodes of `queue` (as for [`position`]) are ahead of ours.
pub(super) fn ahead_of(queue: &[(String, i64)], ours: &str) -> usize {
    rank_of(queue, ours).map_or(0, |our_rank| {
        queue.iter().filter(|(_, rank)| *rank < our_rank).count()
    })
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
            child_prefix("/k", &guid_for(owner)),
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
        assert_eq!(position(&q, "a"), Position::Holder);
        assert_eq!(position(&q, "b"), Position::Behind("a"));
        assert_eq!(position(&q, "d"), Position::Behind("c"));
        assert_eq!(position(&q, "z"), Position::Missing);
        assert_eq!(ahead_of(&q, "a"), 0);
        assert_eq!(ahead_of(&q, "c"), 2);
        assert_eq!(ahead_of(&q, "z"), 0);
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
        assert_eq!(position(&q, names[0]), Position::Holder);
        for w in names.windows(2) {
            assert_eq!(position(&q, w[1]), Position::Behind(w[0]));
        }
        // The first holder gone, exactly one node holds.
        let rest: Vec<(String, i64)> = q.iter().filter(|(n, _)| n != names[0]).cloned().collect();
        let holders: Vec<&str> = names[1..]
            .iter()
            .filter(|n| position(&rest, n) == Position::Holder)
            .copied()
            .collect();
        assert_eq!(holders, [names[1]]);
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
