//! Redis (`redis://`, `rediss://`, `redis+cluster://`, `redis+sentinel://`).
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
//!   **Without a fencing token** (`fencing(false)` on a lock, `fencing =
//!   false` in the attribute, or `?fencing=off` on the URL for every lock of
//!   the backend) no script runs: one pipeline of `SET lock owner NX PX
//!   lease GET` (nil: taken; else the holder) and `PTTL lock` (the holder's
//!   remaining TTL, for the wait loop), one round trip. The key and its value
//!   are the same as a fenced grant's, so fenced and unfenced holds of one
//!   key exclude each other, and release and renewal are the same scripts.
//!   A retry that finds the key already ours extends it from now (one more
//!   round trip, owner-checked). `SET … NX GET` needs Redis 7.0: on 6.2 an
//!   unfenced grant runs the acquire script and drops the token.
//! - **release**: compare-and-delete, then a message on the key's release
//!   channel: `PUBLISH` on one server, `SPUBLISH` on Redis Cluster (a plain
//!   `PUBLISH` is broadcast to every node of a cluster; a sharded message
//!   reaches only the key's shard, where the waiters `SSUBSCRIBE`d).
//! - **several keys** (`lock_all`, `keys = [..]`): one script takes every
//!   key or none (busy: the index of a busy key and its holder's remaining
//!   TTL; the waiter sleeps on that key's release channel), each key with its
//!   own token by the acquire script's own rule (the script runs it as a
//!   function), and the same for unfenced holds (the tokens dropped). On
//!   Redis Cluster only when every lock key is in one hash slot: the stored
//!   key `K` becomes `{K}`, so keys that are the same up to their first `}`
//!   share a slot (`acct:{42}:from`, `acct:{42}:to`); others are taken one
//!   by one, in the same order.
//! - **renew**: compare-and-`PEXPIRE`. The watchdog's batches go out as one
//!   pipeline per backend (one round trip for every lease due).
//!
//! **Semaphores and read-write locks** (`permits(n)`, `read()`; a plain lock
//! is the write mode). Readers and permits live in one hash at the lock key
//! `{K}` itself, where a plain lock keeps its string: field `n` says `r`
//! (readers) or the number of permits, and each holder is one field
//! (`r:<owner>`, or its slot `0..n`) whose value is its own expiry on the
//! server's clock followed by the plain value (owner, token, grant time,
//! record). One script per operation (`acquire_held.lua`, `renew_held.lua`,
//! `release_held.lua`), each purging expired holders first, so a crashed
//! reader or permit holder frees only its own share after its lease (as
//! madelson's ZSET-of-expiries semaphore does, with a slot per holder as
//! Redisson's permit ids give). A grant takes the lowest free slot, and its
//! token by the plain rule from the same counter (so tokens grow per key and
//! per (key, slot), and readers and writers share one sequence); a full
//! semaphore answers its earliest holder's expiry. The key's TTL is never
//! shorter than its longest holder's and is recomputed on release, so the
//! hash is gone once every holder is (nothing per name stays on the server).
//! **Why one key**: the plain lock's scripts stay exactly as they were, and
//! meet the hash for free: their `GET` (or `SET … NX GET`) answers
//! `WRONGTYPE`, and only then the attempt goes to `acquire_held.lua`, which
//! answers a mismatch (a semaphore; `LockError::Config`) or, for readers,
//! busy after leaving the **waiting-writer mark** `{K}:writer` (the
//! writer's owner, for 3 s or its lease if shorter, so a crashed writer
//! holds readers back only that long; its retries, at least every third
//! of that, renew it; removed by its grant, its owner-checked release or
//! undo — the undo of an abandoned whole-key attempt always looks for it,
//! since the attempt may have left it unanswered — or `abandon` when its
//! wait runs out).
//! New readers find the mark and wait behind it (writers are preferred;
//! madelson's writer-waiting entry). A grant to a reader sends a release
//! message too, so readers that waited behind a writer enter one after
//! another. The plain renew and release scripts read the hash as not the
//! owner's (`redis.pcall`), so a lost plain lease whose key now has readers
//! answers lost. Renewals of every mode share the pipelined batch;
//! `revoke` removes every holder and marks each owner revoked; `inspect`
//! and `list` show one entry per reader or permit with its mode and slot
//! (the mark is not a name of its own). `?replicas=N` acknowledges these
//! grants as it does plain ones (an unacknowledged one is undone);
//! unfenced holds (`fencing = false`) run the same script and drop the
//! token (readers and permits have no script-free path). Redlock does not
//! offer them (see `redlock`).
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
//! release channel is `{K}:released`. Its value is the owner token, a newline
//! and the holder's record (token, grant time, host, pid, name: see
//! `admin.rs`, which also reads it back for `inspect`, `list` and `revoke`);
//! a revoked owner is added to `{K}:revoked` (the set of the owners revoked
//! within their lease), which lives as long as the longest lease it marks had left. The fence counters are shared, so the
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
//! **Redis Sentinel** (`redis+sentinel://`): commands go to the primary the
//! sentinels name, which must confirm it with `ROLE`; the sentinels are asked
//! all at once (`SENTINEL MASTER`), a silent one holding up nothing, and the
//! answer with the highest configuration epoch wins (never one older than the
//! epoch followed). A renewal counts only if a sentinel, asked after its
//! reply, confirms the node is still the primary of the latest epoch (one
//! query per renewal batch): a holder cut off from the sentinels, or renewing
//! on a demoted primary, hears it lost the lock before its lease can end on
//! the new primary. They are asked again
//! when a command meets `READONLY` (transient here: a failover), a dropped or
//! refused connection or a timeout (the command is then sent once more if the
//! primary moved); a switch is followed as soon as a sentinel announces it
//! (`+switch-master`); and the sentinels are asked every second regardless,
//! because after `SENTINEL FAILOVER` the old primary keeps accepting writes for
//! about 11 s. Renewals, releases and acquisitions follow; the listener
//! subscribes again on the new primary and wakes every waiter. redis-rs's
//! `sentinel` feature is not used: it resolves the primary only when a
//! connection is made, and its `ConnectionManager` then reconnects to that
//! address for ever. Commands go over the connection on dlock's I/O runtime
//! only (no local connection, which could not be moved). A lease the new
//! primary lacks (replication is asynchronous: a grant or renewal it had not
//! received, or one sent to the old primary in the moment before the move) is
//! reported lost at its holder's next renewal; tokens keep growing (the
//! counter is replicated, and the clock rule above covers the rest).
//! `?replicas=N` covers grants, not renewals. An ACL user needs `+role` on the
//! data nodes beside the commands above.
//!
//! URLs: `redis://[user:pass@]host:port[/db]`, `rediss://…` (TLS; `?tls_ca=/path/ca.pem`
//! to trust a private CA), `redis+cluster://[user:pass@]h1:p1,h2:p2,…`,
//! `redis+sentinel://[user:pass@]s1:p1,s2:p2/<primary-name>` (the user and
//! password are the data nodes'; `?sentinel_username=`, `?sentinel_password=`
//! for the sentinels, `?db=N`, `?sentinel_tls=on|off`; `rediss+sentinel://`
//! for TLS to the data nodes and, unless `sentinel_tls=off`, the sentinels).
//! Options: `timeout` (default 2 s) bounds every command; `replicas=N`
//! (above); `fencing=off` (default `on`): grants without a fencing token
//! (above), for every lock of the backend. The connection reconnects in the background, and while it is
//! down renewals fail until the watchdog declares the lease lost, before it
//! ends on the server.

