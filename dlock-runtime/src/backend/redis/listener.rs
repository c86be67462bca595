//! Wake-ups for waiters: the release channels this process listens to.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use redis::Client;
use tokio::sync::{Notify, mpsc, oneshot};

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
}

impl Listener {
    pub(in crate::backend) fn start(client: Client, timeout: Duration) -> Listener {
        let (commands, receiver) = mpsc::unbounded_channel();
        crate::driver::handle().spawn(listen(client, timeout, receiver));
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

async fn listen(client: Client, timeout: Duration, mut commands: mpsc::UnboundedReceiver<Command>) {
    let mut channels: HashMap<String, Channel> = HashMap::new();
    let mut connection: Option<(redis::aio::PubSubSink, redis::aio::PubSubStream)> = None;
    let mut reconnect_at = tokio::time::Instant::now();
    loop {
        if connection.is_none() && tokio::time::Instant::now() >= reconnect_at {
            connection = connect_pubsub(&client, timeout, channels.keys()).await;
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
                    });
                    entry.waiters += 1;
                    let notify = entry.notify.clone();
                    if entry.waiters == 1
                        && let Some((sink, _)) = connection.as_mut()
                        && !matches!(
                            tokio::time::timeout(timeout, sink.subscribe(&channel)).await,
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
                            if let Some((sink, _)) = connection.as_mut()
                                && !matches!(
                                    tokio::time::timeout(timeout, sink.unsubscribe(&channel)).await,
                                    Ok(Ok(()))
                                )
                            {
                                connection = None;
                            }
                        }
                    }
                }
            },
            message = async {
                match connection.as_mut() {
                    Some((_, stream)) => stream.next().await,
                    None => std::future::pending().await,
                }
            } => match message {
                Some(message) => {
                    if let Some(channel) = channels.get(message.get_channel_name()) {
                        channel.notify.notify_waiters();
                    }
                }
                None => {
                    connection = None;
                    for channel in channels.values() {
                        channel.notify.notify_waiters();
                    }
                }
            },
            () = tokio::time::sleep_until(reconnect_at), if connection.is_none() => {}
        }
    }
}

async fn connect_pubsub<'a>(
    client: &Client,
    timeout: Duration,
    channels: impl Iterator<Item = &'a String>,
) -> Option<(redis::aio::PubSubSink, redis::aio::PubSubStream)> {
    let pubsub = tokio::time::timeout(timeout, client.get_async_pubsub())
        .await
        .ok()?
        .ok()?;
    let (mut sink, stream) = pubsub.split();
    let channels: Vec<&String> = channels.collect();
    if !channels.is_empty() {
        tokio::time::timeout(timeout, sink.subscribe(channels))
            .await
            .ok()?
            .ok()?;
    }
    Some((sink, stream))
}
