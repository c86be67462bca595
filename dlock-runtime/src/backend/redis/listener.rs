//! Wake-ups for waiters: the release channels this process listens to.
//!
//! On one server, the release script `PUBLISH`es and the listener
//! `SUBSCRIBE`s over one pub/sub connection. On Redis Cluster a `PUBLISH` is
//! broadcast to every node of the cluster; there the script `SPUBLISH`es
//! instead and the listener `SSUBSCRIBE`s over a cluster connection (RESP3),
//! which sends each subscription to the node that owns the channel's slot
//! (the lock key's slot): a release only reaches the key's shard. That
//! connection subscribes again by itself after a node reconnects; when a
//! node gives a slot away (a migration, a demotion) it sends `SUNSUBSCRIBE`
//! for the slot's channels, and the listener subscribes again itself. Either
//! way the channel's waiters are woken (a release may have gone unheard
//! meanwhile). Behind Sentinel the listener subscribes on the primary as
//! last resolved; when the primary moves it drops that connection,
//! subscribes again on the new one and wakes every waiter.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use redis::cluster_async::ClusterConnection;
use redis::{Client, PushInfo, PushKind, RedisResult, Value};
use tokio::sync::{Notify, mpsc, oneshot};

use super::conn::cluster_builder;
use super::sentinel::Followed;

/// The release channels this process waits on, over one pub/sub connection.
///
/// One task owns the connection and does every SUBSCRIBE and UNSUBSCRIBE in
/// order, so a channel never ends up unsubscribed while someone waits on it.
#[derive(Clone)]
pub(in crate::backend) struct Listener {
    commands: mpsc::UnboundedSender<Command>,
}

enum Command {
    Join {
        channel: String,
        reply: oneshot::Sender<Arc<Notify>>,
    },
    Leave {
        channel: String,
    },
}

/// A waiter's interest in a channel; leaving is automatic on drop.
pub(in crate::backend) struct Subscription {
    channel: String,
    pub(in crate::backend) notify: Arc<Notify>,
    commands: mpsc::UnboundedSender<Command>,
}

impl Drop for Subscription {
    fn drop(&mut self) {
        let _ = self.commands.send(Command::Leave {
            channel: std::mem::take(&mut self.channel),
        });
    }
}

/// A join sent but not yet answered: dropped, it leaves again.
struct LeaveOnDrop {
    channel: Option<String>,
    commands: mpsc::UnboundedSender<Command>,
}

impl Drop for LeaveOnDrop {
    fn drop(&mut self) {
        if let Some(channel) = self.channel.take() {
            let _ = self.commands.send(Command::Leave { channel });
        }
    }
}

struct Channel {
    waiters: usize,
    notify: Arc<Notify>,
    /// Whether the server confirmed the subscription once (sharded only): a
    /// later confirmation is a subscription made again after a reconnection.
    confirmed: bool,
}

/// Where the release messages come from.
pub(in crate::backend) enum Source {
    /// One server: `SUBSCRIBE` over a pub/sub connection.
    Plain(Client),
    /// Redis Cluster through its seed nodes: `SSUBSCRIBE` on each channel's shard.
    Sharded {
        nodes: Vec<String>,
        tls_ca: Option<Vec<u8>>,
    },
    /// The primary behind Sentinel, wherever it is now: `SUBSCRIBE` there.
    Followed(Arc<Followed>),
}

/// An open subscriber connection.
enum PubSub {
    Plain(redis::aio::PubSubSink, redis::aio::PubSubStream),
    Sharded {
        conn: ClusterConnection,
        pushes: mpsc::UnboundedReceiver<PushInfo>,
    },
}

/// What the subscriber connection heard.
enum Heard {
    /// A release message on this channel.
    Message(String),
    /// The server confirmed a subscription to this channel (sharded only).
    Subscribed(String),
    /// The server dropped this channel's subscription (sharded only): the
    /// answer to our own `SUNSUBSCRIBE`, or the node no longer serves the
    /// channel's slot (a slot migrated, a master demoted).
    Unsubscribed(String),
    /// A node's connection dropped; the cluster connection reconnects and
    /// subscribes again by itself (sharded only).
    Disconnected,
    /// The connection is gone.
    Closed,
}

