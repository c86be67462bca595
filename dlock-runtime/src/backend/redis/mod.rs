//! Redis (`redis://`, `rediss://`, `redis+cluster://`).
//!
//! One round trip per operation, each a script that checks the owner:
//!
//! - **acquire**: `SET lock owner NX PX lease`, and on success the fencing
//!   token: the larger of the fence counter + 1 and the server's clock
//!   (`TIME`) in microseconds, written back to the counter (one `SET … GET`:
//!   Redis ≥ 6.2, checked at `connect`). A counter lost (a
//!   restart without persistence, a `DEL`) or behind (a replica promoted before
//!   it heard the last grants) therefore never hands out a token again, as
//!   long as the servers' clocks agree within the replication lag. When
//!   busy, the script answers the holder's remaining TTL.
//! - **release**: compare-and-delete, then a message on the key's release
//!   channel: `PUBLISH` on one server, `SPUBLISH` on Redis Cluster (a plain
//!   `PUBLISH` is broadcast to every node of a cluster; a sharded message
//!   reaches only the key's shard, where the waiters `SSUBSCRIBE`d).
//! - **renew**: compare-and-`PEXPIRE`. The watchdog's batches go out as one
//!   pipeline per backend (one round trip for every lease due).
//!
//! Waiters are woken by the release message (`SSUBSCRIBE`d on Redis Cluster,
//! on the key's shard; see `listener.rs`). A busy waiter subscribes to the
//! key's channel and then tries again before it waits, so a release between its
//! first try and its subscription is never missed (the uncontended path does
//! not pay for a subscription). Waiters also try again when the holder's TTL
//! runs out, so a crashed holder or a lost message costs at most the rest of
//! its lease, never the whole `wait`.
//!
//! A lock `K` (the registry's prefix included) is stored as `{K}` and its
//! release channel is `{K}:released`. The fence counters are shared, so the
//! server keeps **no key per lock name** once its lock is released: one
//! counter `dlock-fence` per server (and database), or on **Redis Cluster**
//! one per hash slot, `dlock-fence:{<tag>}`, with the tag chosen so that the
//! counter is in the slot of the lock keys it serves (one script touches both;
//! see `slots.rs`). Keys are passed as `KEYS[]`, so ACL key patterns apply:
//! `~{dlock:*` (the locks, default prefix), `~dlock-fence` and
//! `~dlock-fence:*` (the counters), channels `&{dlock:*` (sharded channels
//! on a cluster: `SPUBLISH`, `SSUBSCRIBE`, `SUNSUBSCRIBE` allowed).
//!
//! **Server settings a lock needs.** A lock key that the server drops is a
//! lock lost without notice until the next renewal:
//!
//! - `maxmemory-policy noeviction` (the default) or no `maxmemory`: every
//!   other policy can evict lock keys (they carry a TTL, so even the
//!   `volatile-*` ones do). `connect` logs a `warn` event when the server
//!   could evict them.
//! - Persistence (`appendonly yes`, `appendfsync always` or `everysec`) if a
//!   restart must not free held keys: a server restarted empty lets another
//!   client take a key whose holder still believes it holds it (until its
//!   next renewal fails). Fencing tokens stay safe either way: a token is
//!   never below the server clock in µs.
//! - Replication is asynchronous: a replica promoted before it received a
//!   grant does not know the lock. Where failover matters, ask for replica
//!   acknowledgements (`?replicas=N`, below), use Redlock over independent
//!   masters, or a backend with synchronous replication.
//!
//! **Outages.** An acquisition that meets a transient failure (connection
//! refused or dropped, a timeout, `LOADING`, `TRYAGAIN`, `CLUSTERDOWN`,
//! `MASTERDOWN`, `BUSY`, `NOREPLICAS`) is tried again with a
//! doubling back-off (25 ms up to 500 ms) while its `wait` lasts, so a server
//! restarting within `wait` costs a delay, not an error; the error is the
//! answer only once `wait` has run out. A retry that finds the key already
//! ours (the failed attempt did reach the server) takes it again from now,
//! with a new token. Permanent errors (`NOPERM`, a wrong password,
//! `READONLY`: the connection reached a replica, and does not move by itself)
//! are answered at once.
//!
//! **Replica acknowledgement** (`?replicas=N`, Redisson's guard against a
//! failover that loses a fresh lock): after a grant, `WAIT N timeout/2` on
//! the connection that sent it (on a cluster, to the key's master). Fewer
//! than `N` acknowledgements and the grant is undone (owner-checked release)
//! and counts as a transient failure: tried again while `wait` lasts, then
//! the error says how many replicas answered. Grants go over a connection of
//! their own, because `WAIT` holds up the connection's later commands on the
//! server, and a replica that is down must not delay renewals and releases.
//! Renewals are not acknowledged (a renewal only extends a key the replicas
//! already have). This narrows the window, it does not close it: replication
//! stays asynchronous, and a replica promoted before it heard a renewal can
//! still expire a lease early.
//!
//! URLs: `redis://[user:pass@]host:port[/db]`, `rediss://…` (TLS; `?tls_ca=/path/ca.pem`
//! to trust a private CA), `redis+cluster://[user:pass@]h1:p1,h2:p2,…`.
//! Options: `timeout` (default 2 s) bounds every command; `replicas=N`
//! (above). The connection reconnects in the background, and while it is
//! down renewals fail until the watchdog declares the lease lost, before it
//! ends on the server.