mod admin;
mod conn;
mod connections;
mod listener;
pub mod redlock;
mod replicas;
pub(crate) mod scripts;
mod sentinel;
pub(crate) mod slots;
mod url;

use std::borrow::Cow;
use std::collections::HashSet;
use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::future::BoxFuture;
use redis::RedisError;

use conn::{Conn, client, install_crypto_provider};
use connections::{Connections, call};
use listener::{Listener, Source};
use replicas::ReplicaAcks;
use scripts::{
    ACQUIRE, ACQUIRE_ALL, ACQUIRE_HELD, ACQUIRE_HELD_SHARDED, RELEASE, RELEASE_HELD,
    RELEASE_HELD_SHARDED, RELEASE_SHARDED, RENEW, RENEW_HELD, is_wrong_type, millis, redis_error,
};
use url::{Topology, parse_url};

use crate::backend::{
    AcquireRequest, Attempt, AttemptAll, HeldEntry, HoldMode, KeyEntry, Lease, LockBackend,
    Renewal, WakeSource,
};
use crate::error::{BackendError, LockError, redact_url};
use crate::token::FencingToken;

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
    /// `?fencing=off` makes every grant unfenced (see the module docs).
    fencing: bool,
    /// Whether the server takes `SET … NX GET` (Redis >= 7.0), which the
    /// unfenced grant is built on (else it falls back to the acquire script).
    set_nx_get: bool,
    /// The whole-key requests (stored key and owner) that met readers, and
    /// so may have left a waiting-writer mark: their attempts and release go
    /// through the scripts that know the mark, until their grant or release.
    marked: Mutex<HashSet<(String, String)>>,
    /// How many entries `marked` has: the plain path reads this, not the lock.
    marks: AtomicUsize,
}