impl PubSub {
    async fn subscribe(&mut self, channel: &str) -> RedisResult<()> {
        match self {
            PubSub::Plain(sink, _) => sink.subscribe(channel).await,
            PubSub::Sharded { conn, .. } => conn.ssubscribe(channel).await,
        }
    }

    async fn unsubscribe(&mut self, channel: &str) -> RedisResult<()> {
        match self {
            PubSub::Plain(sink, _) => sink.unsubscribe(channel).await,
            PubSub::Sharded { conn, .. } => conn.sunsubscribe(channel).await,
        }
    }

    async fn next(&mut self) -> Heard {
        match self {
            PubSub::Plain(_, stream) => match stream.next().await {
                Some(message) => Heard::Message(message.get_channel_name().to_owned()),
                None => Heard::Closed,
            },
            PubSub::Sharded { pushes, .. } => loop {
                let Some(push) = pushes.recv().await else {
                    return Heard::Closed;
                };
                let channel = match push.data.first() {
                    Some(Value::BulkString(name)) => String::from_utf8_lossy(name).into_owned(),
                    _ => String::new(),
                };
                match push.kind {
                    PushKind::SMessage => return Heard::Message(channel),
                    PushKind::SSubscribe => return Heard::Subscribed(channel),
                    PushKind::SUnsubscribe => return Heard::Unsubscribed(channel),
                    PushKind::Disconnection => return Heard::Disconnected,
                    _ => {}
                }
            },
        }
    }
}

impl Listener {
    pub(in crate::backend) fn start(source: Source, timeout: Duration) -> Listener {
        let (commands, receiver) = mpsc::unbounded_channel();
        crate::driver::handle().spawn(listen(source, timeout, receiver));
        Listener { commands }
    }

    /// Subscribes (once per channel for the whole process) and answers when the
    /// server confirmed, or `None` if the listener is gone.
    ///
    /// Cancel-safe: the waiter is counted from the moment the join is sent, so
    /// a caller dropped before the answer still leaves (the `Leave` follows
    /// the `Join` on the same queue).
    pub(in crate::backend) async fn join(&self, channel: String) -> Option<Subscription> {
        let (reply, answer) = oneshot::channel();
        self.commands
            .send(Command::Join {
                channel: channel.clone(),
                reply,
            })
            .ok()?;
        let mut leave = LeaveOnDrop {
            channel: Some(channel),
            commands: self.commands.clone(),
        };
        let notify = answer.await.ok()?;
        Some(Subscription {
            channel: leave.channel.take().expect("taken once"),
            notify,
            commands: self.commands.clone(),
        })
    }
}

