//! Redis Sentinel (`redis+sentinel://`): the primary found through its
//! sentinels, and followed across failovers. See **Redis Sentinel** in the
//! [Redis backend's docs](super).
//!
//! The sentinels are asked directly (`SENTINEL MASTER`, for the primary's
//! address and its configuration epoch, then `ROLE` on the node named), not
//! through the redis crate's `sentinel` feature: its clients resolve the
//! primary once, when a connection is made, and its `ConnectionManager` then
//! reconnects to that same address for ever (`READONLY` on every write after
//! a failover, or ≈9 s of reconnect back-off on a dead primary), and nothing
//! there listens for a failover. Here one [`Followed`] primary holds the
//! connection to the node the sentinels name now and replaces it:
//!
//! - when a command meets `READONLY` (the node was demoted), a dropped or
//!   refused connection, or a timeout ([`moves`]): the sentinels are asked
//!   again (at most once per [`MIN_RESOLVE_INTERVAL`] however many commands
//!   fail), and the command is sent once more if the primary moved;
//! - as soon as any sentinel announces a switch (`+switch-master` on each
//!   sentinel's pub/sub, each listened to by a task of its own, so a
//!   sentinel that answers nothing delays no one: the sentinels are then
//!   asked at once), and every [`POLL`] in any case, by a task of its own
//!   ([`watch()`]): after `SENTINEL
//!   FAILOVER` the old primary still accepted writes for ≈11 s (measured), so
//!   waiting for an error would leave grants and renewals on a node about to
//!   be reset.
//!
//! **Which answer.** The sentinels are asked all at once, each bounded by the
//! backend's timeout, and their answers are awaited until all came or for
//! [`SETTLE`] after the first one (a sentinel that answers nothing costs no
//! more than that, at connect too: connect takes the best answer received by
//! then). Of the answers received, the one with the highest configuration
//! epoch is followed (every failover raises it, so a sentinel on the minority
//! side of a partition, still naming the old primary, answers with an older
//! one), and never one older than the epoch already followed. A node is
//! taken only if it confirms `ROLE` master.
//!
//! **Renewals** ([`Followed::vouch`]). A renewal counts only if, after its
//! reply, the sentinels (one concurrent query per renewal batch) confirm that
//! the node which renewed is still the primary of the highest epoch known;
//! otherwise the batch is an error, and the watchdog declares the lease lost
//! at its give-up instant, before it ends on the server. So a holder that
//! reaches its primary but no sentinel (or whose primary was demoted: it
//! still accepts renewals for a while) stops counting renewals as soon as it
//! cannot be told there was no failover: it learns it lost the lock before
//! its lease could end on the new primary and the key be granted there —
//! provided the new primary had the grant and the renewals before the
//! failover (replication is asynchronous; `?replicas=N` makes the grant
//! acknowledged, not the renewals). It does not cover a grant or renewal made
//! on the old primary in the moment before any sentinel knows of the
//! failover (lost with the old primary's later writes, reported at the next
//! renewal), nor sentinels whose epochs were reset.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, Client, IntoConnectionInfo, RedisError};
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use super::conn::{Conn, Opener, client};
use super::scripts::redis_error;
use super::url::{SentinelTarget, Target};
use crate::error::BackendError;

/// How often the sentinels are asked whether the primary moved, errors or not.
const POLL: Duration = Duration::from_secs(1);
/// The shortest time between two resolutions after errors: many commands
/// failing at once ask the sentinels once.
const MIN_RESOLVE_INTERVAL: Duration = Duration::from_millis(100);
/// The longest pause between two reconnections of the primary's managed connection.
const RECONNECT_MAX: Duration = Duration::from_millis(500);
/// How long the sentinels' answers are awaited after the first one: the
/// highest epoch among those received is followed.
const SETTLE: Duration = Duration::from_millis(200);

/// Whether an error says the primary may have moved: the node was demoted
/// (`READONLY`), is a replica that lost its primary (`MASTERDOWN`), or
/// cannot be reached.
pub(super) fn moves(err: &RedisError) -> bool {
    err.is_timeout()
        || err.is_connection_dropped()
        || err.is_connection_refusal()
        || err.is_io_error()
        || matches!(err.code(), Some("READONLY" | "MASTERDOWN"))
}

