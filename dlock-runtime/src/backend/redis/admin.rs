//! What an operator reads and revokes on Redis: the holder record stored in a
//! lock key's value, `inspect`, `list` (a `SCAN` of every master) and
//! `revoke`.
//!
//! A lock key's value is the owner token, a newline, then
//! `<token> <granted-at µs> <record>` ([`HolderRecord::encode`]): the token
//! and the grant's time on the server's clock (`TIME`) as the acquire script
//! wrote them, `-` for each where no script ran (an unfenced grant is one
//! `SET … NX PX GET`, so it has neither). Every owner check compares the text
//! up to the first newline, and also takes a value that is the owner alone.
//!
//! Readers and permits are one hash at the lock key (see `acquire_held.lua`):
//! field `n` says which (`r`, or the number of permits), and each holder's
//! field holds `<expiry, server ms> ` followed by the value above. Each reads
//! back as one [`HeldEntry`] with its mode (and slot), expired ones left out.

use std::collections::BTreeSet;
use std::sync::LazyLock;
use std::time::{Duration, SystemTime};

use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
use redis::{Script, Value};

use super::conn::Conn;
use super::connections::call;
use super::scripts::redis_error;
use super::{Keys, RedisBackend};
use crate::backend::{HeldEntry, HoldMode, HolderRecord, KeyEntry};
use crate::error::BackendError;
use crate::token::FencingToken;

/// `KEYS[1]` lock, `KEYS[2]` its revocation mark; `ARGV[1]` release channel.
/// Answers what it removed as [`READ`] reads it, or nil for a free key.
static REVOKE: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("revoke.lua")));

/// [`REVOKE`] for Redis Cluster: `SPUBLISH` (see `RELEASE_SHARDED`).
static REVOKE_SHARDED: LazyLock<Script> =
    LazyLock::new(|| Script::new(&include_str!("revoke.lua").replace("'PUBLISH'", "'SPUBLISH'")));

/// `KEYS[1]` lock. Answers `{'s', value, remaining ms}`, `{'h', server ms,
/// field, value, …}` or nil (see `read.lua`).
static READ: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("read.lua")));

/// How many keys one `SCAN` step asks for.
const SCAN_COUNT: usize = 1000;

/// The set of the revoked owners of the lock key `lock` (`{K}`): in
/// the lock's slot, so the renew and revoke scripts touch both.
pub(super) fn revocation_mark(lock: &str) -> String {
    format!("{lock}:revoked")
}

/// The value an unfenced grant stores: the owner, then the record without a
/// token or a server time.
pub(super) fn unfenced_value(owner: &str, holder: &HolderRecord) -> String {
    format!("{owner}\n- - {}", holder.encode())
}

/// Whether the stored `value` is `owner`'s.
pub(super) fn owned_by(value: &str, owner: &str) -> bool {
    value
        .strip_prefix(owner)
        .is_some_and(|rest| rest.is_empty() || rest.starts_with('\n'))
}

/// Reads a lock key's value (and its remaining `ttl` in ms) back as a holder.
pub(super) fn held_entry(value: &str, ttl: i64) -> HeldEntry {
    let (owner, rest) = value.split_once('\n').unwrap_or((value, ""));
    let mut entry = HeldEntry::new(owner);
    let mut parts = rest.splitn(3, ' ');
    entry.token = parts
        .next()
        .and_then(|t| t.parse::<u64>().ok())
        .map(FencingToken::new);
    entry.granted_at = parts
        .next()
        .and_then(|g| g.parse::<u64>().ok())
        .map(|micros| SystemTime::UNIX_EPOCH + Duration::from_micros(micros));
    entry.holder = parts.next().and_then(HolderRecord::decode);
    entry.expires_in = u64::try_from(ttl).ok().map(Duration::from_millis);
    entry
}

