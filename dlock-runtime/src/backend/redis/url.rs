//! The Redis URLs: `redis://`, `rediss://`, `redis+cluster://` and
//! `redlock://`, with dlock's own options (`timeout`, `tls_ca`, `replicas`,
//! `fencing`) taken out.

use std::time::Duration;

use crate::error::{LockError, redact_url};

/// How the nodes of a URL relate.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Topology {
    /// One server (`redis://`, `rediss://`).
    Single,
    /// A Redis Cluster through its seed nodes (`redis+cluster://`).
    Cluster,
    /// Independent masters (`redlock://`, `redlocks://`).
    Redlock,
}

/// What the URL says, with dlock's own options taken out. It holds the
/// credentials, so it has no `Debug`.
pub(super) struct Target {
    pub(super) topology: Topology,
    /// URLs for the redis crate, one per node (one for a single instance).
    pub(super) nodes: Vec<String>,
    /// The URL's `timeout` option, if given.
    pub(super) timeout: Option<Duration>,
    pub(super) tls_ca: Option<Vec<u8>>,
    /// `replicas=N`: how many replicas must acknowledge a grant.
    pub(super) replicas: Option<u32>,
    /// `fencing=on` (the default) or `off`: whether grants issue a fencing token.
    pub(super) fencing: bool,
}