mod connections;
mod listener;
pub mod redlock;
mod slots;

use std::borrow::Cow;
use std::fmt;
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use futures_util::future::BoxFuture;
use redis::{Client, RedisError, Script};

use connections::{Conn, Connections};
pub(super) use listener::{Listener, Source};

use crate::backend::{
    AcquireRequest, Attempt, Lease, LockBackend, Renewal, WakeSource, ceil_millis,
};
use crate::error::{BackendError, LockError, redact_url};
use crate::token::FencingToken;

/// `KEYS[1]` lock, `KEYS[2]` fence counter; `ARGV[1]` owner, `ARGV[2]` lease (ms).
/// Answers `{1, token}` or `{0, holder's remaining ms}`. Sent twice for one
/// owner (a retry), it grants again (lease from now, a larger token).
static ACQUIRE: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("acquire.lua")));

/// `KEYS[1]` lock; `ARGV[1]` owner, `ARGV[2]` ttl (ms). Answers 1 if extended.
pub(super) static RENEW: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("renew.lua")));

/// `KEYS[1]` lock; `ARGV[1]` owner, `ARGV[2]` release channel. Answers 1 if
/// deleted. Wakes waiters with `PUBLISH` (one server, Redlock's masters).
pub(super) static RELEASE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("release.lua")));

/// [`RELEASE`] for Redis Cluster: `SPUBLISH`, so the message reaches only
/// the shard of the key (the channel is in the lock key's slot), where a
/// `PUBLISH` would be broadcast to every node.
static RELEASE_SHARDED: LazyLock<Script> =
    LazyLock::new(|| Script::new(&include_str!("release.lua").replace("'PUBLISH'", "'SPUBLISH'")));

const DEFAULT_TIMEOUT: Duration = Duration::from_secs(2);
/// The first pause after an attempt that failed transiently (the wait loop
/// doubles it while the server stays away).
const OUTAGE_RETRY: Duration = Duration::from_millis(25);

/// The Redis backend. See the [module docs](self).
pub struct RedisBackend {
    conns: Connections,
    listener: Listener,
    shown_url: String,
    timeout: Duration,
    acks: Option<ReplicaAcks>,
}

/// `?replicas=N`: a grant counts once `N` replicas have acknowledged it
/// (`WAIT N timeout` after the acquire script, on the connection that sent it).
///
/// The grants go over a connection of their own: `WAIT` blocks the
/// connection's later commands on the server until it answers, and a replica
/// that is down would otherwise hold up the renewals and releases sharing it.
struct ReplicaAcks {
    replicas: u32,
    /// `WAIT`'s own timeout: half the command timeout, so the server answers
    /// (with the count so far) before the client gives up on the command.
    wait: Duration,
    conns: Connections,
}

/// A lock's names on the server, built once per attempt and kept with its lease.
#[derive(Clone)]
struct Keys {
    /// `{K}`.
    lock: String,
    /// `{K}:released`.
    channel: String,
}

impl Keys {
    fn new(stored: &str) -> Self {
        let lock = format!("{{{stored}}}");
        let channel = format!("{lock}:released");
        Keys { lock, channel }
    }

