//! Redlock over several independent Redis masters (`redlock://h1:p1,h2:p2,…`).
//!
//! The published algorithm (<https://redis.io/docs/latest/develop/use/patterns/distributed-locks/>):
//!
//! - **acquire**: `SET key owner NX PX lease` on every node at once, each call
//!   bounded by a per-node timeout far below the lease (the URL's `timeout`,
//!   at most a tenth of the lease). The lock is ours only if a majority
//!   (`N/2 + 1`) said yes and the validity `lease − elapsed − drift` (drift =
//!   1% of the lease + 2 ms) is still positive; the lease's local end is then
//!   `start + lease − drift`. Otherwise the attempt is undone on **every** node
//!   (a node that timed out may have said yes) and retried after a random
//!   back-off (or when the holder's majority runs out), so that clients that
//!   split the votes between them do not split them again.
//! - **quiet roll-back**: undoing a failed attempt is an owner-checked `DEL`
//!   *without* a release message. The key was never ours, so nobody is owed a
//!   wake-up: were the roll-back to `PUBLISH`, every waiter would wake, fail
//!   against the holder's majority, roll back and wake the others again — a
//!   storm that lasts as long as the holder keeps its majority.
//! - **renew**: owner-checked `PEXPIRE` on every node; the renewal counts only
//!   with a majority. The watchdog's batches go out as one pipeline per node.
//! - **release**: owner-checked delete on every node, which also `PUBLISH`es on
//!   the key's release channel.
//! - **revoke** (`Registry::revoke`): on every node, one script deletes the
//!   majority holder's copy only if it is still there and leaves a
//!   short-lived mark naming the holder; only the revocation that deleted
//!   the copies on a majority reports the holder, so two revocations at once
//!   report it once. The holder's renewal is answered "revoked" — its loss
//!   reported with [`LossReason::Revoked`](crate::LossReason::Revoked) —
//!   when it fails and a majority of the nodes carry the mark; an expiry, a
//!   release or a takeover leaves no mark and is reported as the key gone.
//!   See `admin.rs` for the rules, and what a split between two revocations
//!   does.
//!
//! Waiters subscribe to the release channel on every node (any one message
//! wakes them) and also try again when the holders' TTL runs out.
//!
//! **No fencing token.** A token must grow strictly with every grant, but the
//! nodes are independent: a counter on each would disagree after a node
//! restarts or misses a grant, and no majority of counters orders two grants
//! safely. [`Lease::token`] is therefore `None`, and
//! [`CurrentLock::fencing_token`](crate::CurrentLock::fencing_token) returns
//! `None` on this backend: use `redis://` or a SQL or ZooKeeper backend when
//! the protected resource must reject stale writers.
//!
//! URLs: `redlock://[user:pass@]h1:p1,h2:p2,h3:p3[/db]` (`redlocks://` for TLS,
//! `?tls_ca=/path/ca.pem` to trust a private CA); at least three nodes.
//! Option `timeout` (default 200 ms) bounds each node's answer.
//!
//! **Connections.** Each node has a *home* connection on dlock's I/O runtime,
//! opened by a connection task started with the backend: it connects, and
//! while the node has never answered it tries again with a capped exponential
//! back-off (100 ms doubling up to 2 s, with jitter). Once open, the node's
//! managed connection reconnects by itself and the task ends; it also ends
//! when the backend is dropped. Calls never wait for a connection: a node
//! whose home connection is not open fails its vote at once with a transient
//! "node N is down (reconnecting)" error, however many calls are made, and
//! counts again once its task has connected. `connect` waits for each node's
//! first attempt (within the timeout) and needs a majority of the nodes to
//! answer.
//!
//! Once a node's home connection is open, each node also gets a *local*
//! connection on the application's runtime, as `redis://` does (see
//! `connections.rs`): opened in the background by the first call from that
//! runtime, used only by calls from there, so that they reach the socket
//! without a hop between runtimes; until it is ready (and for calls from any
//! other runtime, and the watchdog's renewals, which run on dlock's I/O
//! runtime) commands go home. A command whose local connection died under it
//! (its runtime shut down) is sent once more over home, within the same
//! per-node timeout: every script here is idempotent for its owner (an
//! acquire that finds its owner's own vote grants it again).
//!
//! Which connection carried a command matters only while its answer is
//! outstanding: a command sent later on the other connection may overtake it.
//! So an attempt's roll-back goes over the very connection its acquire went
//! over, node by node (home if that local one died), and only to the nodes
//! the acquire was sent to. A lease that Redlock granted is marked (in
//! [`Lease::extra`]) with the connections of the nodes whose acquire had not
//! answered in time (a minority, still possibly on the wire): its release
//! goes over whichever connection is at hand and, on those nodes, over the
//! acquire's connection too, so it cannot overtake a late `SET`. A release
//! without the mark is the
//! runtime's clean-up after an abandoned acquisition (its answer never came):
//! when it goes over a local connection it is also sent over home, since the
//! abandoned acquire may have gone there (the local connection opened in
//! between). On each connection the owner-checked delete then follows the
//! acquire it undoes; a delete that finds nothing is harmless.