/// A lock's names on the server, built once per attempt and kept with its lease.
#[derive(Clone)]
struct Keys {
    /// `{K}`.
    lock: String,
    /// `{K}:released`.
    channel: String,
    /// `{K}:writer`: the waiting-writer mark.
    mark: String,
}

impl Keys {
    fn new(stored: &str) -> Self {
        let lock = format!("{{{stored}}}");
        let channel = format!("{lock}:released");
        let mark = format!("{lock}:writer");
        Keys {
            lock,
            channel,
            mark,
        }
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
            .field("fencing", &self.fencing)
            .finish_non_exhaustive()
    }
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
        if target.nodes.iter().any(|n| n.starts_with("rediss"))
            || target.sentinel.as_ref().is_some_and(|s| s.tls_nodes())
        {
            install_crypto_provider();
        }
        let timeout = target.timeout.unwrap_or(DEFAULT_TIMEOUT);
        let fail = |e: BackendError| LockError::Backend {
            backend: "redis",
            source: BackendError::transient(format!("cannot connect to {shown_url}: {e}")),
        };
        let source = match target.topology {
            Topology::Cluster => Some(Source::Sharded {
                nodes: target.nodes.clone(),
                tls_ca: target.tls_ca.clone(),
            }),
            Topology::Sentinel => None,
            _ => Some(Source::Plain(
                client(&target.nodes[0], &target.tls_ca)
                    .map_err(|e| LockError::config(format!("bad Redis URL `{shown_url}`: {e}")))?,
            )),
        };
        let conns = Connections::open(&target, timeout).await.map_err(fail)?;
        let source = match (source, conns.followed()) {
            (Some(source), _) => source,
            (None, Some(followed)) => Source::Followed(followed.clone()),
            (None, None) => unreachable!("a Sentinel URL opens a followed primary"),
        };
        let acks = match target.replicas {
            Some(replicas) => Some(
                ReplicaAcks::open(&target, replicas, timeout)
                    .await
                    .map_err(fail)?,
            ),
            None => None,
        };
        let mut backend = RedisBackend {
            conns,
            listener: Listener::start(source, timeout),
            shown_url,
            timeout,
            acks,
            fencing: target.fencing,
            set_nx_get: true,
            marked: Mutex::new(HashSet::new()),
            marks: AtomicUsize::new(0),
        };
        // One round trip now: a wrong password or a missing ACL permission is
        // an error of `connect`, not of the first lock.
        backend.ping().await.map_err(|e| LockError::Backend {
            backend: "redis",
            source: e,
        })?;
        backend.set_nx_get = backend.check_version().await?;
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
        self.conns.send(|conn| call(conn, invocation)).await
    }

    /// One attempt: the lease, or how long the holder's lease has left. A
    /// transient failure (the server down, restarting, or too slow) is
    /// [`Attempt::Unavailable`]: the wait loop tries again while `wait` lasts.
    /// With `?replicas=N`, so is a grant too few replicas acknowledged
    /// (undone first).
    async fn try_once(&self, request: &AcquireRequest) -> Result<Attempt, BackendError> {
        let keys = Keys::new(&request.key);
        if request.mode != HoldMode::Exclusive || self.is_marked(&request.key, &request.owner) {
            return self.try_held(request, keys).await;
        }
        let fenced = self.fencing && request.fencing;
        if !fenced && self.set_nx_get {
            return self.try_unfenced(request, keys).await;
        }
        let fence = fence_key(self.conns.is_cluster(), &keys.lock);
        let mut invocation = ACQUIRE.key(&keys.lock);
        invocation
            .key(fence.as_ref())
            .arg(&request.owner)
            .arg(millis(request.lease))
            .arg(request.holder.encode());
        let answer: Result<(i64, i64), BackendError> = match &self.acks {
            None => self.invoke(&invocation).await,
            Some(acks) => acks.call(&invocation).await,
        };
        let (taken, value) = match answer {
            Ok(answer) => answer,
            Err(error) if is_wrong_type(&error) => return self.try_held(request, keys).await,
            Err(error) => return unanswered(error),
        };
        if taken == 1 {
            if let Some(unacknowledged) = self.unacknowledged(&keys, &request.owner, None).await {
                return Ok(unacknowledged);
            }
            let token = fenced.then(|| FencingToken::new(value as u64));
            Ok(Attempt::Held(
                Lease::new(request, token).with_extra(Arc::new(keys)),
            ))
        } else {
            // -1: no expiry (never set by dlock), -2: gone since; look again soon.
            Ok(Attempt::Busy {
                retry_in: Some(Duration::from_millis(value.max(1) as u64)),
            })
        }
    }

    /// One unfenced attempt: `SET lock owner NX PX lease GET` and `PTTL lock`
    /// in one pipeline (one round trip, no script). The `SET` answers nil when
    /// it took the key, else the holder: ours only for a retry of an attempt
    /// that did reach the server, then extended from now (owner-checked, one
    /// more round trip) as the acquire script does. Otherwise the `PTTL` is
    /// the holder's remaining lease, the wait loop's next look.
    async fn try_unfenced(
        &self,
        request: &AcquireRequest,
        keys: Keys,
    ) -> Result<Attempt, BackendError> {
        let mut pipe = redis::pipe();
        pipe.cmd("SET")
            .arg(&keys.lock)
            .arg(admin::unfenced_value(&request.owner, &request.holder))
            .arg("NX")
            .arg("PX")
            .arg(millis(request.lease))
            .arg("GET")
            .cmd("PTTL")
            .arg(&keys.lock);
        let query = |mut conn: Conn| {
            let pipe = &pipe;
            async move { pipe.query_async::<(Option<String>, i64)>(&mut conn).await }
        };
        let answer = match &self.acks {
            None => self.conns.send(query).await,
            Some(acks) => acks.send(query).await,
        };
        let (holder, ttl) = match answer {
            Ok(answer) => answer,
            Err(error) if is_wrong_type(&error) => return self.try_held(request, keys).await,
            Err(error) => return unanswered(error),
        };
        let taken = match holder {
            None => true,
            Some(holder) if admin::owned_by(&holder, &request.owner) => {
                match self
                    .renew_one_keys(&keys, &request.owner, request.lease)
                    .await
                {
                    Ok(Renewal::Renewed) => true,
                    // Our own key ran out before the extension reached the
                    // server: nobody holds it now, so look again at once
                    // rather than after its stale TTL.
                    Ok(_) => {
                        return Ok(Attempt::Busy {
                            retry_in: Some(Duration::ZERO),
                        });
                    }
                    Err(error) => return unanswered(error),
                }
            }
            Some(_) => false,
        };
        if !taken {
            // -1: no expiry (never set by dlock), -2: gone since; look again soon.
            return Ok(Attempt::Busy {
                retry_in: Some(Duration::from_millis(ttl.max(1) as u64)),
            });
        }
        if let Some(unacknowledged) = self.unacknowledged(&keys, &request.owner, None).await {
            return Ok(unacknowledged);
        }
        Ok(Attempt::Held(
            Lease::new(request, None).with_extra(Arc::new(keys)),
        ))
    }

    /// Several keys in one step ([`LockBackend::try_acquire_all`]): one
    /// script that takes every lock or none, each lock with its own token
    /// (the single-key script's rule; dropped when unfenced). With
    /// `?replicas=N`, a grant too few replicas acknowledged is undone (every
    /// key) and answered as unavailable, as for one key.
    async fn try_all_once(&self, requests: &[AcquireRequest]) -> Result<AttemptAll, BackendError> {
        let Some(first) = requests.first() else {
            return Ok(AttemptAll::Held(Vec::new()));
        };
        let keys: Vec<Keys> = requests.iter().map(|r| Keys::new(&r.key)).collect();
        let fenced = self.fencing && first.fencing;
        let fence = fence_key(self.conns.is_cluster(), &keys[0].lock);
        let mut invocation = ACQUIRE_ALL.key(&keys[0].lock);
        for k in &keys[1..] {
            invocation.key(&k.lock);
        }
        invocation
            .key(fence.as_ref())
            .arg(&first.owner)
            .arg(millis(first.lease))
            .arg(first.holder.encode());
        let answer: Result<Vec<i64>, BackendError> = match &self.acks {
            None => self.invoke(&invocation).await,
            Some(acks) => acks.call(&invocation).await,
        };
        let answer = match answer {
            Ok(answer) => answer,
            Err(error) if is_wrong_type(&error) => return self.try_all_past_held(requests).await,
            Err(error) if error.is_retryable() => {
                return Ok(AttemptAll::Unavailable {
                    error,
                    retry_in: OUTAGE_RETRY,
                });
            }
            Err(error) => return Err(error),
        };
        match answer.as_slice() {
            [1, tokens @ ..] if tokens.len() == keys.len() => {
                if let Some(acks) = &self.acks
                    && let Err(error) = acks.acknowledged(&keys[0].lock).await
                {
                    for k in &keys {
                        let _ = self.release_keys(k, &first.owner, None).await;
                    }
                    return Ok(AttemptAll::Unavailable {
                        error,
                        retry_in: OUTAGE_RETRY,
                    });
                }
                Ok(AttemptAll::Held(
                    requests
                        .iter()
                        .zip(keys)
                        .zip(tokens)
                        .map(|((request, keys), &token)| {
                            let token = fenced.then(|| FencingToken::new(token as u64));
                            Lease::new(request, token).with_extra(Arc::new(keys))
                        })
                        .collect(),
                ))
            }
            // -1: no expiry (never set by dlock), -2: gone since; look again soon.
            &[0, busy, ttl] => Ok(AttemptAll::Busy {
                key: usize::try_from(busy - 1).unwrap_or(0),
                retry_in: Some(Duration::from_millis(ttl.max(1) as u64)),
            }),
            _ => Err(BackendError::permanent(format!(
                "redis: unexpected answer to the several-key acquire script: {answer:?}"
            ))),
        }
    }

    /// With `?replicas=N`, after a grant of `keys` to `owner`: `None` once
    /// enough replicas acknowledged it. Else the grant is undone (a failover
    /// now could lose it; owner-checked, and the waiters hear the key is free
    /// again) and the answer is the attempt's [`Attempt::Unavailable`].
    async fn unacknowledged(
        &self,
        keys: &Keys,
        owner: &str,
        field: Option<&str>,
    ) -> Option<Attempt> {
        let error = self.acks.as_ref()?.acknowledged(&keys.lock).await.err()?;
        let _ = self.release_keys(keys, owner, field).await;
        Some(Attempt::Unavailable {
            error,
            retry_in: OUTAGE_RETRY,
        })
    }

    /// One attempt through the script that knows every mode
    /// (`acquire_held.lua`): readers and permits, and a whole-key request
    /// that met them (the plain scripts' `WRONGTYPE`) or left a
    /// waiting-writer mark.
    async fn try_held(
        &self,
        request: &AcquireRequest,
        keys: Keys,
    ) -> Result<Attempt, BackendError> {
        let fenced = self.fencing && request.fencing;
        let fence = fence_key(self.conns.is_cluster(), &keys.lock);
        let script = if self.conns.is_cluster() {
            &*ACQUIRE_HELD_SHARDED
        } else {
            &*ACQUIRE_HELD
        };
        let mut invocation = script.key(&keys.lock);
        invocation
            .key(fence.as_ref())
            .key(&keys.mark)
            .arg(&request.owner)
            .arg(millis(request.lease))
            .arg(request.holder.encode())
            .arg(mode_arg(request.mode))
            .arg(&keys.channel);
        let answer: Result<Vec<redis::Value>, BackendError> = match &self.acks {
            None => self.invoke(&invocation).await,
            Some(acks) => acks.call(&invocation).await,
        };
        let answer = match answer {
            Ok(answer) => answer,
            Err(error) => return unanswered(error),
        };
        let exclusive = request.mode == HoldMode::Exclusive;
        match answer.as_slice() {
            [
                redis::Value::Int(1),
                redis::Value::Int(token),
                redis::Value::Int(slot),
            ] => {
                if exclusive {
                    self.unmark(&request.key, &request.owner);
                }
                let slot = u32::try_from(*slot).ok();
                let field = held_field(request.mode, &request.owner, slot);
                if let Some(unacknowledged) = self
                    .unacknowledged(&keys, &request.owner, field.as_deref())
                    .await
                {
                    return Ok(unacknowledged);
                }
                let token = fenced.then(|| FencingToken::new(*token as u64));
                let mut lease = Lease::new(request, token).with_extra(Arc::new(keys));
                if let Some(slot) = slot {
                    lease = lease.with_slot(slot);
                }
                Ok(Attempt::Held(lease))
            }
            [redis::Value::Int(0), redis::Value::Int(ms)] => {
                if exclusive {
                    self.mark(&request.key, &request.owner);
                }
                // -1: no expiry (never set by dlock), -2: gone since; look again soon.
                Ok(Attempt::Busy {
                    retry_in: Some(Duration::from_millis((*ms).max(1) as u64)),
                })
            }
            [redis::Value::Int(2), held] => {
                let held: String = redis::from_redis_value(held.clone()).map_err(|e| {
                    BackendError::permanent(format!("redis: unexpected answer: {e}"))
                })?;
                Err(BackendError::config(HoldMode::mismatch(
                    &request.key,
                    held_mode(&held),
                    request.mode,
                )))
            }
            _ => Err(BackendError::permanent(format!(
                "redis: unexpected answer to the acquire script: {answer:?}"
            ))),
        }
    }

    /// The several-key script met readers or permits on one of the keys
    /// (`WRONGTYPE`): that key's own attempt answers (busy and marked, or
    /// the mismatch), as the waiting point of the whole set.
    async fn try_all_past_held(
        &self,
        requests: &[AcquireRequest],
    ) -> Result<AttemptAll, BackendError> {
        for (index, request) in requests.iter().enumerate() {
            let keys = Keys::new(&request.key);
            if !self.read_is_hash(&keys.lock).await? {
                continue;
            }
            return Ok(match self.try_held(request, keys).await? {
                Attempt::Held(lease) => {
                    // Its readers left meanwhile: give it back, take the set again.
                    self.release(&lease).await?;
                    AttemptAll::Busy {
                        key: index,
                        retry_in: Some(Duration::ZERO),
                    }
                }
                Attempt::Busy { retry_in } => AttemptAll::Busy {
                    key: index,
                    retry_in,
                },
                Attempt::Unavailable { error, retry_in } => {
                    AttemptAll::Unavailable { error, retry_in }
                }
            });
        }
        Ok(AttemptAll::Busy {
            key: 0,
            retry_in: Some(Duration::ZERO),
        })
    }

    /// Whether `owner`'s whole-key request of `key` may have left a mark
    /// (no allocation while no request has).
    fn is_marked(&self, key: &str, owner: &str) -> bool {
        if self.marks.load(Ordering::SeqCst) == 0 {
            return false;
        }
        let marked = self.marked.lock().unwrap_or_else(|e| e.into_inner());
        marked.contains(&(key.to_owned(), owner.to_owned()))
    }

    fn mark(&self, key: &str, owner: &str) {
        let mut marked = self.marked.lock().unwrap_or_else(|e| e.into_inner());
        marked.insert((key.to_owned(), owner.to_owned()));
        self.marks.store(marked.len(), Ordering::SeqCst);
    }

    /// Forgets the mark of `owner` on `key`; answers whether it had one.
    fn unmark(&self, key: &str, owner: &str) -> bool {
        if self.marks.load(Ordering::SeqCst) == 0 {
            return false;
        }
        let mut marked = self.marked.lock().unwrap_or_else(|e| e.into_inner());
        let had = marked.remove(&(key.to_owned(), owner.to_owned()));
        self.marks.store(marked.len(), Ordering::SeqCst);
        had
    }

    /// The renewal script for `lease`: the whole key's, or its reader's or
    /// permit's field.
    fn renew_invocation(lease: &Lease, ttl: Duration) -> redis::ScriptInvocation<'static> {
        let keys = Keys::of(lease);
        let mark = admin::revocation_mark(&keys.lock);
        match held_field(lease.mode, &lease.owner, lease.slot) {
            None => {
                let mut invocation = RENEW.key(&keys.lock);
                invocation.key(mark).arg(&lease.owner).arg(millis(ttl));
                invocation
            }
            Some(field) => {
                let mut invocation = RENEW_HELD.key(&keys.lock);
                invocation
                    .key(mark)
                    .arg(&lease.owner)
                    .arg(millis(ttl))
                    .arg(field);
                invocation
            }
        }
    }

    /// Refuses a server older than 6.2: the acquire script reads and writes
    /// the fence counter with one `SET … GET`. An ACL user without `INFO` is
    /// not checked (the first acquisition would then fail with Redis's own
    /// syntax error). Answers whether the server takes `SET … NX GET` (7.0):
    /// assumed when it cannot tell.
    async fn check_version(&self) -> Result<bool, LockError> {
        let Conn::Single(mut conn) = self.conns.home() else {
            // Redis Cluster needs 7.0 for SPUBLISH anyway (see the docs).
            return Ok(true);
        };
        let Ok(info) = redis::cmd("INFO")
            .arg("server")
            .query_async::<String>(&mut conn)
            .await
        else {
            return Ok(true);
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
        Ok(version.is_empty() || major >= 7)
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
        let invocation = Self::renew_invocation(lease, ttl);
        let extended: i64 = self
            .conns
            .send_confirmed(|conn| call(conn, &invocation))
            .await?;
        Ok(renewal(extended))
    }

    async fn renew_one_keys(
        &self,
        keys: &Keys,
        owner: &str,
        ttl: Duration,
    ) -> Result<Renewal, BackendError> {
        let mut invocation = RENEW.key(&keys.lock);
        invocation
            .key(admin::revocation_mark(&keys.lock))
            .arg(owner)
            .arg(millis(ttl));
        let extended: i64 = self
            .conns
            .send_confirmed(|conn| call(conn, &invocation))
            .await?;
        Ok(renewal(extended))
    }

    /// The release script for `keys`: `SPUBLISH` on a cluster. `field`: the
    /// reader's or permit's field (empty: whatever the owner holds, and its
    /// waiting-writer mark), `None` for the whole key alone.
    fn release_invocation(
        &self,
        keys: &Keys,
        owner: &str,
        field: Option<&str>,
    ) -> redis::ScriptInvocation<'static> {
        let cluster = self.conns.is_cluster();
        let Some(field) = field else {
            let script = if cluster {
                &*RELEASE_SHARDED
            } else {
                &*RELEASE
            };
            let mut invocation = script.key(&keys.lock);
            invocation.arg(owner).arg(&keys.channel);
            return invocation;
        };
        let script = if cluster {
            &*RELEASE_HELD_SHARDED
        } else {
            &*RELEASE_HELD
        };
        let mut invocation = script.key(&keys.lock);
        invocation
            .key(&keys.mark)
            .arg(owner)
            .arg(&keys.channel)
            .arg(field);
        invocation
    }

    /// Owner-checked release over the usual route.
    async fn release_keys(
        &self,
        keys: &Keys,
        owner: &str,
        field: Option<&str>,
    ) -> Result<i64, BackendError> {
        self.invoke(&self.release_invocation(keys, owner, field))
            .await
    }
}

