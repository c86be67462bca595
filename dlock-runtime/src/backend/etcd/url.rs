//! `etcd://[user:pass@]h1:p1,h2:p2[/prefix][?session_ttl=10s]`

use std::time::Duration;

use crate::backend::HoldMode;
use crate::error::{LockError, redact_url};

/// The etcd lease TTL of a backend session when the URL names none.
pub(super) const DEFAULT_SESSION_TTL: Duration = Duration::from_secs(10);

/// The shortest TTL etcd grants with its default election timeout (it
/// raises shorter ones to this).
pub(super) const MIN_SESSION_TTL: Duration = Duration::from_secs(2);

/// The longest session TTL accepted (a crashed holder blocks its keys this long).
const MAX_SESSION_TTL: Duration = Duration::from_secs(3600);

/// The port of a host named without one.
const DEFAULT_PORT: u16 = 2379;

/// What an `etcd://` URL says. Holds the credentials, so it has no `Debug`.
pub(super) struct Target {
    /// `http://host:port` of every member named.
    pub(super) endpoints: Vec<String>,
    /// The key prefix every entry lives under: `""` or `/a/b` (no trailing `/`).
    pub(super) prefix: String,
    /// `(user, password)` for etcd's authentication.
    pub(super) user: Option<(String, String)>,
    /// The TTL of the session's etcd lease: whole seconds, at least 2.
    pub(super) session_ttl: Duration,
}

fn percent_decode(s: &str) -> Option<String> {
    percent_encoding::percent_decode_str(s)
        .decode_utf8()
        .ok()
        .map(|decoded| decoded.into_owned())
}

pub(super) fn parse(url: &str) -> Result<Target, LockError> {
    let shown = redact_url(url);
    let bad = |why: &str| LockError::config(format!("bad etcd URL `{shown}`: {why}"));
    let rest = match url.split_once("://") {
        Some((scheme, rest)) if scheme.eq_ignore_ascii_case("etcd") => rest,
        _ => {
            return Err(bad(
                "expected etcd://[user:pass@]host:port[,host:port…][/prefix]",
            ));
        }
    };
    let (rest, query) = rest.split_once('?').unwrap_or((rest, ""));
    let (authority, path) = match rest.find('/') {
        Some(i) => rest.split_at(i),
        None => (rest, ""),
    };
    let (userinfo, hosts) = match authority.rfind('@') {
        Some(at) => (Some(&authority[..at]), &authority[at + 1..]),
        None => (None, authority),
    };
    let user = match userinfo {
        None => None,
        Some(info) => {
            let (user, pass) = info
                .split_once(':')
                .ok_or_else(|| bad("authentication needs `user:password@`"))?;
            let user = percent_decode(user).ok_or_else(|| bad("bad percent-encoding"))?;
            let pass = percent_decode(pass).ok_or_else(|| bad("bad percent-encoding"))?;
            if user.is_empty() {
                return Err(bad("the user name must not be empty"));
            }
            Some((user, pass))
        }
    };
    let mut endpoints = Vec::new();
    for host in hosts.split(',') {
        if host.is_empty() {
            return Err(bad("empty host"));
        }
        let (name, port) = match host.rsplit_once(':') {
            Some((name, port)) if !name.ends_with(':') && !host.ends_with(']') => {
                let port = port
                    .parse::<u16>()
                    .map_err(|_| bad(&format!("bad port in `{host}`")))?;
                (name, port)
            }
            _ => (host, DEFAULT_PORT),
        };
        if name.is_empty() || name.contains(['/', '@', ' ']) {
            return Err(bad(&format!("bad host `{host}`")));
        }
        endpoints.push(format!("http://{name}:{port}"));
    }
    // Decoded first: `%2F` is a `/` like any other, so `a%2F%2Fb` and `a%2F`
    // are checked and trimmed as `a//b` and `a/` are.
    let decoded = percent_decode(path).ok_or_else(|| bad("bad percent-encoding in the prefix"))?;
    let prefix = decoded.trim_end_matches('/').to_owned();
    if prefix.contains("//") {
        return Err(bad("the prefix has an empty component (`//`)"));
    }
    let mut session_ttl = DEFAULT_SESSION_TTL;
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        match name {
            "session_ttl" => {
                let ttl = humantime::parse_duration(value)
                    .map_err(|e| bad(&format!("session_ttl `{value}`: {e}")))?;
                if ttl.subsec_nanos() != 0 || ttl < MIN_SESSION_TTL || ttl > MAX_SESSION_TTL {
                    return Err(bad(&format!(
                        "session_ttl `{value}`: etcd leases are whole seconds, from 2s \
                         (etcd raises shorter ones) to 1h"
                    )));
                }
                session_ttl = ttl;
            }
            other => {
                return Err(bad(&format!(
                    "unknown option `{other}` (the option is session_ttl)"
                )));
            }
        }
    }
    Ok(Target {
        endpoints,
        prefix,
        user,
        session_ttl,
    })
}