/// [`redis_error`], except that `READONLY` is transient: behind Sentinel it
/// means a failover, and the next attempt goes to the new primary.
pub(super) fn sentinel_error(err: RedisError) -> BackendError {
    if err.code() == Some("READONLY") {
        BackendError::transient(err)
    } else {
        redis_error(err)
    }
}

/// The sentinels of one primary, and how to reach the data nodes they name.
struct Sentinels {
    name: String,
    /// One client per sentinel, in the URL's order, and its open connection.
    sentinels: Vec<(Client, Mutex<Option<MultiplexedConnection>>)>,
    target: SentinelTarget,
    tls_ca: Option<Vec<u8>>,
    timeout: Duration,
}

/// The primary's node, as last resolved.
pub(super) struct Current {
    /// Raised at every move.
    pub(super) generation: u64,
    /// `host:port`.
    pub(super) address: String,
    /// A client for the node (the listener subscribes with it).
    pub(super) client: Client,
    /// The managed connection to it (it reconnects to the same address).
    pub(super) conn: Conn,
}

/// What one sentinel named.
struct Named {
    /// Which sentinel: its number in the URL and its address.
    sentinel: String,
    host: String,
    port: u16,
    /// The configuration epoch of the sentinel's answer: raised by every
    /// failover, so the highest names the latest primary.
    epoch: u64,
}

impl Named {
    fn address(&self) -> String {
        format!("{}:{}", self.host, self.port)
    }
}

/// What asking the sentinels found.
enum Resolved {
    /// The answer of the highest epoch still names the node we use (that epoch).
    Same(u64),
    /// Another node, of a higher epoch (the second field), which confirmed
    /// it is the primary (its generation not set yet).
    Moved(Box<Current>, u64),
    /// No answer we could use: why, per sentinel.
    Failed(String),
}

/// What a resolution made of the primary followed.
enum Verdict {
    /// The sentinels' latest answer names it.
    Confirmed,
    /// It moved (and is followed now).
    Moved,
    /// Neither: why.
    Unconfirmed(String),
}

impl Sentinels {
    fn new(target: &Target, timeout: Duration) -> Result<Sentinels, RedisError> {
        let sentinel = target
            .sentinel
            .as_ref()
            .expect("a sentinel URL has its sentinel part");
        let mut sentinels = Vec::with_capacity(target.nodes.len());
        for url in &target.nodes {
            let mut info = url.as_str().into_connection_info()?;
            let mut settings = info.redis_settings().clone();
            if let Some(user) = &sentinel.username {
                settings = settings.set_username(user);
            }
            if let Some(password) = &sentinel.password {
                settings = settings.set_password(password);
            }
            info = info.set_redis_settings(settings);
            let client = match (&target.tls_ca, sentinel.tls) {
                (Some(ca), true) => Client::build_with_tls(
                    info,
                    redis::TlsCertificates {
                        client_tls: None,
                        root_cert: Some(ca.clone()),
                    },
                )?,
                _ => Client::open(info)?,
            };
            sentinels.push((client, Mutex::new(None)));
        }
        Ok(Sentinels {
            name: sentinel.name.clone(),
            sentinels,
            target: sentinel.clone(),
            tls_ca: target.tls_ca.clone(),
            timeout,
        })
    }

