//! `zk://[user:pass@]h1:p1,h2:p2/chroot?session_timeout=10s&loss=session|disconnect&writers=mutex|rw`

use std::time::Duration;

use super::path::valid_path;
use crate::error::{LockError, redact_url};

/// The session timeout asked for when the URL names none.
pub(super) const DEFAULT_SESSION_TIMEOUT: Duration = Duration::from_secs(10);

/// The port of a host named without one.
const DEFAULT_PORT: u16 = 2181;

/// When held leases count as lost while the connection is down.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum LossPolicy {
    /// At `last heard from the server + ⅔ · session timeout`, unless the
    /// client reconnects first: before the server can expire the session.
    Session,
    /// At the first disconnection (Curator's default, "standard" policy).
    Disconnect,
}

/// Whose names a plain lock (a writer) gives its node: Curator's
/// `InterProcessMutex` (`lock-`) or the write lock of Curator's
/// `InterProcessReadWriteLock` (`__WRIT__`). dlock treats both as writers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Writers {
    /// `writers=mutex` (the default): `_c_{guid}-lock-{seq}`.
    Mutex,
    /// `writers=rw`: `_c_{guid}-__WRIT__{seq}`.
    ReadWrite,
}

/// What a `zk://` URL says. Holds the credentials, so it has no `Debug`.
pub(super) struct Target {
    /// `h1:p1,h2:p2`, for the client (which connects at the root).
    pub(super) hosts: String,
    /// `/` or `/a/b`: where the key containers live.
    pub(super) chroot: String,
    /// `user:password` for the `digest` scheme.
    pub(super) digest: Option<String>,
    pub(super) session_timeout: Duration,
    pub(super) loss: LossPolicy,
    pub(super) writers: Writers,
}