mod admin;
mod node;

use std::any::Any;
use std::fmt;
use std::sync::{Arc, LazyLock};
use std::time::{Duration, Instant};

use futures_util::future::{BoxFuture, join_all};
use rand::Rng;
use redis::Script;

use node::{Node, node_timeout_error};

use super::conn::{client, install_crypto_provider};
use super::connections::Route;
use super::scripts::{RELEASE, RENEW, millis, redis_error};
use super::url::{Topology, parse_url};
use crate::backend::{
    AcquireRequest, Attempt, HeldEntry, HoldMode, KeyEntry, Lease, LockBackend, Renewal, WakeSource,
};
use crate::error::{BackendError, LockError, redact_url};

/// `KEYS[1]` lock; `ARGV[1]` owner, `ARGV[2]` lease (ms), `ARGV[3]` the
/// value to store (the owner, a newline, the holder's record).
/// Answers `{1, 0}` or `{0, holder's remaining ms}`. Sent twice for one owner
/// (resent home, or a vote an earlier attempt of the same acquisition left
/// behind), it grants again from now: the vote is ours.
static ACQUIRE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
if redis.call('SET', KEYS[1], ARGV[3], 'NX', 'PX', ARGV[2]) then
  return {1, 0}
end
local held = redis.call('GET', KEYS[1])
if held == ARGV[1] or (held and string.sub(held, 1, #ARGV[1] + 1) == ARGV[1] .. '\n') then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return {1, 0}
end
return {0, redis.call('PTTL', KEYS[1])}
",
    )
});

/// `KEYS[1]` lock; `ARGV[1]` owner. Owner-checked delete **without** a
/// release message: undoing a failed attempt's minority grants must not wake
/// the waiters (they would fail again against the holder's majority, undo,
/// and wake each other in a storm).
static ROLLBACK: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local held = redis.call('GET', KEYS[1])
if held == ARGV[1] or (held and string.sub(held, 1, #ARGV[1] + 1) == ARGV[1] .. '\n') then
  return redis.call('DEL', KEYS[1])
end
return 0
",
    )
});

/// Kept with every lease Redlock grants ([`Lease::extra`]): a release
/// without it is the clean-up of an abandoned acquisition. See the
/// [module docs](self).
struct Granted {
    /// Per node: the route of an acquire that was NOT answered.
    late: Vec<Option<Route>>,
}

fn was_granted(lease: &Lease) -> Option<&Granted> {
    lease
        .extra
        .as_ref()
        .and_then(|extra| extra.downcast_ref::<Granted>())
}

/// The default bound on one node's answer (the URL's `timeout` overrides it).
const DEFAULT_NODE_TIMEOUT: Duration = Duration::from_millis(200);
/// The floor of the per-node timeout for very short leases.
const MIN_NODE_TIMEOUT: Duration = Duration::from_millis(10);
/// The range of the random back-off after an attempt that did not reach a majority.
const BACKOFF: std::ops::RangeInclusive<u64> = 5..=50;
/// The Redlock backend. See the [module docs](self).
pub struct RedlockBackend {
    nodes: Vec<Node>,
    quorum: usize,
    timeout: Duration,
    shown_url: String,
}

