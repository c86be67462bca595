//! Redis Sentinel (`redis+sentinel://`): the primary found through its
//! sentinels, and followed across failovers. See **Redis Sentinel** in the
//! [Redis backend's docs](super).
//!
//! The sentinels are asked directly (`SENTINEL GET-MASTER-ADDR-BY-NAME`, then
//! `ROLE` on the node named), not through the redis crate's `sentinel`
//! feature: its clients resolve the primary once, when a connection is made,
//! and its `ConnectionManager` then reconnects to that same address for ever
//! (`READONLY` on every write after a failover, or ≈9 s of reconnect
//! back-off on a dead primary), and nothing there listens for a failover.
//! Here one [`Followed`] primary holds the connection to the node the
//! sentinels name now and replaces it:
//!
//! - when a command meets `READONLY` (the node was demoted), a dropped or
//!   refused connection, or a timeout ([`moves`]): the sentinels are asked
//!   again (at most once per [`MIN_RESOLVE_INTERVAL`] however many commands
//!   fail), and the command is sent once more if the primary moved;
//! - as soon as the sentinel it listens to announces the switch
//!   (`+switch-master` on one sentinel's pub/sub, moved to the next sentinel
//!   when that one fails), and every [`POLL`] in any case, by a task of its
//!   own ([`watch`]): after `SENTINEL FAILOVER` the old primary still accepted
//!   writes for ≈11 s (measured), so waiting for an error would leave grants
//!   and renewals on a node about to be reset.
//!
//! A node is taken only if it confirms `ROLE` master; the sentinels are asked
//! in the URL's order, and the first confirmed answer wins (an announced
//! switch is followed at once once its node confirms). Every step is bounded
//! by the backend's timeout.

use std::future::Future;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, Client, IntoConnectionInfo, RedisError};
use tokio::sync::watch;

use super::connections::{Conn, Opener, client};
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

/// What asking the sentinels found.
enum Resolved {
    /// They still name the node we use.
    Same,
    /// Another node, which confirmed it is the primary (its generation
    /// not set yet).
    Moved(Box<Current>),
    /// No answer we could use: why, per sentinel.
    Failed(String),
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

    /// Asks the sentinels in order for the primary's address; the first
    /// address whose node confirms `ROLE` master wins. `Same` as soon as a
    /// sentinel names `current`.
    async fn resolve(&self, current: Option<&str>) -> Resolved {
        let mut why = Vec::new();
        for (number, (client, cached)) in self.sentinels.iter().enumerate() {
            let sentinel = client.get_connection_info().addr().to_string();
            let (host, port) = match self.ask(client, cached).await {
                Ok(Some(address)) => address,
                Ok(None) => {
                    why.push(format!(
                        "sentinel {} ({sentinel}) does not know `{}`",
                        number + 1,
                        self.name
                    ));
                    continue;
                }
                Err(e) => {
                    why.push(format!("sentinel {} ({sentinel}): {e}", number + 1));
                    continue;
                }
            };
            let address = format!("{host}:{port}");
            if current == Some(address.as_str()) {
                return Resolved::Same;
            }
            match self.confirm(&host, port).await {
                Ok((client, conn)) => {
                    return Resolved::Moved(Box::new(Current {
                        generation: 0,
                        address,
                        client,
                        conn,
                    }));
                }
                Err(e) => why.push(format!(
                    "sentinel {} ({sentinel}) names {address}: {e}",
                    number + 1
                )),
            }
        }
        Resolved::Failed(why.join("; "))
    }

    /// A subscription to the switches sentinel `number` announces, if it answers.
    async fn listen(&self, number: usize) -> Option<redis::aio::PubSubStream> {
        let (client, _) = self.sentinels.get(number)?;
        let mut pubsub = self.bounded(client.get_async_pubsub()).await.ok()?;
        self.bounded(pubsub.subscribe("+switch-master"))
            .await
            .ok()?;
        Some(pubsub.into_on_message())
    }