/// Reads the read or revoke script's answer back as the key's holders: the
/// whole key's one, or each live reader or permit (by slot, then owner).
pub(super) fn holders(answer: Value) -> Result<Vec<HeldEntry>, BackendError> {
    let items: Vec<Value> = match answer {
        Value::Nil => return Ok(Vec::new()),
        answer => redis::from_redis_value(answer).map_err(parse_error)?,
    };
    let mut items = items.into_iter();
    let kind: String = match items.next() {
        Some(kind) => redis::from_redis_value(kind).map_err(parse_error)?,
        None => return Ok(Vec::new()),
    };
    let mut next_text = || -> Result<Option<String>, BackendError> {
        items
            .next()
            .map(|v| redis::from_redis_value::<String>(v).map_err(parse_error))
            .transpose()
    };
    if kind == "s" {
        let (Some(value), Some(ttl)) = (next_text()?, next_text()?) else {
            return Err(parse_error("a short answer"));
        };
        return Ok(vec![held_entry(&value, ttl.parse().unwrap_or(-1))]);
    }
    let now: i64 = next_text()?
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| parse_error("no server time"))?;
    let mut mode = HoldMode::Shared;
    let mut fields = Vec::new();
    while let (Some(field), Some(value)) = (next_text()?, next_text()?) {
        if field == "n" {
            mode = match value.parse::<u32>() {
                Ok(permits) => HoldMode::Permit { permits },
                Err(_) => HoldMode::Shared,
            };
        } else {
            fields.push((field, value));
        }
    }
    let mut entries: Vec<HeldEntry> = fields
        .into_iter()
        .filter_map(|(field, value)| {
            let (expiry, rest) = value.split_once(' ')?;
            let left = expiry.parse::<i64>().ok()? - now;
            if left <= 0 {
                return None;
            }
            let mut entry = held_entry(rest, left);
            entry.mode = mode;
            if matches!(mode, HoldMode::Permit { .. }) {
                entry.slot = field.parse().ok();
            }
            Some(entry)
        })
        .collect();
    entries.sort_by(|a, b| (a.slot, &a.owner).cmp(&(b.slot, &b.owner)));
    Ok(entries)
}

/// The stored key of a lock key `{K}`: `K`, or `None` for any other key.
fn stored_key(lock: &str) -> Option<&str> {
    lock.strip_prefix('{')?.strip_suffix('}')
}

/// `text` with `SCAN … MATCH`'s special characters escaped.
pub(super) fn glob_escape(text: &str) -> String {
    let mut escaped = String::with_capacity(text.len() + 2);
    for c in text.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\' | '^' | '-') {
            escaped.push('\\');
        }
        escaped.push(c);
    }
    escaped
}

impl RedisBackend {
    /// The read script's answer for `lock`.
    async fn read_raw(&self, lock: &str) -> Result<Value, BackendError> {
        let invocation = READ.key(lock);
        self.conns.send(|conn| call(conn, &invocation)).await
    }

    /// The holders of `lock` (`{K}`): empty for a free key.
    async fn read_lock(&self, lock: &str) -> Result<Vec<HeldEntry>, BackendError> {
        holders(self.read_raw(lock).await?)
    }

    /// Whether `lock` is held by readers or permits (the hash).
    pub(super) async fn read_is_hash(&self, lock: &str) -> Result<bool, BackendError> {
        let answer = self.read_raw(lock).await?;
        Ok(match answer {
            Value::Array(items) => matches!(items.first(), Some(Value::BulkString(k)) if k == b"h"),
            _ => false,
        })
    }

    /// The holders of the stored `key`, read from the server.
    pub(super) async fn inspect_key(&self, key: &str) -> Result<Option<KeyEntry>, BackendError> {
        let keys = Keys::new(key);
        let entries = self.read_lock(&keys.lock).await?;
        Ok((!entries.is_empty()).then(|| KeyEntry::new(key, entries)))
    }

    /// The held keys under `prefix`, in key order, at most `limit`.
    pub(super) async fn list_keys(
        &self,
        prefix: &str,
        limit: usize,
    ) -> Result<Vec<KeyEntry>, BackendError> {
        if limit == 0 {
            return Ok(Vec::new());
        }
        let pattern = format!("{{{}*", glob_escape(prefix));
        // In the stored keys' order, not the lock keys' (`}` sorts after
        // some characters of keys).
        let found: BTreeSet<String> = self
            .scan(&pattern)
            .await?
            .iter()
            .filter_map(|lock| stored_key(lock))
            .filter(|key| key.starts_with(prefix))
            .map(str::to_owned)
            .collect();
        let mut listed = Vec::new();
        for key in found {
            let lock = Keys::new(&key).lock;
            let entries = self.read_lock(&lock).await?;
            if !entries.is_empty() {
                listed.push(KeyEntry::new(key, entries));
                if listed.len() == limit {
                    break;
                }
            }
        }
        Ok(listed)
    }

