//! Where the fence counters live: one per hash slot on Redis Cluster, one per
//! server (and database) otherwise.
//!
//! A lock's counter must be in the lock key's slot, so that one script can
//! touch both. Redis Cluster puts a key in slot `CRC16(tag) mod 16384`, where
//! the tag is the text between the key's first `{` and the first `}` after it
//! (the whole key when there is no such non-empty text). For every slot, the
//! smallest decimal number whose CRC16 lands in it is found once per process
//! (a few milliseconds, on first use on a cluster), and the counter of slot
//! `s` is `dlock-fence:{<that number>}`. The counters are bounded: at most
//! 16,384 keys on a cluster, whatever the number of lock names.

use std::sync::LazyLock;

/// The fence counter on a server without Cluster.
pub(super) const SINGLE_FENCE_KEY: &str = "dlock-fence";

/// How many hash slots Redis Cluster has.
const SLOTS: usize = 16_384;

/// CRC16/XMODEM (polynomial 0x1021, initial value 0), as Redis Cluster uses it.
pub(super) fn crc16(bytes: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &byte in bytes {
        crc ^= u16::from(byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

/// The hash slot of a key, by Redis Cluster's rules (hash tags included).
pub(super) fn key_slot(key: &[u8]) -> u16 {
    let hashed = key
        .iter()
        .position(|&b| b == b'{')
        .and_then(|open| {
            let rest = &key[open + 1..];
            let close = rest.iter().position(|&b| b == b'}')?;
            (close > 0).then(|| &rest[..close])
        })
        .unwrap_or(key);
    crc16(hashed) % SLOTS as u16
}

/// For every slot, the smallest number whose decimal text hashes to it.
static TAGS: LazyLock<Box<[u32]>> = LazyLock::new(|| {
    let mut tags = vec![u32::MAX; SLOTS].into_boxed_slice();
    let mut left = SLOTS;
    let mut n: u32 = 0;
    while left > 0 {
        let slot = usize::from(crc16(n.to_string().as_bytes()) % SLOTS as u16);
        if tags[slot] == u32::MAX {
            tags[slot] = n;
            left -= 1;
        }
        n += 1;
    }
    tags
});

/// The fence counter of the slot `lock_key` is in, on Redis Cluster.
pub(super) fn cluster_fence_key(lock_key: &str) -> String {
    let slot = usize::from(key_slot(lock_key.as_bytes()));
    format!("{SINGLE_FENCE_KEY}:{{{}}}", TAGS[slot])
}

/// The number whose `{tag}` puts a key in the same slot as `key`: the
/// fenced writes keep a key's fence beside it with it.
pub(crate) fn slot_tag(key: &[u8]) -> u32 {
    TAGS[usize::from(key_slot(key))]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc16_and_slots_match_redis() {
        // The check value of CRC16/XMODEM, and `CLUSTER KEYSLOT` answers.
        assert_eq!(crc16(b"123456789"), 0x31C3);
        assert_eq!(key_slot(b"foo"), 12182);
        assert_eq!(key_slot(b"{dlock:a}b}"), 9551);
        assert_eq!(key_slot(b"{user1000}.following"), key_slot(b"user1000"));
        // An empty tag hashes the whole key.
        assert_eq!(key_slot(b"{}x"), crc16(b"{}x") % 16384);
        assert_eq!(key_slot(b"{x"), crc16(b"{x") % 16384);
    }

    #[test]
    fn every_slot_has_a_counter_in_that_slot() {
        for slot in 0..SLOTS {
            let tag = TAGS[slot];
            assert_ne!(tag, u32::MAX, "slot {slot}");
            let key = format!("{SINGLE_FENCE_KEY}:{{{tag}}}");
            assert_eq!(usize::from(key_slot(key.as_bytes())), slot);
        }
        let lock = "{dlock:order:42}";
        assert_eq!(
            key_slot(cluster_fence_key(lock).as_bytes()),
            key_slot(lock.as_bytes())
        );
        // Short keys: the largest tag has a few digits.
        assert!(TAGS.iter().all(|&t| t < 10_000_000));
    }
}