/// The stored key (registry prefix included), escaped so that it holds no
/// `/`: `%` and `/` become `%25` and `%2F`. Injective, and the escaped
/// key ends where the next `/` is, so `{prefix}/{key}/{owner}` splits one way only.
pub(super) fn escape(key: &str) -> String {
    let mut out = String::with_capacity(key.len());
    for c in key.chars() {
        match c {
            '%' => out.push_str("%25"),
            '/' => out.push_str("%2F"),
            c => out.push(c),
        }
    }
    out
}

/// The segment under the backend's prefix where revocation marks live:
/// `%` followed by neither `25` nor `2F`, so no escaped key is this segment
/// and no queue is under it.
const MARKS: &str = "%revoked";

/// The mark a revocation leaves for the entry `{prefix}/{key}/{owner}`:
/// `{prefix}/%revoked/{key}/{owner}`, outside every queue (see the
/// [module docs](super)). `None` for a name that is not an entry's.
pub(super) fn revocation_mark(entry: &str) -> Option<String> {
    let mut parts = entry.rsplitn(3, '/');
    let (owner, key, root) = (parts.next()?, parts.next()?, parts.next()?);
    (!owner.is_empty() && !key.is_empty()).then(|| format!("{root}/{MARKS}/{key}/{owner}"))
}

/// Whether `segment` is a key or an owner token as [`escape`] writes it:
/// no `/`, and every `%` followed by `25` or `2F`. The marks' segment is not.
pub(super) fn is_escaped(segment: &str) -> bool {
    !segment.is_empty()
        && !segment.contains('/')
        && segment
            .match_indices('%')
            .all(|(at, _)| matches!(segment.get(at + 1..at + 3), Some("25" | "2F")))
}

/// The start of a reader's entry name: `%R{owner}`. `%` followed by
/// neither `25` nor `2F`, so no writer's name (an escaped owner) starts so.
pub(super) const READER: &str = "%R";

/// The end of the readers' names in key order: readers are exactly the
/// names from `%R` (included) to `%S` (excluded).
pub(super) const AFTER_READERS: &str = "%S";

/// The start of a permit holder's entry name: `%P{permits}:{owner}`.
const PERMIT: &str = "%P";

/// What an entry's name (its segment below the queue) says it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum EntryKind {
    /// A plain lock: the write mode. Its name is the escaped owner alone.
    Writer,
    /// A reader: `%R{owner}`.
    Reader,
    /// A permit of a semaphore of this many permits: `%P{permits}:{owner}`.
    Permit(u32),
}

impl EntryKind {
    /// The kind of entry a request in `mode` puts.
    pub(super) fn of(mode: HoldMode) -> Self {
        match mode {
            HoldMode::Shared => EntryKind::Reader,
            HoldMode::Permit { permits } => EntryKind::Permit(permits),
            _ => EntryKind::Writer,
        }
    }

    /// The hold mode of such an entry.
    pub(super) fn mode(self) -> HoldMode {
        match self {
            EntryKind::Writer => HoldMode::Exclusive,
            EntryKind::Reader => HoldMode::Shared,
            EntryKind::Permit(permits) => HoldMode::Permit { permits },
        }
    }

    /// The entry's name for `owner` (not escaped yet).
    pub(super) fn name(self, owner: &str) -> String {
        let owner = escape(owner);
        match self {
            EntryKind::Writer => owner,
            EntryKind::Reader => format!("{READER}{owner}"),
            EntryKind::Permit(permits) => format!("{PERMIT}{permits}:{owner}"),
        }
    }

    /// Whether entries of both kinds may be in one queue at once: readers
    /// and writers, or permits of one number.
    pub(super) fn fits(self, other: EntryKind) -> bool {
        match (self, other) {
            (EntryKind::Permit(a), EntryKind::Permit(b)) => a == b,
            (EntryKind::Permit(_), _) | (_, EntryKind::Permit(_)) => false,
            _ => true,
        }
    }
}

/// The kind and the escaped owner an entry's name says; `None` for a name
/// that is no entry's.
pub(super) fn parse_entry(name: &str) -> Option<(EntryKind, &str)> {
    if let Some(owner) = name.strip_prefix(READER) {
        return is_escaped(owner).then_some((EntryKind::Reader, owner));
    }
    if let Some(rest) = name.strip_prefix(PERMIT) {
        let (permits, owner) = rest.split_once(':')?;
        if permits.is_empty() || !permits.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        let permits = permits.parse().ok()?;
        return is_escaped(owner).then_some((EntryKind::Permit(permits), owner));
    }
    is_escaped(name).then_some((EntryKind::Writer, name))
}

/// The segment under the backend's prefix where permits' slot claims
/// live (`{prefix}/%slots/{escaped key}/{slot}`): outside every queue, like
/// the revocation marks.
const SLOTS: &str = "%slots";

/// Where the slot claims of the escaped key `escaped` are.
pub(super) fn slots_of(prefix: &str, escaped: &str) -> String {
    format!("{prefix}/{SLOTS}/{escaped}/")
}

