//! The PostgreSQL backend's wake-ups: one `LISTEN` connection per backend.
//!
//! A release of a key some waiter marked as wanted sends `pg_notify(channel,
//! key)`; this connection hears it and wakes the key's waiters in this
//! process. sqlx's `PgListener` does not recover from every reset by itself
//! and has no heartbeat, so the task here rebuilds it on **any** error, pings
//! it every few seconds (with a timeout: a half-open socket is noticed), and
//! after every (re)connect wakes every waiter, which looks again: a
//! notification missed while the connection was down costs nothing.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgListener, PgPoolOptions};
use tokio::sync::Notify;
use tokio_util::sync::{CancellationToken, DropGuard};

use crate::backend::wait::Waiters;

/// How often the listener's connection is pinged.
const PING_EVERY: Duration = Duration::from_secs(3);

/// The first and the longest pause between reconnection attempts.
const RECONNECT_FIRST: Duration = Duration::from_millis(50);
const RECONNECT_MAX: Duration = Duration::from_secs(2);

/// What a probe's payload starts with. Keys never contain control
/// characters, so a probe never wakes a key's waiters.
const PROBE: &str = "\u{1}dlock-probe:";

/// What the ping sends; `pg_stat_activity.query` shows it, which is how an
/// operator (or a test) finds the listener's backend.
pub(super) const PING: &str = "SELECT 1 /* dlock listener */";

/// The listening task's state, shared with the backend.
#[derive(Debug)]
struct State {
    /// Whether the connection is up and listening now.
    up: AtomicBool,
    /// Connections made so far.
    connects: AtomicU64,
    /// Notified on every connect.
    connected: Notify,
    /// Notified when a probe's payload arrives.
    probe_heard: Notify,
    waiters: Arc<Waiters>,
}

/// The listener of one backend; the task stops when this is dropped.
#[derive(Debug)]
pub(super) struct Listener {
    state: Arc<State>,
    channel: String,
    _stop: DropGuard,
}

impl Listener {
    /// Starts listening on `channel` over connections made with `options`
    /// (on dlock's I/O runtime), waking `waiters`.
    pub(super) fn start(
        options: PgConnectOptions,
        channel: String,
        waiters: Arc<Waiters>,
        timeout: Duration,
    ) -> Listener {
        let state = Arc::new(State {
            up: AtomicBool::new(false),
            connects: AtomicU64::new(0),
            connected: Notify::new(),
            probe_heard: Notify::new(),
            waiters,
        });
        let stop = CancellationToken::new();
        crate::driver::handle().spawn(listen(
            options,
            channel.clone(),
            state.clone(),
            timeout,
            stop.clone(),
        ));
        Listener {
            state,
            channel,
            _stop: stop.drop_guard(),
        }
    }

    /// Whether notifications are heard now.
    pub(super) fn is_up(&self) -> bool {
        self.state.up.load(Ordering::Acquire)
    }

    /// Checks that notifications reach this listener: waits for it to listen,
    /// then sends a probe through `pool` (the backend's own connections) and
    /// waits for it. False through a transaction-pooling proxy, whose
    /// `LISTEN` lands on a server connection the notifications never reach.
    pub(super) async fn probe(&self, pool: &sqlx::PgPool, within: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let connected = self.state.connected.notified();
            tokio::pin!(connected);
            connected.as_mut().enable();
            if self.is_up() {
                break;
            }
            if tokio::time::timeout_at(deadline, connected).await.is_err() {
                return false;
            }
        }
        let payload = format!("{PROBE}{:016x}", rand::random::<u64>());
        let heard = self.state.probe_heard.notified();
        tokio::pin!(heard);
        heard.as_mut().enable();
        let sent = tokio::time::timeout_at(
            deadline,
            sqlx::query("SELECT pg_notify($1, $2)")
                .bind(&self.channel)
                .bind(&payload)
                .execute(pool),
        )
        .await;
        if !matches!(sent, Ok(Ok(_))) {
            return false;
        }
        tokio::time::timeout_at(deadline, heard).await.is_ok()
    }

    /// Connections made so far (1 after the first connect).
    pub(super) fn connects(&self) -> u64 {
        self.state.connects.load(Ordering::Acquire)
    }
}