    /// The lease's names: kept with it at the grant, built again for a lease
    /// the runtime made itself (the release of an abandoned acquisition).
    fn of(lease: &Lease) -> Cow<'_, Keys> {
        match lease.extra.as_ref().and_then(|e| e.downcast_ref::<Keys>()) {
            Some(keys) => Cow::Borrowed(keys),
            None => Cow::Owned(Keys::new(&lease.key)),
        }
    }
}

impl fmt::Debug for RedisBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisBackend")
            .field("url", &self.shown_url)
            .field("cluster", &self.conns.is_cluster())
            .field("timeout", &self.timeout)
            .field("replicas", &self.acks.as_ref().map(|a| a.replicas))
            .finish_non_exhaustive()
    }
}

pub(super) fn redis_error(err: RedisError) -> BackendError {
    if err.is_timeout()
        || err.is_connection_dropped()
        || err.is_connection_refusal()
        || err.is_io_error()
        || matches!(
            err.code(),
            Some(
                "TRYAGAIN"
                    | "LOADING"
                    | "CLUSTERDOWN"
                    | "MASTERDOWN"
                    // A script running past its time limit: the server is stalled.
                    | "BUSY"
                    // `min-replicas-to-write` not met: replicas reconnecting.
                    | "NOREPLICAS"
            )
        )
    {
        BackendError::transient(err)
    } else {
        BackendError::permanent(err)
    }
}

/// A lease as milliseconds for `PX`/`PEXPIRE`: rounded up, and capped where
/// Redis still accepts it.
pub(super) fn millis(d: Duration) -> u64 {
    ceil_millis(d).min(i64::MAX as u64 / 2)
}

/// The fence counter that serves `lock_key`: the server's one, or on a
/// cluster the one of the key's hash slot.
fn fence_key(cluster: bool, lock_key: &str) -> Cow<'static, str> {
    if cluster {
        Cow::Owned(slots::cluster_fence_key(lock_key))
    } else {
        Cow::Borrowed(slots::SINGLE_FENCE_KEY)
    }
}

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
    })
}

pub(super) fn client(node: &str, tls_ca: &Option<Vec<u8>>) -> Result<Client, RedisError> {
    match tls_ca {
        Some(ca) => Client::build_with_tls(
            node,
            redis::TlsCertificates {
                client_tls: None,
                root_cert: Some(ca.clone()),
            },
        ),
        None => Client::open(node),
    }
}

/// rustls needs one process-wide crypto provider; dlock installs ring's unless
/// the application installed one first.
pub(super) fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

impl RedisBackend {
    /// Connects to the server (or cluster) a URL names. See the [module docs](self).
    pub async fn connect(url: &str) -> Result<Self, LockError> {
        let shown_url = redact_url(url);
        let target = parse_url(url)?;
        if target.topology == Topology::Redlock {
            return Err(LockError::config(format!(
                "`{shown_url}` is a Redlock URL: open it with RedlockBackend::connect"
            )));
        }
        if target.nodes.iter().any(|n| n.starts_with("rediss")) {
            install_crypto_provider();
        }
        let timeout = target.timeout.unwrap_or(DEFAULT_TIMEOUT);
        let fail = |e: RedisError| LockError::Backend {
            backend: "redis",
            source: BackendError::transient(format!("cannot connect to {shown_url}: {e}")),
        };
        let source = if target.topology == Topology::Cluster {
            Source::Sharded {
                nodes: target.nodes.clone(),
                tls_ca: target.tls_ca.clone(),
            }
        } else {
            Source::Plain(
                client(&target.nodes[0], &target.tls_ca)
                    .map_err(|e| LockError::config(format!("bad Redis URL `{shown_url}`: {e}")))?,
            )
        };
        let conns = Connections::open(&target, timeout).await.map_err(fail)?;
        let acks = match target.replicas {
            Some(replicas) => Some(ReplicaAcks {
                replicas,
                wait: timeout / 2,
                conns: Connections::open(&target, timeout).await.map_err(fail)?,
            }),
            None => None,
        };
        let backend = RedisBackend {
            conns,
            listener: Listener::start(source, timeout),
            shown_url,
            timeout,
            acks,
        };
        // One round trip now: a wrong password or a missing ACL permission is
        // an error of `connect`, not of the first lock.
        backend.ping().await.map_err(|e| LockError::Backend {
            backend: "redis",
            source: e,
        })?;
        backend.check_version().await?;
        backend.warn_if_keys_can_be_evicted().await;
        Ok(backend)
    }