    /// Every key matching `pattern`: on a cluster, from every master.
    async fn scan(&self, pattern: &str) -> Result<BTreeSet<String>, BackendError> {
        let mut found = BTreeSet::new();
        match self.conns.home() {
            Conn::Cluster(mut conn) => {
                for (host, port) in masters(&mut conn).await? {
                    let route = RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
                        host: host.clone(),
                        port,
                    });
                    let mut cursor = 0_u64;
                    loop {
                        let mut cmd = redis::cmd("SCAN");
                        cmd.arg(cursor)
                            .arg("MATCH")
                            .arg(pattern)
                            .arg("COUNT")
                            .arg(SCAN_COUNT);
                        let answer = conn
                            .route_command(cmd, route.clone())
                            .await
                            .map_err(redis_error)?;
                        let (next, keys): (u64, Vec<String>) =
                            redis::from_redis_value(answer).map_err(parse_error)?;
                        found.extend(keys);
                        cursor = next;
                        if cursor == 0 {
                            break;
                        }
                    }
                }
            }
            Conn::Single(_) => {
                let mut cursor = 0_u64;
                loop {
                    let mut cmd = redis::cmd("SCAN");
                    cmd.arg(cursor)
                        .arg("MATCH")
                        .arg(pattern)
                        .arg("COUNT")
                        .arg(SCAN_COUNT);
                    let cmd = &cmd;
                    let (next, keys): (u64, Vec<String>) = self
                        .conns
                        .send(|mut conn| async move { cmd.query_async(&mut conn).await })
                        .await?;
                    found.extend(keys);
                    cursor = next;
                    if cursor == 0 {
                        break;
                    }
                }
            }
        }
        Ok(found)
    }

    /// Takes the stored `key` from its holders: the whole key's, or every
    /// reader or permit (one script: delete, mark each owner revoked, wake
    /// the waiters).
    pub(super) async fn revoke_key(&self, key: &str) -> Result<Vec<HeldEntry>, BackendError> {
        let keys = Keys::new(key);
        let script = if self.conns.is_cluster() {
            &*REVOKE_SHARDED
        } else {
            &*REVOKE
        };
        let mut invocation = script.key(&keys.lock);
        invocation
            .key(revocation_mark(&keys.lock))
            .arg(&keys.channel);
        let answer: Value = self
            .conns
            .send_confirmed(|conn| call(conn, &invocation))
            .await?;
        holders(answer)
    }
}

/// An answer that does not read as expected.
fn parse_error(err: impl std::fmt::Display) -> BackendError {
    BackendError::permanent(format!("redis: unexpected answer: {err}"))
}

/// The masters of a cluster (`CLUSTER SHARDS` would name them too; `CLUSTER
/// SLOTS` answers on every version the backend supports).
async fn masters(
    conn: &mut redis::cluster_async::ClusterConnection,
) -> Result<Vec<(String, u16)>, BackendError> {
    let slots: Value = redis::cmd("CLUSTER")
        .arg("SLOTS")
        .query_async(conn)
        .await
        .map_err(redis_error)?;
    let ranges: Vec<Vec<Value>> = redis::from_redis_value(slots).map_err(parse_error)?;
    let mut masters = BTreeSet::new();
    for range in ranges {
        let Some(master) = range.into_iter().nth(2) else {
            continue;
        };
        let node: Vec<Value> = redis::from_redis_value(master).map_err(parse_error)?;
        let mut node = node.into_iter();
        let (Some(host), Some(port)) = (node.next(), node.next()) else {
            continue;
        };
        let host: String = redis::from_redis_value(host).map_err(parse_error)?;
        let port: u16 = redis::from_redis_value(port).map_err(parse_error)?;
        masters.insert((host, port));
    }
    Ok(masters.into_iter().collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stored_values_read_back_as_holders() {
        let record = HolderRecord::new("web-1", 42, Some("blue one".to_owned()));
        let value = format!("abc\n17 1700000000000001 {}", record.encode());
        let entry = held_entry(&value, 900);
        assert_eq!(entry.owner, "abc");
        assert_eq!(entry.token, Some(FencingToken::new(17)));
        assert_eq!(
            entry.granted_at,
            Some(SystemTime::UNIX_EPOCH + Duration::from_micros(1_700_000_000_000_001))
        );
        assert_eq!(entry.holder, Some(record.clone()));
        assert_eq!(entry.expires_in, Some(Duration::from_millis(900)));

        let unfenced = held_entry(&unfenced_value("abc", &record), -1);
        assert_eq!(
            (unfenced.token, unfenced.granted_at, unfenced.expires_in),
            (None, None, None)
        );
        assert_eq!(unfenced.holder, Some(record));

        let bare = held_entry("abc", 5);
        assert_eq!((bare.owner.as_str(), bare.holder), ("abc", None));
    }

    #[test]
    fn owner_checks_compare_up_to_the_newline() {
        assert!(owned_by("abc", "abc"));
        assert!(owned_by("abc\n1 2 h1 3 web", "abc"));
        assert!(!owned_by("abcd\n1 2 h1 3 web", "abc"));
        assert!(!owned_by("ab", "abc"));
    }

    #[test]
    fn scan_patterns_match_the_prefix_literally() {
        assert_eq!(glob_escape("a*b?[c]-\\^"), "a\\*b\\?\\[c\\]\\-\\\\\\^");
        assert_eq!(stored_key("{dlock:x}"), Some("dlock:x"));
        assert_eq!(stored_key("{dlock:x}:revoked"), None);
        assert_eq!(stored_key("dlock-fence"), None);
    }
}
