//! The Redis URLs: `redis://`, `rediss://`, `redis+cluster://`,
//! `redis+sentinel://` and `redlock://`, with dlock's own options (`timeout`,
//! `tls_ca`, `replicas`, `fencing`, and Sentinel's `sentinel_username`,
//! `sentinel_password`, `sentinel_tls`, `db`) taken out.

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
    /// A primary found through its sentinels (`redis+sentinel://`, `rediss+sentinel://`).
    Sentinel,
}

/// What the URL says, with dlock's own options taken out. It holds the
/// credentials, so it has no `Debug`.
pub(super) struct Target {
    pub(super) topology: Topology,
    /// URLs for the redis crate, one per node (one for a single instance;
    /// with Sentinel, the sentinels').
    pub(super) nodes: Vec<String>,
    /// The URL's `timeout` option, if given.
    pub(super) timeout: Option<Duration>,
    pub(super) tls_ca: Option<Vec<u8>>,
    /// `replicas=N`: how many replicas must acknowledge a grant.
    pub(super) replicas: Option<u32>,
    /// `fencing=on` (the default) or `off`: whether grants issue a fencing token.
    pub(super) fencing: bool,
    /// With Sentinel: the primary's name and how to reach the sentinels and the data nodes.
    pub(super) sentinel: Option<SentinelTarget>,
}

/// What a `redis+sentinel://` URL says beyond its sentinels' addresses.
#[derive(Clone)]
pub(super) struct SentinelTarget {
    /// The name the sentinels monitor the primary under (the URL's path).
    pub(super) name: String,
    /// `sentinel_username`, `sentinel_password` (percent-decoded).
    pub(super) username: Option<String>,
    pub(super) password: Option<String>,
    /// Whether the sentinels are reached over TLS (`sentinel_tls`; default:
    /// as the data nodes).
    pub(super) tls: bool,
    /// `redis` or `rediss`: how the data nodes are reached.
    data_scheme: &'static str,
    /// The URL's user info with its `@`, for the data nodes.
    data_auth: String,
    /// `/db` and the query options passed on to the redis crate.
    data_tail: String,
}

impl SentinelTarget {
    /// Whether the data nodes are reached over TLS.
    pub(super) fn tls_nodes(&self) -> bool {
        self.data_scheme == "rediss"
    }