/// An attempt that failed: [`Attempt::Unavailable`] when the failure is
/// transient (the wait loop tries again while `wait` lasts), else the error.
fn unanswered(error: BackendError) -> Result<Attempt, BackendError> {
    if error.is_retryable() {
        Ok(Attempt::Unavailable {
            error,
            retry_in: OUTAGE_RETRY,
        })
    } else {
        Err(error)
    }
}

/// The acquire script's name for `mode`: `x`, `r`, or the number of permits.
fn mode_arg(mode: HoldMode) -> String {
    match mode {
        HoldMode::Exclusive => "x".to_owned(),
        HoldMode::Shared => "r".to_owned(),
        HoldMode::Permit { permits } => permits.to_string(),
    }
}

/// The mode the acquire script names (see [`mode_arg`]).
fn held_mode(held: &str) -> HoldMode {
    match held {
        "r" => HoldMode::Shared,
        _ => match held.parse::<u32>() {
            Ok(permits) if permits > 1 => HoldMode::Permit { permits },
            _ => HoldMode::Exclusive,
        },
    }
}

/// The field of a reader's or permit's hold in its key's hash
/// (`acquire_held.lua`), `None` for the whole key; a permit without a slot
/// (the undo of an abandoned attempt) is the empty field: whatever the
/// owner holds.
fn held_field(mode: HoldMode, owner: &str, slot: Option<u32>) -> Option<String> {
    match mode {
        HoldMode::Exclusive => None,
        HoldMode::Shared => Some(format!("r:{owner}")),
        HoldMode::Permit { .. } => Some(slot.map(|s| s.to_string()).unwrap_or_default()),
    }
}