    async fn ping(&self) -> Result<(), BackendError> {
        let ping = redis::cmd("PING");
        let _: String = match self.conns.home() {
            Conn::Single(mut c) => ping.query_async(&mut c).await,
            Conn::Cluster(mut c) => ping.query_async(&mut c).await,
        }
        .map_err(redis_error)?;
        Ok(())
    }

    /// One script call, over the local connection when there is one. The
    /// scripts may run twice (see [`connections`]): each is idempotent for
    /// its owner.
    async fn invoke<T: redis::FromRedisValue>(
        &self,
        invocation: &redis::ScriptInvocation<'_>,
    ) -> Result<T, BackendError> {
        let route = self.conns.route();
        match call(route.conn.clone(), invocation).await {
            Err(_) if route.died() => call(self.conns.home(), invocation).await,
            answer => answer,
        }
        .map_err(redis_error)
    }

    /// One attempt: the lease, or how long the holder's lease has left. A
    /// transient failure (the server down, restarting, or too slow) is
    /// [`Attempt::Unavailable`]: the wait loop tries again while `wait` lasts.
    /// With `?replicas=N`, so is a grant too few replicas acknowledged
    /// (undone first).
    async fn try_once(&self, request: &AcquireRequest) -> Result<Attempt, BackendError> {
        let keys = Keys::new(&request.key);
        let fence = fence_key(self.conns.is_cluster(), &keys.lock);
        let mut invocation = ACQUIRE.key(&keys.lock);
        invocation
            .key(fence.as_ref())
            .arg(&request.owner)
            .arg(millis(request.lease));
        let answer: Result<(i64, i64), BackendError> = match &self.acks {
            None => self.invoke(&invocation).await,
            Some(acks) => call(acks.conns.home(), &invocation)
                .await
                .map_err(redis_error),
        };
        let (taken, value) = match answer {
            Ok(answer) => answer,
            Err(error) if error.is_retryable() => {
                return Ok(Attempt::Unavailable {
                    error,
                    retry_in: OUTAGE_RETRY,
                });
            }
            Err(error) => return Err(error),
        };
        if taken == 1 {
            if let Some(acks) = &self.acks
                && let Err(error) = acks.acknowledged(&keys.lock).await
            {
                // Not on enough replicas: a failover now could lose it. Undo
                // (owner-checked; the waiters hear the key is free again).
                let _ = self.release_keys(&keys, &request.owner).await;
                return Ok(Attempt::Unavailable {
                    error,
                    retry_in: OUTAGE_RETRY,
                });
            }
            Ok(Attempt::Held(
                Lease::new(request, Some(FencingToken::new(value as u64)))
                    .with_extra(Arc::new(keys)),
            ))
        } else {
            // -1: no expiry (never set by dlock), -2: gone since; look again soon.
            Ok(Attempt::Busy {
                retry_in: Some(Duration::from_millis(value.max(1) as u64)),
            })
        }
    }

    /// Refuses a server older than 6.2: the acquire script reads and writes
    /// the fence counter with one `SET … GET`. An ACL user without `INFO` is
    /// not checked (the first acquisition would then fail with Redis's own
    /// syntax error).
    async fn check_version(&self) -> Result<(), LockError> {
        let Conn::Single(mut conn) = self.conns.home() else {
            // Redis Cluster needs 7.0 for SPUBLISH anyway (see the docs).
            return Ok(());
        };
        let Ok(info) = redis::cmd("INFO")
            .arg("server")
            .query_async::<String>(&mut conn)
            .await
        else {
            return Ok(());
        };
        let version = info
            .lines()
            .find_map(|l| l.strip_prefix("redis_version:"))
            .map(str::trim)
            .unwrap_or_default();
        let mut parts = version.split('.').map(|p| p.parse::<u32>().unwrap_or(0));
        let (major, minor) = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
        if !version.is_empty() && (major, minor) < (6, 2) {
            return Err(LockError::config(format!(
                "{} runs Redis {version}; dlock needs Redis >= 6.2 (7.0 for Redis Cluster)",
                self.shown_url
            )));
        }
        Ok(())
    }