/// The slot a claim's key names, under `slots` (see [`slots_of`]).
pub(super) fn slot_of(slots: &str, key: &[u8]) -> Option<u32> {
    let rest = std::str::from_utf8(key.strip_prefix(slots.as_bytes())?).ok()?;
    if rest.is_empty() || !rest.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    rest.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(url: &str) -> String {
        match parse(url) {
            Ok(_) => panic!("{url} accepted"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn urls_name_members_prefix_credentials_and_ttl() {
        let t = parse("etcd://u%40x:p%3Aw@a:1,b/locks/x/?session_ttl=3s").expect("parses");
        assert_eq!(t.endpoints, ["http://a:1", "http://b:2379"]);
        assert_eq!(t.prefix, "/locks/x");
        assert_eq!(t.user, Some(("u@x".to_owned(), "p:w".to_owned())));
        assert_eq!(t.session_ttl, Duration::from_secs(3));
        let t = parse("etcd://h:2379").expect("parses");
        assert_eq!(t.prefix, "");
        assert_eq!(t.session_ttl, DEFAULT_SESSION_TTL);
        assert!(t.user.is_none());
    }

    #[test]
    fn bad_urls_are_config_errors_without_the_password() {
        for (url, says) in [
            ("redis://h", "expected etcd://"),
            ("etcd://", "empty host"),
            ("etcd://a,,b", "empty host"),
            ("etcd://h:99999", "bad port"),
            ("etcd://h?session_ttl=1500ms", "whole seconds"),
            ("etcd://h?session_ttl=1s", "whole seconds"),
            ("etcd://h?session_ttl=soon", "session_ttl"),
            ("etcd://h?lease=3s", "unknown option"),
            ("etcd://h/a//b", "empty component"),
            ("etcd://user@h", "user:password"),
        ] {
            let e = err(url);
            assert!(e.contains(says), "{url}: {e}");
        }
        let e = err("etcd://u:s3cret@h?session_ttl=0s");
        assert!(!e.contains("s3cret"), "{e}");
    }

    #[test]
    fn escaping_is_injective_and_leaves_no_slash() {
        let keys = ["a/b", "a%2Fb", "a%b", "a", "a/", "/", "%", "%25"];
        let escaped: Vec<String> = keys.iter().map(|k| escape(k)).collect();
        for (i, e) in escaped.iter().enumerate() {
            assert!(!e.contains('/'), "{e}");
            for other in &escaped[i + 1..] {
                assert_ne!(e, other);
            }
        }
        assert_eq!(escape("dlock:order/1%"), "dlock:order%2F1%25");
        for key in keys {
            assert!(is_escaped(&escape(key)), "{key}");
        }
    }

    #[test]
    fn entry_names_say_their_kind_and_writers_keep_the_bare_owner() {
        for kind in [EntryKind::Writer, EntryKind::Reader, EntryKind::Permit(7)] {
            for owner in ["0f3a", "%odd/owner:1", "%R", "%P3:x"] {
                let name = kind.name(owner);
                assert!(!name.contains('/'), "{name}");
                assert_eq!(parse_entry(&name), Some((kind, escape(owner).as_str())));
            }
        }
        assert_eq!(EntryKind::Writer.name("0f3a"), "0f3a");
        // Readers are exactly the names from `%R` to `%S`.
        for owner in ["0f3a", "%x", "!", "~"] {
            let writer = EntryKind::Writer.name(owner);
            assert!(writer.as_str() < READER || writer.as_str() >= AFTER_READERS);
            assert!(!EntryKind::Permit(3).name(owner).starts_with(READER));
        }
        assert_eq!(parse_entry("%Px:a"), None);
        assert_eq!(parse_entry("%P3a"), None);
        assert_eq!(parse_entry(SLOTS), None);
        assert!(EntryKind::Reader.fits(EntryKind::Writer));
        assert!(EntryKind::Permit(3).fits(EntryKind::Permit(3)));
        assert!(!EntryKind::Permit(3).fits(EntryKind::Permit(4)));
        assert!(!EntryKind::Permit(3).fits(EntryKind::Reader));
        let slots = slots_of("/p", "dlock:k");
        assert_eq!(slots, "/p/%slots/dlock:k/");
        assert_eq!(slot_of(&slots, b"/p/%slots/dlock:k/12"), Some(12));
        assert_eq!(slot_of(&slots, b"/p/%slots/dlock:k/1/2"), None);
    }

    #[test]
    fn revocation_marks_are_outside_every_queue() {
        assert_eq!(
            revocation_mark("/locks/x/dlock:a%2Fb/0f3a").as_deref(),
            Some("/locks/x/%revoked/dlock:a%2Fb/0f3a")
        );
        assert_eq!(
            revocation_mark("/dlock:a/0f3a").as_deref(),
            Some("/%revoked/dlock:a/0f3a")
        );
        assert_eq!(revocation_mark("no-slash"), None);
        assert_eq!(revocation_mark("/p/k/"), None);
        // No key escapes to the marks' segment.
        assert!(!is_escaped(MARKS));
        assert!(!is_escaped("a/b"));
        assert!(!is_escaped("a%2"));
        assert!(!is_escaped(""));
        assert!(is_escaped("a%2Fb%25"));
    }
}