impl fmt::Debug for RedlockBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedlockBackend")
            .field("url", &self.shown_url)
            .field("nodes", &self.nodes.len())
            .field("quorum", &self.quorum)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl RedlockBackend {
    /// Connects to the masters a `redlock://` URL names. See the [module docs](self).
    pub async fn connect(url: &str) -> Result<Self, LockError> {
        let shown_url = redact_url(url);
        let target = parse_url(url)?;
        if target.topology != Topology::Redlock {
            return Err(LockError::config(format!(
                "`{shown_url}` is not a Redlock URL (redlock://h1:p1,h2:p2,h3:p3)"
            )));
        }
        if target.nodes.len() < 3 {
            return Err(LockError::config(format!(
                "`{shown_url}` names {} node(s); Redlock needs at least 3 independent masters \
                 (use redis:// for one server)",
                target.nodes.len()
            )));
        }
        if target.nodes.iter().any(|n| n.starts_with("rediss")) {
            install_crypto_provider();
        }
        // `timeout` defaults lower than for one server: a slow node only costs
        // its vote.
        let timeout = target.timeout.unwrap_or(DEFAULT_NODE_TIMEOUT);
        let clients = target
            .nodes
            .iter()
            .map(|node| client(node, &target.tls_ca))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| LockError::config(format!("bad Redlock URL `{shown_url}`: {e}")))?;
        let nodes: Vec<Node> = clients
            .into_iter()
            .enumerate()
            .map(|(i, client)| Node::start(i + 1, client, timeout))
            .collect();
        let backend = RedlockBackend {
            quorum: nodes.len() / 2 + 1,
            nodes,
            timeout,
            shown_url,
        };
        // A wrong password, a missing ACL permission or too few live nodes is
        // an error of `connect`, not of the first lock. Each node's first
        // connection attempt is waited for here (within the timeout), never
        // again afterwards.
        let pings = join_all(backend.nodes.iter().map(|node| async move {
            tokio::time::timeout(timeout, async {
                node.first_attempt().await;
                let mut conn = node.home()?;
                redis::cmd("PING")
                    .query_async::<String>(&mut conn)
                    .await
                    .map_err(redis_error)
            })
            .await
            .unwrap_or_else(|_| Err(node_timeout_error(timeout)))
        }))
        .await;
        let answered = pings.iter().filter(|p| p.is_ok()).count();
        if answered < backend.quorum {
            let why = pings
                .into_iter()
                .find_map(Result::err)
                .map(|e| e.to_string())
                .unwrap_or_default();
            return Err(LockError::Backend {
                backend: "redlock",
                source: BackendError::transient(format!(
                    "cannot connect to {}: only {answered} of {} nodes answered, {} needed ({why})",
                    backend.shown_url,
                    backend.nodes.len(),
                    backend.quorum
                )),
            });
        }
        Ok(backend)
    }

    /// The bound on one node's answer for a lease this long.
    fn node_timeout(&self, lease: Duration) -> Duration {
        self.timeout.min((lease / 10).max(MIN_NODE_TIMEOUT))
    }

    fn drift(lease: Duration) -> Duration {
        lease / 100 + Duration::from_millis(2)
    }

    async fn attempt(&self, request: &AcquireRequest) -> Attempt {
        let timeout = self.node_timeout(request.lease);
        let started = Instant::now();
        let mut acquire = ACQUIRE.key(&request.key);
        acquire
            .arg(&request.owner)
            .arg(millis(request.lease))
            .arg(super::admin::unfenced_value(
                &request.owner,
                &request.holder,
            ));
        let acquire = &acquire;
        // Each node's route is chosen once: a roll-back follows its acquire
        // over the same connection.
        type Answer = Result<(i64, i64), BackendError>;
        let (routes, answers): (Vec<Option<Route>>, Vec<Answer>) =
            join_all(self.nodes.iter().map(|node| async move {
                match node.route() {
                    Ok(route) => {
                        let answer = node.invoke(&route, acquire, timeout).await;
                        (Some(route), answer)
                    }
                    Err(down) => (None, Err(down)),
                }
            }))
            .await
            .into_iter()
            .unzip();
        let granted = answers.iter().filter(|a| matches!(a, Ok((1, _)))).count();
        let validity = request
            .lease
            .checked_sub(started.elapsed() + Self::drift(request.lease));
        if granted >= self.quorum && validity.is_some_and(|v| !v.is_zero()) {
            let late = routes
                .into_iter()
                .zip(&answers)
                .map(|(route, answer)| if answer.is_err() { route } else { None })
                .collect();
            return Attempt::Held(
                Lease::new(request, None)
                    .with_extra(Arc::new(Granted { late }) as Arc<dyn Any + Send + Sync>),
            );
        }
        if granted > 0 || answers.iter().any(Result::is_err) {
            // A node that timed out may have granted: undo wherever the
            // acquire went, quietly.
            self.roll_back(&routes, &request.key, &request.owner, timeout)
                .await;
        }
        let mut answered = 0;
        let mut last_error = None;
        let mut left: Vec<Duration> = Vec::new();
        for answer in answers {
            match answer {
                Ok((taken, ttl)) => {
                    answered += 1;
                    if taken == 0 && ttl > 0 {
                        left.push(Duration::from_millis(ttl as u64));
                    }
                }
                Err(err) => last_error = Some(err),
            }
        }
        let backoff = Duration::from_millis(rand::rng().random_range(BACKOFF));
        if answered < self.quorum {
            let why = last_error.map(|e| e.to_string()).unwrap_or_default();
            return Attempt::Unavailable {
                error: BackendError::transient(format!(
                    "redlock: only {answered} of {} nodes answered, {} needed ({why})",
                    self.nodes.len(),
                    self.quorum
                )),
                retry_in: backoff,
            };
        }
        // The holder keeps its majority until all but a minority of its
        // copies have expired: then it is worth trying again. A split vote
        // (no holder with a majority): a random back-off.
        left.sort_unstable();
        let holders_left = (left.len() >= self.quorum).then(|| left[left.len() - self.quorum]);
        Attempt::Busy {
            retry_in: Some(holders_left.unwrap_or(backoff)),
        }
    }

    /// Owner-checked delete without a release message (undoing a failed
    /// attempt) on every node the attempt's acquire was sent to, over the
    /// connection it went over (`routes`, one per node).
    async fn roll_back(&self, routes: &[Option<Route>], key: &str, owner: &str, timeout: Duration) {
        let mut rollback = ROLLBACK.key(key);
        rollback.arg(owner);
        let rollback = &rollback;
        join_all(
            self.nodes
                .iter()
                .zip(routes)
                .filter_map(|(node, route)| Some((node, route.as_ref()?)))
                .map(|(node, route)| node.invoke::<i64>(route, rollback, timeout)),
        )
        .await;
    }

    /// Owner-checked delete (and release message) on every node; answers how
    /// many nodes answered. `granted`: the lease's acquire was answered (else
    /// the delete also goes over home where the route is a local connection,
    /// see the [module docs](self)).
    async fn release_everywhere(
        &self,
        key: &str,
        owner: &str,
        granted: Option<&Granted>,
        timeout: Duration,
    ) -> usize {
        let mut release = RELEASE.key(key);
        release.arg(owner).arg(format!("{key}:released"));
        let release = &release;
        join_all(self.nodes.iter().enumerate().map(|(i, node)| async move {
            let route = node.route()?;
            let routed = node.invoke::<i64>(&route, release, timeout).await;
            if let Some(granted) = granted {
                if let Some(Some(late)) = granted.late.get(i) {
                    let behind = node.invoke::<i64>(late, release, timeout).await;
                    return routed.or(behind);
                }
                return routed;
            }
            if !route.is_local() {
                return routed;
            }
            let home = node
                .invoke::<i64>(&Route::home(node.home()?), release, timeout)
                .await;
            routed.or(home)
        }))
        .await
        .iter()
        .filter(|answer| answer.is_ok())
        .count()
    }
}