    /// Warns when the server may evict lock keys to make room: a lock key
    /// evicted is a lock silently lost. Errors (an ACL user without `CONFIG`)
    /// are ignored: the check is advice, not a requirement.
    async fn warn_if_keys_can_be_evicted(&self) {
        let mut cmd = redis::cmd("CONFIG");
        cmd.arg("GET").arg("maxmemory*");
        let answer: Result<Vec<String>, RedisError> = match self.conns.home() {
            Conn::Single(mut c) => cmd.query_async(&mut c).await,
            Conn::Cluster(mut c) => cmd.query_async(&mut c).await,
        };
        let Ok(pairs) = answer else { return };
        let get = |name: &str| {
            pairs
                .chunks(2)
                .find(|kv| kv[0] == name)
                .and_then(|kv| kv.get(1).cloned())
        };
        let limited = get("maxmemory").is_some_and(|m| m != "0");
        let policy = get("maxmemory-policy").unwrap_or_default();
        if limited && policy != "noeviction" {
            tracing::warn!(
                url = %self.shown_url,
                policy = %policy,
                "dlock: this Redis server may evict keys (maxmemory is set and \
                 maxmemory-policy is not `noeviction`): an evicted lock key is a lock lost \
                 without notice. Use `noeviction` (or a server of its own) for locks"
            );
        }
    }

    async fn renew_one(&self, lease: &Lease, ttl: Duration) -> Result<Renewal, BackendError> {
        let extended: i64 = self
            .invoke(
                RENEW
                    .key(&Keys::of(lease).lock)
                    .arg(&lease.owner)
                    .arg(millis(ttl)),
            )
            .await?;
        Ok(renewal(extended))
    }

    /// The release script for `keys`: `SPUBLISH` on a cluster.
    fn release_invocation(&self, keys: &Keys, owner: &str) -> redis::ScriptInvocation<'static> {
        let script = if self.conns.is_cluster() {
            &*RELEASE_SHARDED
        } else {
            &*RELEASE
        };
        let mut invocation = script.key(&keys.lock);
        invocation.arg(owner).arg(&keys.channel);
        invocation
    }

    /// Owner-checked release over the usual route.
    async fn release_keys(&self, keys: &Keys, owner: &str) -> Result<i64, BackendError> {
        self.invoke(&self.release_invocation(keys, owner)).await
    }
}

impl ReplicaAcks {
    /// `WAIT replicas timeout` on the connection that sent the grant (on a
    /// cluster, to the master of the key's slot): an error unless at least
    /// `replicas` replicas acknowledged every write sent before it.
    async fn acknowledged(&self, lock_key: &str) -> Result<(), BackendError> {
        let mut wait = redis::cmd("WAIT");
        wait.arg(self.replicas).arg(millis(self.wait));
        let answer: Result<i64, RedisError> = match self.conns.home() {
            Conn::Single(mut c) => wait.query_async(&mut c).await,
            Conn::Cluster(mut c) => {
                use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
                let slot = slots::key_slot(lock_key.as_bytes());
                let route = RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(
                    Route::new(slot, SlotAddr::Master),
                ));
                c.route_command(wait, route)
                    .await
                    .and_then(|v| redis::from_redis_value(v).map_err(RedisError::from))
            }
        };
        match answer {
            Ok(n) if n >= i64::from(self.replicas) => Ok(()),
            Ok(n) => Err(BackendError::transient(format!(
                "redis: only {n} of the {} replicas asked for (`replicas={}`) acknowledged the \
                 grant within {:?}; undone",
                self.replicas, self.replicas, self.wait
            ))),
            Err(e) => Err(BackendError::transient(format!(
                "redis: the replicas' acknowledgement (`WAIT {}`) failed: {e}; grant undone",
                self.replicas
            ))),
        }
    }
}

async fn call<T: redis::FromRedisValue>(
    conn: Conn,
    invocation: &redis::ScriptInvocation<'_>,
) -> Result<T, RedisError> {
    match conn {
        Conn::Single(mut c) => invocation.invoke_async(&mut c).await,
        Conn::Cluster(mut c) => invocation.invoke_async(&mut c).await,
    }
}

fn renewal(extended: i64) -> Renewal {
    if extended == 1 {
        Renewal::Renewed
    } else {
        Renewal::Lost
    }
}