fn renewal(extended: i64) -> Renewal {
    match extended {
        1 => Renewal::Renewed,
        2 => Renewal::Revoked,
        _ => Renewal::Lost,
    }
}

impl LockBackend for RedisBackend {
    fn kind(&self) -> &'static str {
        "redis"
    }

    fn offers(&self, _mode: HoldMode) -> Result<(), String> {
        // Every mode, on one server, Sentinel and Cluster (see the module docs).
        Ok(())
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

    fn try_acquire_all<'a>(
        &'a self,
        requests: &'a [AcquireRequest],
    ) -> Option<BoxFuture<'a, Result<AttemptAll, BackendError>>> {
        if self.conns.is_cluster() {
            // One script touches one slot: keys in several go one by one.
            let slot = |r: &AcquireRequest| slots::key_slot(Keys::new(&r.key).lock.as_bytes());
            let first = slot(requests.first()?);
            if requests.iter().any(|r| slot(r) != first) {
                return None;
            }
        }
        Some(Box::pin(self.try_all_once(requests)))
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

    fn abandon<'a>(&'a self, request: &'a AcquireRequest) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            if request.mode == HoldMode::Exclusive && self.unmark(&request.key, &request.owner) {
                // A writer that waited behind readers: its mark goes (owner-checked).
                let keys = Keys::new(&request.key);
                let _ = self.release_keys(&keys, &request.owner, Some("")).await;
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
            if self.conns.is_cluster() {
                // A cluster routes each key to its node; the commands still
                // share each node's connection.
                return futures_util::future::join_all(
                    batch.iter().map(|(lease, ttl)| self.renew_one(lease, *ttl)),
                )
                .await;
            }
            let mut pipe = redis::pipe();
            pipe.load_script(&RENEW).ignore();
            if batch
                .iter()
                .any(|(lease, _)| lease.mode != HoldMode::Exclusive)
            {
                pipe.load_script(&RENEW_HELD).ignore();
            }
            for (lease, ttl) in batch {
                pipe.invoke_script(&Self::renew_invocation(lease, *ttl));
            }
            let pipe = &pipe;
            let answer = self
                .conns
                .send_confirmed(
                    |mut conn| async move { pipe.query_async::<Vec<i64>>(&mut conn).await },
                )
                .await;
            match answer {
                Ok(answers) if answers.len() == batch.len() => answers
                    .into_iter()
                    .map(|extended| Ok(renewal(extended)))
                    .collect(),
                Ok(_) => batch
                    .iter()
                    .map(|_| Err(BackendError::permanent("redis: short pipeline answer")))
                    .collect(),
                Err(err) => {
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
            let mut field = held_field(lease.mode, &lease.owner, lease.slot);
            if field.is_none() && (self.unmark(&lease.key, &lease.owner) || lease.extra.is_none()) {
                // A writer that waited behind readers, or the undo of an
                // abandoned attempt (whose last script may have left a mark
                // unanswered): its mark goes too.
                field = Some(String::new());
            }
            let invocation = self.release_invocation(&keys, &lease.owner, field.as_deref());
            let routed: Result<i64, BackendError> = self.invoke(&invocation).await;
            if lease.extra.is_some() && !lease.after_unanswered {
                routed?;
                return Ok(());
            }
            // The release of an acquisition dropped on the wire (a grant
            // always keeps its `Keys`), or of a grant that came after an
            // unanswered attempt: a command of it may have gone over another
            // connection (the local one opened, or went, in between; the
            // grants' own with `replicas`) and still be on its way, able to
            // take the key again after this release. So release over those
            // too, whatever the first answered — on each, the release then
            // follows that command. Any one succeeding is enough.
            let home: Result<i64, RedisError> = call(self.conns.home(), &invocation).await;
            let acks: Option<Result<i64, RedisError>> = match &self.acks {
                Some(acks) => Some(call(acks.home(), &invocation).await),
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

    fn inspect<'a>(
        &'a self,
        key: &'a str,
    ) -> BoxFuture<'a, Result<Option<KeyEntry>, BackendError>> {
        Box::pin(self.inspect_key(key))
    }

    fn list<'a>(
        &'a self,
        prefix: &'a str,
        limit: usize,
    ) -> BoxFuture<'a, Result<Vec<KeyEntry>, BackendError>> {
        Box::pin(self.list_keys(prefix, limit))
    }

    fn revoke<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<Vec<HeldEntry>, BackendError>> {
        Box::pin(self.revoke_key(key))
    }
}