fn percent_decode(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = s.get(i + 1..i + 3)?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

pub(super) fn parse(url: &str) -> Result<Target, LockError> {
    let shown = redact_url(url);
    let bad = |why: &str| LockError::config(format!("bad ZooKeeper URL `{shown}`: {why}"));
    let rest = match url.split_once("://") {
        Some((scheme, rest)) if scheme.eq_ignore_ascii_case("zk") => rest,
        _ => {
            return Err(bad(
                "expected zk://[user:pass@]host:port[,host:port…][/chroot]",
            ));
        }
    };
    let (rest, query) = rest.split_once('?').unwrap_or((rest, ""));
    let (authority, chroot) = match rest.find('/') {
        Some(i) => rest.split_at(i),
        None => (rest, ""),
    };
    let (userinfo, hosts) = match authority.rfind('@') {
        Some(at) => (Some(&authority[..at]), &authority[at + 1..]),
        None => (None, authority),
    };
    let digest = match userinfo {
        None => None,
        Some(info) => {
            let (user, pass) = info
                .split_once(':')
                .ok_or_else(|| bad("digest authentication needs `user:password@`"))?;
            let user = percent_decode(user).ok_or_else(|| bad("bad percent-encoding"))?;
            let pass = percent_decode(pass).ok_or_else(|| bad("bad percent-encoding"))?;
            if user.is_empty() || user.contains(':') {
                return Err(bad("the user name must be non-empty, without `:`"));
            }
            Some(format!("{user}:{pass}"))
        }
    };
    let mut nodes = Vec::new();
    for host in hosts.split(',') {
        if host.is_empty() {
            return Err(bad("empty host"));
        }
        let has_port = match host.rfind(':') {
            Some(i) => !host[..i].ends_with(':') && !host.ends_with(']'),
            None => false,
        };
        if has_port {
            let (name, port) = host.rsplit_once(':').unwrap_or((host, ""));
            if name.is_empty() || port.parse::<u16>().is_err() {
                return Err(bad(&format!("bad host `{host}`")));
            }
            nodes.push(host.to_owned());
        } else {
            nodes.push(format!("{host}:{DEFAULT_PORT}"));
        }
    }
    let chroot = match chroot.trim_end_matches('/') {
        "" => "/".to_owned(),
        path => path.to_owned(),
    };
    if !valid_path(&chroot) {
        return Err(bad(&format!(
            "`{chroot}` is not a ZooKeeper path (empty, `.` or `..` components, or \
             characters ZooKeeper refuses)"
        )));
    }
    if chroot == "/zookeeper" || chroot.starts_with("/zookeeper/") {
        return Err(bad("`/zookeeper` is ZooKeeper's own subtree"));
    }
    let mut session_timeout = DEFAULT_SESSION_TIMEOUT;
    let mut loss = LossPolicy::Session;
    let mut writers = Writers::Mutex;
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        match pair.split_once('=') {
            Some(("session_timeout", value)) => {
                session_timeout = humantime::parse_duration(value)
                    .ok()
                    .filter(|t| {
                        *t >= Duration::from_millis(100) && t.as_millis() <= i32::MAX as u128
                    })
                    .ok_or_else(|| bad(&format!("bad `session_timeout={value}`")))?;
            }
            Some(("loss", "session")) => loss = LossPolicy::Session,
            Some(("loss", "disconnect")) => loss = LossPolicy::Disconnect,
            Some(("loss", value)) => {
                return Err(bad(&format!("bad `loss={value}` (session or disconnect)")));
            }
            Some(("writers", "mutex")) => writers = Writers::Mutex,
            Some(("writers", "rw")) => writers = Writers::ReadWrite,
            Some(("writers", value)) => {
                return Err(bad(&format!("bad `writers={value}` (mutex or rw)")));
            }
            _ => {
                return Err(bad(&format!(
                    "unknown option `{pair}` (known: session_timeout, loss, writers)"
                )));
            }
        }
    }
    Ok(Target {
        hosts: nodes.join(","),
        chroot,
        digest,
        session_timeout,
        loss,
        writers,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_url() {
        let t = parse(
            "zk://dlock:s%40cret@127.0.0.1:2181,zk2/locks/app/?session_timeout=4s&loss=disconnect&writers=rw",
        )
        .unwrap();
        assert_eq!(t.hosts, "127.0.0.1:2181,zk2:2181");
        assert_eq!(t.chroot, "/locks/app");
        assert_eq!(t.digest.as_deref(), Some("dlock:s@cret"));
        assert_eq!(t.session_timeout, Duration::from_secs(4));
        assert_eq!(t.loss, LossPolicy::Disconnect);
        assert_eq!(t.writers, Writers::ReadWrite);
    }

    #[test]
    fn defaults() {
        let t = parse("zk://h:1").unwrap();
        assert_eq!(t.hosts, "h:1");
        assert_eq!(t.chroot, "/");
        assert!(t.digest.is_none());
        assert_eq!(t.session_timeout, DEFAULT_SESSION_TIMEOUT);
        assert_eq!(t.loss, LossPolicy::Session);
        assert_eq!(t.writers, Writers::Mutex);
    }

    #[test]
    fn errors_never_show_the_password() {
        for url in [
            "zk://u:hunter2@h:1/a//b",
            "zk://u:hunter2@h:x/",
            "zk://u:hunter2@,h:1/",
            "zk://u:hunter2@h:1/?session_timeout=soon",
            "zk://u:hunter2@h:1/?loss=never",
            "zk://u:hunter2@h:1/?writers=all",
            "zk://u:hunter2@h:1/?timeout=1s",
            "zk://u:hunter2@h:1/zookeeper/x",
            "zk://u:hunter2@h:1/a/../b",
            "zk://:hunter2@h:1/",
            "redis://u:hunter2@h:1/",
        ] {
            let Err(err) = parse(url) else {
                panic!("{url} must be refused")
            };
            assert!(matches!(err, LockError::Config { .. }), "{url}: {err:?}");
            assert!(!err.to_string().contains("hunter2"), "{err}");
        }
    }
}