    /// Asks every sentinel at once for the primary and its configuration
    /// epoch, and takes the answer with the highest epoch (see [`gather`](Self::gather)).
    /// `current` is the node followed and the highest epoch followed: an
    /// answer older than that epoch is never followed back, and `Same` when
    /// the best answer names `current`.
    async fn resolve(&self, current: Option<(&str, u64)>) -> Resolved {
        let (named, why) = self.gather().await;
        let is_current = |n: &Named| current.is_some_and(|(address, _)| n.address() == address);
        // Equal epochs name the same node; if they ever did not, keep ours.
        let Some(best) = named.into_iter().max_by(|a, b| {
            a.epoch
                .cmp(&b.epoch)
                .then(is_current(a).cmp(&is_current(b)))
        }) else {
            return Resolved::Failed(why.join("; "));
        };
        if let Some((address, epoch)) = current {
            if best.epoch < epoch {
                return Resolved::Failed(format!(
                    "the sentinels that answered name the configuration of epoch {}, older \
                     than the followed one ({epoch}){}",
                    best.epoch,
                    if why.is_empty() {
                        String::new()
                    } else {
                        format!("; {}", why.join("; "))
                    }
                ));
            }
            if best.address() == address {
                return Resolved::Same(best.epoch);
            }
        }
        let address = best.address();
        match self.confirm(&best.host, best.port).await {
            Ok((client, conn)) => Resolved::Moved(
                Box::new(Current {
                    generation: 0,
                    address,
                    client,
                    conn,
                }),
                best.epoch,
            ),
            Err(e) => Resolved::Failed(format!(
                "sentinel {} names {address} (epoch {}): {e}",
                best.sentinel, best.epoch
            )),
        }
    }

    /// Asks every sentinel at once (each bounded by the timeout): the
    /// answers received until every sentinel answered or failed, or until
    /// [`SETTLE`] after the first answer (a sentinel that answers nothing
    /// does not hold up the others'), and why the others gave none.
    async fn gather(&self) -> (Vec<Named>, Vec<String>) {
        let mut pending: FuturesUnordered<_> = self
            .sentinels
            .iter()
            .enumerate()
            .map(|(number, (client, cached))| async move {
                let sentinel = format!("{} ({})", number + 1, client.get_connection_info().addr());
                let answer =
                    match tokio::time::timeout(self.timeout, self.ask(client, cached)).await {
                        Ok(answer) => answer,
                        Err(_) => Err(format!(
                            "no answer within {}",
                            humantime::format_duration(self.timeout)
                        )),
                    };
                (sentinel, answer)
            })
            .collect();
        let (mut named, mut why) = (Vec::new(), Vec::new());
        let mut settle_at = None;
        loop {
            let next = match settle_at {
                Some(at) => match tokio::time::timeout_at(at, pending.next()).await {
                    Ok(next) => next,
                    Err(_) => {
                        why.push(format!(
                            "{} sentinel(s) had not answered {} after the first",
                            pending.len(),
                            humantime::format_duration(SETTLE)
                        ));
                        break;
                    }
                },
                None => pending.next().await,
            };
            let Some((sentinel, answer)) = next else {
                break;
            };
            match answer {
                Ok((host, port, epoch)) => {
                    settle_at.get_or_insert_with(|| tokio::time::Instant::now() + SETTLE);
                    named.push(Named {
                        sentinel,
                        host,
                        port,
                        epoch,
                    });
                }
                Err(e) => why.push(format!("sentinel {sentinel}: {e}")),
            }
        }
        (named, why)
    }

    /// `SENTINEL MASTER` on one sentinel, over its kept connection (opened
    /// again after an error): the primary's host, port and configuration
    /// epoch.
    async fn ask(
        &self,
        client: &Client,
        cached: &Mutex<Option<MultiplexedConnection>>,
    ) -> Result<(String, u16, u64), String> {
        let kept = cached.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let mut conn = match kept {
            Some(conn) => conn,
            None => {
                let config = AsyncConnectionConfig::new()
                    .set_connection_timeout(Some(self.timeout))
                    .set_response_timeout(Some(self.timeout));
                let conn = self
                    .bounded(client.get_multiplexed_async_connection_with_config(&config))
                    .await?;
                *cached.lock().unwrap_or_else(|e| e.into_inner()) = Some(conn.clone());
                conn
            }
        };
        let mut ask = redis::cmd("SENTINEL");
        ask.arg("MASTER").arg(&self.name);
        let answer: Result<HashMap<String, String>, String> =
            self.bounded(ask.query_async(&mut conn)).await;
        if answer.is_err() {
            *cached.lock().unwrap_or_else(|e| e.into_inner()) = None;
        }
        let fields = answer.map_err(|e| {
            if e.contains("No such master") {
                format!("does not know `{}`", self.name)
            } else {
                e
            }
        })?;
        let field = |name: &str| {
            fields
                .get(name)
                .ok_or_else(|| format!("its answer to SENTINEL MASTER has no `{name}`"))
        };
        let host = field("ip")?.clone();
        let port = field("port")?
            .parse()
            .map_err(|_| "its answer to SENTINEL MASTER has a bad `port`".to_string())?;
        let epoch = field("config-epoch")?
            .parse()
            .map_err(|_| "its answer to SENTINEL MASTER has a bad `config-epoch`".to_string())?;
        Ok((host, port, epoch))
    }