async fn listen(source: Source, timeout: Duration, mut commands: mpsc::UnboundedReceiver<Command>) {
    let mut channels: HashMap<String, Channel> = HashMap::new();
    let mut connection: Option<PubSub> = None;
    let mut reconnect_at = tokio::time::Instant::now();
    let mut moves = match &source {
        Source::Followed(followed) => Some(followed.subscribe()),
        _ => None,
    };
    loop {
        if connection.is_none() && tokio::time::Instant::now() >= reconnect_at {
            connection = connect(&source, timeout, channels.keys()).await;
            if connection.is_some() {
                // Releases during the outage were not heard: let everyone look again.
                for channel in channels.values() {
                    channel.notify.notify_waiters();
                }
            } else {
                reconnect_at = tokio::time::Instant::now() + Duration::from_millis(500);
            }
        }
        // select! drops every branch's future before running a handler, so the
        // handlers may change `connection` that the message future borrows.
        tokio::select! {
            command = commands.recv() => match command {
                None => return,
                Some(Command::Join { channel, reply }) => {
                    let entry = channels.entry(channel.clone()).or_insert_with(|| Channel {
                        waiters: 0,
                        notify: Arc::new(Notify::new()),
                        confirmed: false,
                    });
                    entry.waiters += 1;
                    let notify = entry.notify.clone();
                    if entry.waiters == 1
                        && let Some(pubsub) = connection.as_mut()
                        && !matches!(
                            tokio::time::timeout(timeout, pubsub.subscribe(&channel)).await,
                            Ok(Ok(()))
                        )
                    {
                        connection = None;
                    }
                    let _ = reply.send(notify);
                }
                Some(Command::Leave { channel }) => {
                    if let Some(entry) = channels.get_mut(&channel) {
                        entry.waiters -= 1;
                        if entry.waiters == 0 {
                            channels.remove(&channel);
                            if let Some(pubsub) = connection.as_mut()
                                && !matches!(
                                    tokio::time::timeout(timeout, pubsub.unsubscribe(&channel))
                                        .await,
                                    Ok(Ok(()))
                                )
                            {
                                connection = None;
                            }
                        }
                    }
                }
            },
            heard = async {
                match connection.as_mut() {
                    Some(pubsub) => pubsub.next().await,
                    None => std::future::pending().await,
                }
            } => match heard {
                Heard::Message(name) => {
                    // One release frees the key for one waiter: wake one (per
                    // process) rather than every waiter racing for it. The
                    // wait loop passes the wake-up on if that waiter leaves
                    // before it has looked.
                    if let Some(channel) = channels.get(&name) {
                        channel.notify.notify_one();
                    }
                }
                Heard::Subscribed(name) => {
                    if let Some(channel) = channels.get_mut(&name) {
                        if channel.confirmed {
                            // Subscribed again after a reconnection or a slot
                            // move: a release may have gone unheard.
                            channel.notify.notify_waiters();
                        }
                        channel.confirmed = true;
                    }
                }
                Heard::Unsubscribed(name) => {
                    // Still waited on: the node gave the slot away. The
                    // cluster connection does not subscribe again by itself
                    // (nothing disconnected), so subscribe again (it routes
                    // to the slot's new owner, following the redirection),
                    // and let the waiters look (a release may have gone to
                    // the new owner meanwhile).
                    if let Some(channel) = channels.get(&name) {
                        channel.notify.notify_waiters();
                        if let Some(pubsub) = connection.as_mut()
                            && !matches!(
                                tokio::time::timeout(timeout, pubsub.subscribe(&name)).await,
                                Ok(Ok(()))
                            )
                        {
                            connection = None;
                        }
                    }
                }
                Heard::Disconnected => {
                    for channel in channels.values() {
                        channel.notify.notify_waiters();
                    }
                }
                Heard::Closed => {
                    connection = None;
                    for channel in channels.values() {
                        channel.notify.notify_waiters();
                    }
                }
            },
            () = tokio::time::sleep_until(reconnect_at), if connection.is_none() => {}
            Some(()) = async {
                match moves.as_mut() {
                    Some(moved) => moved.changed().await.ok(),
                    None => std::future::pending().await,
                }
            } => {
                // The primary moved: subscribe there, and let everyone look
                // (a release may have gone to the new primary meanwhile).
                connection = None;
                reconnect_at = tokio::time::Instant::now();
                for channel in channels.values() {
                    channel.notify.notify_waiters();
                }
            }
        }
    }
}

/// Opens the subscriber connection and subscribes to `channels` again.
async fn connect<'a>(
    source: &Source,
    timeout: Duration,
    channels: impl Iterator<Item = &'a String>,
) -> Option<PubSub> {
    let channels: Vec<&String> = channels.collect();
    let followed;
    let source = match source {
        Source::Followed(primary) => {
            followed = Source::Plain(primary.current().client.clone());
            &followed
        }
        source => source,
    };
    match source {
        Source::Followed(_) => unreachable!("resolved to the current primary above"),
        Source::Plain(client) => {
            let pubsub = tokio::time::timeout(timeout, client.get_async_pubsub())
                .await
                .ok()?
                .ok()?;
            let (mut sink, stream) = pubsub.split();
            if !channels.is_empty() {
                tokio::time::timeout(timeout, sink.subscribe(channels))
                    .await
                    .ok()?
                    .ok()?;
            }
            Some(PubSub::Plain(sink, stream))
        }
        Source::Sharded { nodes, tls_ca } => {
            let (sender, pushes) = mpsc::unbounded_channel();
            let client = cluster_builder(nodes, tls_ca, timeout)
                .use_protocol(redis::ProtocolVersion::RESP3)
                .push_sender(sender)
                .build()
                .ok()?;
            let conn = tokio::time::timeout(timeout, client.get_async_connection())
                .await
                .ok()?
                .ok()?;
            let mut pubsub = PubSub::Sharded { conn, pushes };
            // One command per channel: channels of different slots live on
            // different nodes.
            for channel in channels {
                tokio::time::timeout(timeout, pubsub.subscribe(channel))
                    .await
                    .ok()?
                    .ok()?;
            }
            Some(pubsub)
        }
    }
}