    /// The redis crate's URL for the data node at `host:port`.
    pub(super) fn node_url(&self, host: &str, port: u16) -> String {
        let host = if host.contains(':') {
            format!("[{host}]")
        } else {
            host.to_owned()
        };
        format!(
            "{}://{}{host}:{port}{}",
            self.data_scheme, self.data_auth, self.data_tail
        )
    }
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
        "redis+sentinel" => (Topology::Sentinel, "redis"),
        "rediss+sentinel" => (Topology::Sentinel, "rediss"),
        other => {
            return Err(LockError::config(format!(
                "`{other}://` is not a Redis scheme (redis://, rediss://, redis+cluster://, \
                 redis+sentinel://, redlock://)"
            )));
        }
    };
    let (rest, query) = rest.split_once('?').unwrap_or((rest, ""));
    let mut timeout = None;
    let mut tls_ca = None;
    let mut replicas = None;
    let mut fencing = true;
    let mut passed_on = Vec::new();
    let (mut sentinel_username, mut sentinel_password, mut sentinel_tls, mut db) =
        (None, None, None, None);
    let sentinel_only = |option: &str| {
        LockError::config(format!(
            "`{option}` is an option of redis+sentinel:// URLs only: `{shown}`"
        ))
    };
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        match pair.split_once('=') {
            Some((name @ ("sentinel_username" | "sentinel_password"), value)) => {
                if topology != Topology::Sentinel {
                    return Err(sentinel_only(name));
                }
                let value = percent_encoding::percent_decode_str(value)
                    .decode_utf8()
                    .map_err(|_| {
                        LockError::config(format!("`{name}` is not UTF-8 text in `{shown}`"))
                    })?
                    .into_owned();
                if name == "sentinel_username" {
                    sentinel_username = Some(value);
                } else {
                    sentinel_password = Some(value);
                }
            }
            Some(("sentinel_tls", value)) => {
                if topology != Topology::Sentinel {
                    return Err(sentinel_only("sentinel_tls"));
                }
                sentinel_tls = Some(match value {
                    "on" | "true" | "yes" => true,
                    "off" | "false" | "no" => false,
                    _ => {
                        return Err(LockError::config(format!(
                            "bad `sentinel_tls={value}` in `{shown}` (on or off)"
                        )));
                    }
                });
            }
            Some(("db", value)) if topology == Topology::Sentinel => {
                db = Some(value.parse::<u32>().map_err(|_| {
                    LockError::config(format!("bad `db={value}` in `{shown}` (a database number)"))
                })?);
            }
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
                            "`fencing` is an option of redis://, redis+cluster:// and redis+sentinel://, not of \
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
    if topology == Topology::Sentinel {
        let name = path.strip_prefix('/').unwrap_or(path);
        if name.is_empty() || name.contains('/') {
            return Err(LockError::config(format!(
                "`{shown}` names no primary: redis+sentinel://s1:26379,s2:26379/<primary-name> \
                 (the name the sentinels monitor it under)"
            )));
        }
        let name = percent_encoding::percent_decode_str(name)
            .decode_utf8()
            .map_err(|_| {
                LockError::config(format!("the primary's name in `{shown}` is not UTF-8"))
            })?
            .into_owned();
        let tls = sentinel_tls.unwrap_or(node_scheme == "rediss");
        let sentinel_scheme = if tls { "rediss" } else { "redis" };
        for host in &hosts {
            if host
                .rsplit_once(':')
                .is_none_or(|(_, port)| port.parse::<u16>().is_err())
            {
                return Err(LockError::config(format!(
                    "`{shown}`: the sentinel `{host}` has no port (host:port, e.g. {host}:26379)"
                )));
            }
        }
        return Ok(Target {
            topology,
            nodes: hosts
                .iter()
                .map(|h| format!("{sentinel_scheme}://{h}"))
                .collect(),
            timeout,
            tls_ca,
            replicas,
            fencing,
            sentinel: Some(SentinelTarget {
                name,
                username: sentinel_username,
                password: sentinel_password,
                tls,
                data_scheme: node_scheme,
                data_auth: auth,
                data_tail: format!("/{}{query}", db.unwrap_or(0)),
            }),
        });
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
        sentinel: None,
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

    #[test]
    fn sentinel_urls() {
        let t =
            parse_url("redis+sentinel://u:p%40ss@s1:26379,s2:26380/mymaster?timeout=1s").unwrap();
        assert!(t.topology == Topology::Sentinel);
        assert_eq!(t.nodes, ["redis://s1:26379", "redis://s2:26380"]);
        assert_eq!(t.timeout, Some(Duration::from_secs(1)));
        let s = t.sentinel.as_ref().unwrap();
        assert_eq!(s.name, "mymaster");
        assert_eq!((s.username.as_deref(), s.password.as_deref()), (None, None));
        assert!(!s.tls && !s.tls_nodes());
        // The URL's credentials go to the data nodes, the sentinels get their own.
        assert_eq!(
            s.node_url("10.0.0.7", 6379),
            "redis://u:p%40ss@10.0.0.7:6379/0"
        );
        assert_eq!(s.node_url("::1", 6379), "redis://u:p%40ss@[::1]:6379/0");

        let t = parse_url(
            "rediss+sentinel://s1:26379/m?sentinel_username=watch&sentinel_password=a%26b&db=3\
             &replicas=1&protocol=resp3",
        )
        .unwrap();
        assert_eq!(t.nodes, ["rediss://s1:26379"], "TLS to the sentinels too");
        assert_eq!(t.replicas, Some(1));
        let s = t.sentinel.as_ref().unwrap();
        assert_eq!(s.username.as_deref(), Some("watch"));
        assert_eq!(s.password.as_deref(), Some("a&b"));
        assert!(s.tls && s.tls_nodes());
        assert_eq!(s.node_url("h", 1), "rediss://h:1/3?protocol=resp3");
        let t = parse_url("rediss+sentinel://s1:26379/m?sentinel_tls=off").unwrap();
        assert_eq!(t.nodes, ["redis://s1:26379"]);
        assert!(t.sentinel.as_ref().unwrap().tls_nodes());

        for (bad, says) in [
            ("redis+sentinel://s1:26379", "names no primary"),
            ("redis+sentinel://s1:26379/", "names no primary"),
            ("redis+sentinel://s1:26379/a/b", "names no primary"),
            ("redis+sentinel:///m", "no host"),
            ("redis+sentinel://s1/m", "has no port"),
            ("redis+sentinel://s1:x/m", "has no port"),
            ("redis+sentinel://s1:1/m?sentinel_tls=maybe", "sentinel_tls"),
            ("redis+sentinel://s1:1/m?db=x", "db=x"),
            ("redis+sentinel://s1:1/m?replicas=0", "replicas"),
            (
                "redis://h:1?sentinel_username=u",
                "redis+sentinel:// URLs only",
            ),
            (
                "redis+cluster://h:1?sentinel_tls=on",
                "redis+sentinel:// URLs only",
            ),
        ] {
            match parse_url(bad) {
                Err(LockError::Config { message }) => {
                    assert!(message.contains(says), "{bad}: {message}")
                }
                Err(other) => panic!("{bad}: not a configuration error: {other:?}"),
                Ok(_) => panic!("`{bad}` must be refused"),
            }
        }
        // Neither password is ever shown.
        let Err(err) =
            parse_url("redis+sentinel://u:hunter2@s1:1/?sentinel_password=s3cret&timeout=1s")
        else {
            panic!("no primary name")
        };
        let shown = format!("{err} {err:?}");
        assert!(
            !shown.contains("hunter2") && !shown.contains("s3cret"),
            "{shown}"
        );
    }
}