    /// Opens the managed connection to `host:port` and checks that the node
    /// says it is a master.
    async fn confirm(&self, host: &str, port: u16) -> Result<(Client, Conn), String> {
        let client =
            client(&self.target.node_url(host, port), &self.tls_ca).map_err(|e| e.to_string())?;
        let conn = self
            .bounded(Opener::single(client.clone(), self.timeout, RECONNECT_MAX).open())
            .await?;
        let Conn::Single(mut manager) = conn.clone() else {
            unreachable!("a single server's opener opens a single connection")
        };
        let role: redis::Value = self
            .bounded(redis::cmd("ROLE").query_async(&mut manager))
            .await?;
        let role = match role {
            redis::Value::Array(items) => items.into_iter().next(),
            _ => None,
        };
        match role {
            Some(redis::Value::BulkString(r)) if r == b"master" => Ok((client, conn)),
            Some(redis::Value::BulkString(r)) => Err(format!(
                "the node says it is a {}, not the primary",
                String::from_utf8_lossy(&r)
            )),
            _ => Err("the node did not answer ROLE".into()),
        }
    }

    async fn bounded<T>(
        &self,
        answer: impl Future<Output = Result<T, RedisError>>,
    ) -> Result<T, String> {
        match tokio::time::timeout(self.timeout, answer).await {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err(format!(
                "no answer within {}",
                humantime::format_duration(self.timeout)
            )),
        }
    }
}

/// The primary behind a set of sentinels, followed across failovers. See the
/// [module docs](self).
pub(super) struct Followed {
    sentinels: Sentinels,
    current: watch::Sender<Arc<Current>>,
    /// The highest configuration epoch followed: never followed back below.
    epoch: AtomicU64,
    /// One resolution at a time, and when the last one ended.
    resolving: tokio::sync::Mutex<Instant>,
}

impl Followed {
    /// Finds the primary (an error if no sentinel names one that confirms),
    /// on dlock's I/O runtime, and starts following it.
    pub(super) async fn open(
        target: &Target,
        timeout: Duration,
    ) -> Result<Arc<Followed>, BackendError> {
        let sentinels = Sentinels::new(target, timeout).map_err(BackendError::permanent)?;
        crate::driver::run(async move {
            let (found, epoch) = match sentinels.resolve(None).await {
                Resolved::Moved(found, epoch) => (found, epoch),
                Resolved::Same(_) => unreachable!("there is no current primary to be the same"),
                Resolved::Failed(why) => {
                    return Err(BackendError::transient(format!(
                        "no sentinel named a reachable primary `{}`: {why}",
                        sentinels.name
                    )));
                }
            };
            let (current, _) = watch::channel(Arc::from(found));
            let followed = Arc::new(Followed {
                sentinels,
                current,
                epoch: AtomicU64::new(epoch),
                resolving: tokio::sync::Mutex::new(Instant::now()),
            });
            tokio::spawn(watch(Arc::downgrade(&followed)));
            Ok(followed)
        })
        .await
    }

    /// The primary as last resolved.
    pub(super) fn current(&self) -> Arc<Current> {
        self.current.borrow().clone()
    }

    /// Tells of every move.
    pub(super) fn subscribe(&self) -> watch::Receiver<Arc<Current>> {
        self.current.subscribe()
    }