impl LockBackend for RedlockBackend {
    fn kind(&self) -> &'static str {
        "redlock"
    }

    fn offers(&self, mode: HoldMode) -> Result<(), String> {
        match mode {
            HoldMode::Exclusive => Ok(()),
            other => Err(format!(
                "Redlock does not offer {other}: each node counts holders on its own, so \
                 grants taken on different majorities are never all counted on one node (3 \
                 nodes, 2 permits: holders on nodes 1+2, 2+3 and 1+3 each see 2 per node, and \
                 3 hold at once); readers and waiting writers' marks split the same way. Use a \
                 single Redis, Redis Sentinel or Cluster for semaphores and read-write locks; \
                 plain locks (the write mode) and several keys work here"
            )),
        }
    }

    fn try_acquire<'a>(
        &'a self,
        request: &'a AcquireRequest,
    ) -> BoxFuture<'a, Result<Attempt, BackendError>> {
        Box::pin(async move { Ok(self.attempt(request).await) })
    }

    fn wake_source<'a>(&'a self, request: &'a AcquireRequest) -> BoxFuture<'a, WakeSource> {
        let key = &request.key;
        // Subscribed on every node that answers in time; any one message wakes.
        Box::pin(async move {
            let channel = format!("{key}:released");
            join_all(self.nodes.iter().map(|node| {
                tokio::time::timeout(self.timeout, node.listener.join(channel.clone()))
            }))
            .await
            .into_iter()
            .filter_map(|joined| joined.ok().flatten())
            .fold(WakeSource::none(), |source, subscription| {
                source
                    .also(subscription.notify.clone())
                    .keep_alive(subscription)
            })
        })
    }

    fn drift(&self, lease: Duration) -> Duration {
        Self::drift(lease)
    }

    fn renew_all<'a>(
        &'a self,
        batch: &'a [(&'a Lease, Duration)],
    ) -> BoxFuture<'a, Vec<Result<Renewal, BackendError>>> {
        Box::pin(async move {
            let shortest = batch.iter().map(|(_, ttl)| *ttl).min().unwrap_or_default();
            let timeout = self.node_timeout(shortest);
            let started = Instant::now();
            // One pipeline per node: every lease due, one round trip.
            // The watchdog calls from dlock's I/O runtime: these go home.
            let mut pipe = redis::pipe();
            pipe.load_script(&RENEW).ignore();
            for (lease, ttl) in batch {
                pipe.invoke_script(
                    RENEW
                        .key(&lease.key)
                        .key(admin::revocation_mark(&lease.key))
                        .arg(&lease.owner)
                        .arg(millis(*ttl)),
                );
            }
            let pipe = &pipe;
            let per_node: Vec<Result<Vec<i64>, BackendError>> =
                join_all(self.nodes.iter().map(|node| async move {
                    let answers: Vec<i64> = node.query(&node.route()?, pipe, timeout).await?;
                    if answers.len() == batch.len() {
                        Ok(answers)
                    } else {
                        Err(BackendError::permanent("redlock: short pipeline answer"))
                    }
                }))
                .await;
            let elapsed = started.elapsed();
            let unanswered = per_node.iter().filter(|n| n.is_err()).count();
            batch
                .iter()
                .enumerate()
                .map(|(i, (_, ttl))| {
                    let extended = per_node
                        .iter()
                        .filter(|n| matches!(n, Ok(answers) if answers[i] == 1))
                        .count();
                    let revoked = per_node
                        .iter()
                        .filter(|n| matches!(n, Ok(answers) if answers[i] == 2))
                        .count();
                    let refused = per_node.len() - unanswered - extended;
                    let drift = Self::drift(*ttl);
                    if extended >= self.quorum && elapsed + drift < *ttl {
                        Ok(Renewal::Renewed)
                    } else if revoked >= self.quorum {
                        // A revocation deleted our copies on a majority.
                        Ok(Renewal::Revoked)
                    } else if refused > self.nodes.len() - self.quorum {
                        // A majority says the key is not ours.
                        Ok(Renewal::Lost)
                    } else {
                        Err(BackendError::transient(format!(
                            "redlock: renewal reached {extended} of {} nodes, {} needed",
                            self.nodes.len(),
                            self.quorum
                        )))
                    }
                })
                .collect()
        })
    }

    fn release<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<(), BackendError>> {
        Box::pin(async move {
            let answered = self
                .release_everywhere(&lease.key, &lease.owner, was_granted(lease), self.timeout)
                .await;
            if answered == 0 {
                // The copies expire with the lease.
                return Err(BackendError::transient(
                    "redlock: no node answered the release",
                ));
            }
            Ok(())
        })
    }

    fn needs_io_runtime(&self) -> bool {
        // The home connections' driver tasks live on dlock's I/O runtime, the
        // local ones on the caller's: calls go straight from the caller.
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

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn urls() {
        let err = RedlockBackend::connect("redlock://127.0.0.1:1,127.0.0.1:2")
            .await
            .unwrap_err();
        assert!(err.to_string().contains("at least 3"), "{err}");
        let err = RedlockBackend::connect("redis://127.0.0.1:1")
            .await
            .unwrap_err();
        assert!(err.to_string().contains("not a Redlock URL"), "{err}");
        // Nothing listens on these ports: an error naming the count, no password.
        let err = RedlockBackend::connect("redlock://:hunter2@127.0.0.1:1,127.0.0.1:2,127.0.0.1:3")
            .await
            .unwrap_err();
        let shown = err.to_string();
        assert!(shown.contains("only 0 of 3 nodes answered"), "{shown}");
        assert!(!shown.contains("hunter2"), "{shown}");
    }

    #[test]
    fn drift_and_timeouts() {
        assert_eq!(
            RedlockBackend::drift(Duration::from_secs(10)),
            Duration::from_millis(102)
        );
    }
}