    /// `SENTINEL GET-MASTER-ADDR-BY-NAME` on one sentinel, over its kept
    /// connection (opened again after an error).
    async fn ask(
        &self,
        client: &Client,
        cached: &Mutex<Option<MultiplexedConnection>>,
    ) -> Result<Option<(String, u16)>, String> {
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
        ask.arg("GET-MASTER-ADDR-BY-NAME").arg(&self.name);
        let answer: Result<Option<(String, u16)>, String> =
            self.bounded(ask.query_async(&mut conn)).await;
        if answer.is_err() {
            *cached.lock().unwrap_or_else(|e| e.into_inner()) = None;
        }
        answer
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
            let found = match sentinels.resolve(None).await {
                Resolved::Moved(found) => found,
                Resolved::Same => unreachable!("there is no current primary to be the same"),
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
        let current = self.current();
        let resolved = self.sentinels.resolve(Some(&current.address)).await;
        *last = Instant::now();
        match resolved {
            Resolved::Same => {}
            Resolved::Moved(found) => self.moved(found),
            Resolved::Failed(why) => tracing::warn!(
                primary = %self.sentinels.name,
                "dlock: no sentinel named a reachable Redis primary: {why}"
            ),
        }
    }

    /// A sentinel announced a switch (`<name> <old ip> <old port> <new ip>
    /// <new port>`): if it is ours, to a node other than ours that confirms
    /// it is the primary, follow at once (without waiting for the sentinels
    /// asked first to hear of it).
    async fn switch_announced(&self, payload: &str) {
        let words: Vec<&str> = payload.split(' ').collect();
        let [name, _, _, host, port] = words[..] else {
            return;
        };
        let Ok(port) = port.parse::<u16>() else {
            return;
        };
        if name != self.sentinels.name {
            return;
        }
        let _one_at_a_time = self.resolving.lock().await;
        let current = self.current();
        let address = format!("{host}:{port}");
        if current.address == address {
            return;
        }
        match self.sentinels.confirm(host, port).await {
            Ok((client, conn)) => self.moved(Box::new(Current {
                generation: 0,
                address,
                client,
                conn,
            })),
            Err(why) => tracing::warn!(
                primary = %self.sentinels.name,
                "dlock: a sentinel announced {address} as the Redis primary: {why}"
            ),
        }
    }

    /// Follows the primary to `found`.
    fn moved(&self, mut found: Box<Current>) {
        let current = self.current();
        tracing::info!(
            primary = %self.sentinels.name,
            from = %current.address,
            to = %found.address,
            "dlock: the Redis primary moved (Sentinel failover)"
        );
        found.generation = current.generation + 1;
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
        let current = self.current();
        match send(current.conn.clone()).await {
            Ok(answer) => Ok(answer),
            Err(err) if moves(&err) => {
                if self.refresh(current.generation).await {
                    send(self.current().conn.clone())
                        .await
                        .map_err(sentinel_error)
                } else {
                    Err(sentinel_error(err))
                }
            }
            Err(err) => Err(sentinel_error(err)),
        }
    }
}

/// Follows the primary while it is followed: at once when the sentinel
/// listened to announces a switch (`+switch-master`), and every [`POLL`] in
/// any case (a sentinel that lags, a listening connection lost). The
/// listening connection moves to the next sentinel when it fails.
async fn watch(followed: Weak<Followed>) {
    let mut listened: Option<redis::aio::PubSubStream> = None;
    let mut next_sentinel = 0;
    let mut poll_at = tokio::time::Instant::now() + POLL;
    let mut listen_at = tokio::time::Instant::now();
    loop {
        if listened.is_none() && tokio::time::Instant::now() >= listen_at {
            let Some(strong) = followed.upgrade() else {
                return;
            };
            listened = strong.sentinels.listen(next_sentinel).await;
            if listened.is_none() {
                next_sentinel = (next_sentinel + 1) % strong.sentinels.sentinels.len();
                listen_at = tokio::time::Instant::now() + POLL;
            }
        }
        let announced = tokio::select! {
            message = async {
                match listened.as_mut() {
                    Some(stream) => stream.next().await,
                    None => std::future::pending().await,
                }
            } => Some(message),
            () = tokio::time::sleep_until(poll_at) => None,
        };
        let Some(strong) = followed.upgrade() else {
            return;
        };
        match announced {
            Some(Some(message)) => {
                let payload: String = message.get_payload().unwrap_or_default();
                strong.switch_announced(&payload).await;
            }
            Some(None) => {
                listened = None;
                next_sentinel = (next_sentinel + 1) % strong.sentinels.sentinels.len();
            }
            None => {
                poll_at = tokio::time::Instant::now() + POLL;
                let seen = strong.current().generation;
                strong.resolve_after(seen, Duration::ZERO).await;
            }
        }
    }
}