    /// Asks the sentinels again unless the primary moved since `seen` (a
    /// generation) or they were asked less than [`MIN_RESOLVE_INTERVAL`]
    /// ago; answers whether the primary moved since `seen`. Runs on dlock's
    /// I/O runtime (the new connection lives there) and waits at most the
    /// timeout for it; the resolution goes on without the caller.
    pub(super) async fn refresh(self: &Arc<Self>, seen: u64) -> bool {
        let followed = self.clone();
        let resolution = crate::driver::handle().spawn(async move {
            followed.resolve_after(seen, MIN_RESOLVE_INTERVAL).await;
        });
        let _ = tokio::time::timeout(self.sentinels.timeout, resolution).await;
        self.current().generation != seen
    }

    async fn resolve_after(&self, seen: u64, interval: Duration) {
        let mut last = self.resolving.lock().await;
        if self.current().generation != seen || last.elapsed() < interval {
            return;
        }
        let verdict = self.resolve_now().await;
        *last = Instant::now();
        if let Verdict::Unconfirmed(why) = verdict {
            tracing::warn!(
                primary = %self.sentinels.name,
                "dlock: the sentinels did not confirm a reachable Redis primary: {why}"
            );
        }
    }

    /// Asks the sentinels and follows their latest answer (the caller holds
    /// `resolving`).
    async fn resolve_now(&self) -> Verdict {
        let current = self.current();
        let epoch = self.epoch.load(Ordering::Acquire);
        match self
            .sentinels
            .resolve(Some((&current.address, epoch)))
            .await
        {
            Resolved::Same(epoch) => {
                self.epoch.fetch_max(epoch, Ordering::AcqRel);
                Verdict::Confirmed
            }
            Resolved::Moved(found, epoch) => {
                self.moved(found, epoch);
                Verdict::Moved
            }
            Resolved::Failed(why) => Verdict::Unconfirmed(why),
        }
    }

    /// Whether the node of generation `seen` is still the primary, asked of
    /// the sentinels now: `Ok` when the answer of the highest epoch received
    /// names it and that epoch is not older than the one followed; else an
    /// error (and the new primary followed if it moved). Runs on dlock's I/O
    /// runtime.
    pub(super) async fn vouch(self: &Arc<Self>, seen: u64) -> Result<(), BackendError> {
        let followed = self.clone();
        let verdict = crate::driver::handle()
            .spawn(async move {
                let mut last = followed.resolving.lock().await;
                if followed.current().generation != seen {
                    return Verdict::Moved;
                }
                let verdict = followed.resolve_now().await;
                *last = Instant::now();
                verdict
            })
            .await
            .unwrap_or_else(|e| Verdict::Unconfirmed(e.to_string()));
        let name = &self.sentinels.name;
        match verdict {
            Verdict::Confirmed if self.current().generation == seen => Ok(()),
            Verdict::Confirmed | Verdict::Moved => Err(BackendError::transient(format!(
                "redis: the primary `{name}` moved (Sentinel failover) since the command"
            ))),
            Verdict::Unconfirmed(why) => Err(BackendError::transient(format!(
                "redis: no sentinel confirmed that the node answering is still the \
                 primary `{name}`: {why}"
            ))),
        }
    }

    /// A sentinel announced a switch (`<name> <old ip> <old port> <new ip>
    /// <new port>`): if it is ours, ask the sentinels at once (the one that
    /// announced it answers with the new epoch), without waiting for the
    /// poll.
    async fn switch_announced(&self, payload: &str) {
        if payload.split(' ').next() != Some(self.sentinels.name.as_str()) {
            return;
        }
        self.resolve_after(self.current().generation, Duration::ZERO)
            .await;
    }

    /// Follows the primary to `found`, named with configuration epoch `epoch`.
    fn moved(&self, mut found: Box<Current>, epoch: u64) {
        let current = self.current();
        tracing::info!(
            primary = %self.sentinels.name,
            from = %current.address,
            to = %found.address,
            epoch,
            "dlock: the Redis primary moved (Sentinel failover)"
        );
        found.generation = current.generation + 1;
        self.epoch.fetch_max(epoch, Ordering::AcqRel);
        self.current.send_replace(Arc::from(found));
    }