async fn listen(
    options: PgConnectOptions,
    channel: String,
    state: Arc<State>,
    timeout: Duration,
    stop: CancellationToken,
) {
    // The pool only makes connections: a connection the listener gives up
    // is closed, never reused (`after_release` answers "no").
    let pool = PgPoolOptions::new()
        .max_connections(2)
        .min_connections(0)
        .idle_timeout(None)
        .max_lifetime(None)
        .test_before_acquire(false)
        .acquire_timeout(timeout)
        .after_release(|_, _| Box::pin(async { Ok(false) }))
        .connect_lazy_with(options);
    let mut pause = RECONNECT_FIRST;
    while !stop.is_cancelled() {
        let connected = tokio::select! {
            () = stop.cancelled() => return,
            connected = tokio::time::timeout(timeout, connect(&pool, &channel)) => connected,
        };
        let mut listener = match connected {
            Ok(Ok(listener)) => listener,
            failed => {
                let error = match failed {
                    Ok(Err(e)) => e.to_string(),
                    _ => format!("no answer within {timeout:?}"),
                };
                tracing::debug!(%error, "dlock postgres: listener cannot connect; trying again");
                tokio::select! {
                    () = stop.cancelled() => return,
                    () = tokio::time::sleep(pause) => {}
                }
                pause = (pause * 2).min(RECONNECT_MAX);
                continue;
            }
        };
        pause = RECONNECT_FIRST;
        state.connects.fetch_add(1, Ordering::AcqRel);
        state.up.store(true, Ordering::Release);
        state.connected.notify_waiters();
        // Releases while the connection was down were not heard.
        state.waiters.wake_all();
        let why = hear(&mut listener, &channel, &state, timeout, &stop).await;
        state.up.store(false, Ordering::Release);
        // Waiters look again now (and poll faster while this is down).
        state.waiters.wake_all();
        if let Some(why) = why {
            tracing::debug!(reason = %why, "dlock postgres: listener connection lost; reconnecting");
        }
    }
}

async fn connect(pool: &sqlx::PgPool, channel: &str) -> Result<PgListener, sqlx::Error> {
    let mut listener = PgListener::connect_with(pool).await?;
    // Never reconnect behind our back: a reconnect must wake every waiter.
    listener.eager_reconnect(false);
    listener.ignore_pool_close_event(true);
    listener.listen(channel).await?;
    Ok(listener)
}

/// Hears notifications until the connection fails (the reason) or the
/// backend is dropped (`None`).
async fn hear(
    listener: &mut PgListener,
    channel: &str,
    state: &State,
    timeout: Duration,
    stop: &CancellationToken,
) -> Option<String> {
    let mut ping = tokio::time::interval_at(tokio::time::Instant::now() + PING_EVERY, PING_EVERY);
    loop {
        tokio::select! {
            () = stop.cancelled() => return None,
            heard = listener.try_recv() => match heard {
                Ok(Some(notification)) => {
                    if notification.channel() != channel {
                        continue;
                    }
                    let payload = notification.payload();
                    if payload.starts_with(PROBE) {
                        state.probe_heard.notify_waiters();
                    } else {
                        state.waiters.wake(payload);
                    }
                }
                Ok(None) => return Some("connection closed".into()),
                Err(e) => return Some(e.to_string()),
            },
            _ = ping.tick() => {
                match tokio::time::timeout(timeout, sqlx::query(PING).execute(&mut *listener)).await {
                    Ok(Ok(_)) => {}
                    Ok(Err(e)) => return Some(format!("ping failed: {e}")),
                    Err(_) => return Some(format!("ping not answered within {timeout:?}")),
                }
            }
        }
    }
}