pub(super) fn parse_url(url: &str) -> Result<Target, LockError> {
    let shown = redact_url(url);
    let (scheme, rest) = url
        .split_once("://")
        .ok_or_else(|| LockError::config(format!("`{shown}` is not a Redis URL")))?;
    let (topology, node_scheme) = match scheme.to_ascii_lowercase().as_str() {
        "redis" => (Topology::Single, "redis"),
        "rediss" => (Topology::Single, "rediss"),
        "redis+cluster" => (Topology::Cluster, "redis"),
        "rediss+cluster" => (Topology::Cluster, "rediss"),
        "redlock" => (Topology::Redlock, "redis"),
        "redlocks" => (Topology::Redlock, "rediss"),
        other => {
            return Err(LockError::config(format!(
                "`{other}://` is not a Redis scheme (redis://, rediss://, redis+cluster://, \
                 redlock://)"
            )));
        }
    };
    let (rest, query) = rest.split_once('?').unwrap_or((rest, ""));
    let mut timeout = None;
    let mut tls_ca = None;
    let mut replicas = None;
    let mut fencing = true;
    let mut passed_on = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        match pair.split_once('=') {
            Some(("timeout", value)) => {
                timeout = Some(
                    humantime::parse_duration(value)
                        .ok()
                        .filter(|t| !t.is_zero())
                        .ok_or_else(|| {
                            LockError::config(format!("bad `timeout={value}` in `{shown}`"))
                        })?,
                );
            }
            Some(("replicas", value)) => {
                if topology == Topology::Redlock {
                    return Err(LockError::config(format!(
                        "`replicas` is an option of redis:// and redis+cluster://, not of \
                         Redlock (its masters are independent): `{shown}`"
                    )));
                }
                replicas = Some(value.parse::<u32>().ok().filter(|n| *n > 0).ok_or_else(
                    || {
                        LockError::config(format!(
                            "bad `replicas={value}` in `{shown}` (a number of replicas, at least 1)"
                        ))
                    },
                )?);
            }
            Some(("fencing", value)) => {
                fencing = match value {
                    _ if topology == Topology::Redlock => {
                        return Err(LockError::config(format!(
                            "`fencing` is an option of redis:// and redis+cluster://, not of \
                             Redlock (it never issues a fencing token): `{shown}`"
                        )));
                    }
                    "on" => true,
                    "off" => false,
                    _ => {
                        return Err(LockError::config(format!(
                            "bad `fencing={value}` in `{shown}` (`on`, the default, or `off`)"
                        )));
                    }
                };
            }
            Some(("tls_ca", path)) => {
                tls_ca =
                    Some(std::fs::read(path).map_err(|e| {
                        LockError::config(format!("cannot read tls_ca `{path}`: {e}"))
                    })?);
            }
            _ => passed_on.push(pair),
        }
    }
    let query = if passed_on.is_empty() {
        String::new()
    } else {
        format!("?{}", passed_on.join("&"))
    };
    let (userinfo, hosts_and_path) = match rest.rfind('@') {
        Some(at) => (Some(&rest[..at]), &rest[at + 1..]),
        None => (None, rest),
    };
    let (hosts, path) = match hosts_and_path.find('/') {
        Some(i) => hosts_and_path.split_at(i),
        None => (hosts_and_path, ""),
    };
    let auth = userinfo.map(|u| format!("{u}@")).unwrap_or_default();
    let hosts: Vec<&str> = hosts.split(',').filter(|h| !h.is_empty()).collect();
    if hosts.is_empty() {
        return Err(LockError::config(format!("no host in `{shown}`")));
    }
    if topology == Topology::Single && hosts.len() > 1 {
        return Err(LockError::config(format!(
            "`{shown}` names several hosts: use redis+cluster:// for a cluster, or \
             redlock:// for independent masters"
        )));
    }
    let nodes = hosts
        .iter()
        .map(|h| format!("{node_scheme}://{auth}{h}{path}{query}"))
        .collect();
    Ok(Target {
        topology,
        nodes,
        timeout,
        tls_ca,
        replicas,
        fencing,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls() {
        let t = parse_url("redis://u:p@127.0.0.1:6379/2?timeout=250ms").unwrap();
        assert!(t.topology == Topology::Single);
        assert_eq!(t.nodes, ["redis://u:p@127.0.0.1:6379/2"]);
        assert_eq!(t.timeout, Some(Duration::from_millis(250)));
        let t = parse_url("redis+cluster://:pw@a:1,b:2,c:3").unwrap();
        assert!(t.topology == Topology::Cluster);
        assert_eq!(
            t.nodes,
            ["redis://:pw@a:1", "redis://:pw@b:2", "redis://:pw@c:3"]
        );
        assert!(parse_url("redis://a:1,b:2").is_err());
        assert_eq!(
            parse_url("redis://h:1?replicas=2").unwrap().replicas,
            Some(2)
        );
        assert_eq!(parse_url("redis://h:1").unwrap().replicas, None);
        for bad in [
            "redis://h?replicas=0",
            "redis://h?replicas=two",
            "redlock://a,b,c?replicas=1",
        ] {
            let Err(err) = parse_url(bad) else {
                panic!("`{bad}` must be refused")
            };
            assert!(err.to_string().contains("replicas"), "{err}");
        }
        assert!(parse_url("redis://h?timeout=soon").is_err());
        assert!(parse_url("redis://h:1").unwrap().fencing);
        assert!(parse_url("redis://h:1?fencing=on").unwrap().fencing);
        let t = parse_url("rediss://h:1/3?fencing=off&timeout=1s").unwrap();
        assert!(!t.fencing);
        assert_eq!(t.nodes, ["rediss://h:1/3"]);
        assert!(
            !parse_url("redis+cluster://a:1,b:2?fencing=off")
                .unwrap()
                .fencing
        );
        for bad in [
            "redis://h?fencing=false",
            "redis://h?fencing=",
            "redlock://a,b,c?fencing=off",
        ] {
            let Err(err) = parse_url(bad) else {
                panic!("`{bad}` must be refused")
            };
            assert!(err.to_string().contains("fencing"), "{err}");
        }
        // `Target` holds credentials and has no `Debug` on purpose.
        let Err(err) = parse_url("redis://u:hunter2@a:1,b:2") else {
            panic!("two hosts without +cluster must be refused")
        };
        assert!(!err.to_string().contains("hunter2"));
    }
}