impl LockBackend for RedisBackend {
    fn kind(&self) -> &'static str {
        "redis"
    }

    fn check_key(&self, key: &str) -> Result<(), String> {
        if self.conns.is_cluster() && key.starts_with('}') {
            // `{}…}` would be an empty hash tag: the lock and its release
            // channel would land in different slots.
            return Err("on Redis Cluster a stored key cannot start with `}`".into());
        }
        Ok(())
    }

    fn try_acquire<'a>(
        &'a self,
        request: &'a AcquireRequest,
    ) -> BoxFuture<'a, Result<Attempt, BackendError>> {
        Box::pin(self.try_once(request))
    }

    fn wake_source<'a>(&'a self, request: &'a AcquireRequest) -> BoxFuture<'a, WakeSource> {
        let key = &request.key;
        Box::pin(async move {
            let channel = Keys::new(key).channel;
            match self.listener.join(channel).await {
                Some(subscription) => {
                    WakeSource::notify(subscription.notify.clone()).keep_alive(subscription)
                }
                None => WakeSource::none(),
            }
        })
    }

    fn renew<'a>(
        &'a self,
        lease: &'a Lease,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Renewal, BackendError>> {
        Box::pin(self.renew_one(lease, ttl))
    }

    fn renew_all<'a>(
        &'a self,
        batch: &'a [(&'a Lease, Duration)],
    ) -> BoxFuture<'a, Vec<Result<Renewal, BackendError>>> {
        Box::pin(async move {
            // The watchdog calls from dlock's I/O runtime: this is the home connection.
            let Conn::Single(mut conn) = self.conns.route().conn else {
                // A cluster routes each key to its node; the commands still
                // share each node's connection.
                return futures_util::future::join_all(
                    batch.iter().map(|(lease, ttl)| self.renew_one(lease, *ttl)),
                )
                .await;
            };
            let mut pipe = redis::pipe();
            pipe.load_script(&RENEW).ignore();
            for (lease, ttl) in batch {
                pipe.invoke_script(
                    RENEW
                        .key(&Keys::of(lease).lock)
                        .arg(&lease.owner)
                        .arg(millis(*ttl)),
                );
            }
            match pipe.query_async::<Vec<i64>>(&mut conn).await {
                Ok(answers) if answers.len() == batch.len() => answers
                    .into_iter()
                    .map(|extended| Ok(renewal(extended)))
                    .collect(),
                Ok(_) => batch
                    .iter()
                    .map(|_| Err(BackendError::permanent("redis: short pipeline answer")))
                    .collect(),
                Err(err) => {
                    let err = redis_error(err);
                    let (transient, message) = (err.is_retryable(), err.to_string());
                    batch
                        .iter()
                        .map(|_| {
                            let message = format!("redis: renewal pipeline failed: {message}");
                            Err(if transient {
                                BackendError::transient(message)
                            } else {
                                BackendError::permanent(message)
                            })
                        })
                        .collect()
                }
            }
        })
    }

    fn release<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<(), BackendError>> {
        Box::pin(async move {
            let keys = Keys::of(lease);
            let invocation = self.release_invocation(&keys, &lease.owner);
            let routed: Result<i64, BackendError> = self.invoke(&invocation).await;
            if lease.token.is_some() {
                routed?;
                return Ok(());
            }
            // The release of an acquisition dropped on the wire (a grant
            // always has a token): its command may have gone over another
            // connection (the local one opened, or went, in between; the
            // grants' own with `replicas`), so release over those too,
            // whatever the first answered — on each, the release then
            // follows the abandoned command. Any one succeeding is enough.
            let home: Result<i64, RedisError> = call(self.conns.home(), &invocation).await;
            let acks: Option<Result<i64, RedisError>> = match &self.acks {
                Some(acks) => Some(call(acks.conns.home(), &invocation).await),
                None => None,
            };
            if routed.is_err() && !matches!(acks, Some(Ok(_))) {
                home.map_err(redis_error)?;
            }
            Ok(())
        })
    }

    fn needs_io_runtime(&self) -> bool {
        // The connections' driver tasks already live on dlock's I/O runtime and
        // keep the order of commands, so calls go straight from the caller.
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cluster_release_script_publishes_to_the_shard() {
        let sharded = include_str!("release.lua").replace("'PUBLISH'", "'SPUBLISH'");
        assert!(sharded.contains("redis.call('SPUBLISH', ARGV[2], '1')"));
        assert!(!sharded.contains("redis.call('PUBLISH'"));
    }

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
        // `Target` holds credentials and has no `Debug` on purpose.
        let Err(err) = parse_url("redis://u:hunter2@a:1,b:2") else {
            panic!("two hosts without +cluster must be refused")
        };
        assert!(!err.to_string().contains("hunter2"));
    }
}