    /// Sends a command with `send` to the primary; if it fails in a way
    /// that says the primary may have moved, asks the sentinels and sends it
    /// once more if it did.
    pub(super) async fn send<T, F, Sent>(self: &Arc<Self>, send: F) -> Result<T, BackendError>
    where
        F: Fn(Conn) -> Sent,
        Sent: Future<Output = Result<T, RedisError>>,
    {
        self.send_on(send).await.map(|(answer, _)| answer)
    }

    /// [`send`](Self::send), and the generation of the node that answered.
    pub(super) async fn send_on<T, F, Sent>(
        self: &Arc<Self>,
        send: F,
    ) -> Result<(T, u64), BackendError>
    where
        F: Fn(Conn) -> Sent,
        Sent: Future<Output = Result<T, RedisError>>,
    {
        let current = self.current();
        match send(current.conn.clone()).await {
            Ok(answer) => Ok((answer, current.generation)),
            Err(err) if moves(&err) => {
                if self.refresh(current.generation).await {
                    let moved = self.current();
                    send(moved.conn.clone())
                        .await
                        .map(|answer| (answer, moved.generation))
                        .map_err(sentinel_error)
                } else {
                    Err(sentinel_error(err))
                }
            }
            Err(err) => Err(sentinel_error(err)),
        }
    }
}

/// Follows the primary while it is followed: at once when any sentinel
/// announces a switch (`+switch-master`), and every [`POLL`] in any case (a
/// sentinel that lags, a subscription lost). Every sentinel is listened to
/// by a task of its own ([`listen_to`]), so a sentinel that answers nothing
/// holds up neither the others' announcements nor the polls: the
/// resolutions run here, one at a time, and never wait for a subscription.
async fn watch(followed: Weak<Followed>) {
    let Some(strong) = followed.upgrade() else {
        return;
    };
    let stop = CancellationToken::new();
    let _stop_listening = stop.clone().drop_guard();
    let (announce, mut announced) = mpsc::unbounded_channel();
    for (client, _) in &strong.sentinels.sentinels {
        tokio::spawn(listen_to(
            client.clone(),
            strong.sentinels.timeout,
            announce.clone(),
            stop.clone(),
        ));
    }
    drop(strong);
    let mut poll_at = tokio::time::Instant::now() + POLL;
    loop {
        let payload = tokio::select! {
            payload = announced.recv() => payload,
            () = tokio::time::sleep_until(poll_at) => None,
        };
        let Some(strong) = followed.upgrade() else {
            return;
        };
        match payload {
            Some(payload) => {
                strong.switch_announced(&payload).await;
                // The other sentinels' announcements of the same switch:
                // the resolution just made has followed it.
                while announced.try_recv().is_ok() {}
            }
            None => {
                poll_at = tokio::time::Instant::now() + POLL;
                let seen = strong.current().generation;
                strong.resolve_after(seen, Duration::ZERO).await;
            }
        }
    }
}

/// A subscription to the switches a sentinel announces, if it answers
/// within `timeout`.
async fn subscribe(client: &Client, timeout: Duration) -> Option<redis::aio::PubSubStream> {
    let mut pubsub = tokio::time::timeout(timeout, client.get_async_pubsub())
        .await
        .ok()?
        .ok()?;
    tokio::time::timeout(timeout, pubsub.subscribe("+switch-master"))
        .await
        .ok()?
        .ok()?;
    Some(pubsub.into_on_message())
}

/// Listens to one sentinel's `+switch-master` announcements until `stop`,
/// subscribing again [`POLL`] after a subscription failed or ended, and
/// hands each announcement to the watch.
async fn listen_to(
    client: Client,
    timeout: Duration,
    announce: mpsc::UnboundedSender<String>,
    stop: CancellationToken,
) {
    loop {
        let subscribed = tokio::select! {
            () = stop.cancelled() => return,
            subscribed = subscribe(&client, timeout) => subscribed,
        };
        if let Some(mut messages) = subscribed {
            loop {
                let message = tokio::select! {
                    () = stop.cancelled() => return,
                    message = messages.next() => message,
                };
                let Some(message) = message else {
                    break;
                };
                let payload: String = message.get_payload().unwrap_or_default();
                if announce.send(payload).is_err() {
                    return;
                }
            }
        }
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(POLL) => {}
        }
    }
}
