//! Opening the backend's client and its sessions (one etcd lease each),
//! and starting a session's keeper and reaper.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use etcd_client::{Client, ConnectOptions};

use super::session::{self, Session, op_timeout};
use super::{Inner, backend_error, lock};
use crate::error::BackendError;

impl Inner {
    pub(super) fn current_alive(&self) -> Option<Arc<Session>> {
        lock(&self.current)
            .as_ref()
            .filter(|s| s.is_alive())
            .cloned()
    }

    /// The live session, opening a new one if there is none (the first
    /// call, or the previous one ended).
    pub(super) async fn session(self: &Arc<Self>) -> Result<Arc<Session>, BackendError> {
        if let Some(s) = self.current_alive() {
            return Ok(s);
        }
        let _one_at_a_time = self.connecting.lock().await;
        if let Some(s) = self.current_alive() {
            return Ok(s);
        }
        let inner = self.clone();
        // The client's channel and the session's tasks live on dlock's runtime.
        let session = crate::driver::run(async move { inner.open().await }).await?;
        *lock(&self.current) = Some(session.clone());
        Ok(session)
    }

    /// The backend's client, connected at the first call.
    async fn client(&self) -> Result<Client, BackendError> {
        if let Some(client) = lock(&self.client).clone() {
            return Ok(client);
        }
        let t = &self.target;
        let bound = op_timeout(t.session_ttl);
        let mut options = ConnectOptions::new()
            .with_connect_timeout(bound)
            .with_timeout(bound)
            .with_keep_alive(Duration::from_secs(1), bound)
            .with_keep_alive_while_idle(true)
            // A member cut off from the leader refuses at once, and ends its
            // watches, rather than leave them waiting.
            .with_require_leader(true);
        if let Some((user, password)) = &t.user {
            options = options.with_user(user.clone(), password.clone());
        }
        let connected = tokio::time::timeout(
            bound * 2,
            Client::connect(t.endpoints.clone(), Some(options)),
        )
        .await
        .unwrap_or_else(|_| Err(session::timed_out()));
        let client = connected
            .map_err(|e| backend_error(&format!("cannot connect to {}", self.shown_url), e))?;
        *lock(&self.client) = Some(client.clone());
        Ok(client)
    }

    async fn open(self: Arc<Self>) -> Result<Arc<Session>, BackendError> {
        let mut client = self.client().await?;
        let asked = self.target.session_ttl;
        let sent = Instant::now();
        let granted = tokio::time::timeout(
            op_timeout(asked) * 2,
            client.lease_grant(asked.as_secs() as i64, None),
        )
        .await
        .unwrap_or_else(|_| Err(session::timed_out()))
        .map_err(|e| {
            backend_error(
                &format!("no lease from {} (is the cluster up?)", self.shown_url),
                e,
            )
        })?;
        let ttl = Duration::from_secs(u64::try_from(granted.ttl()).unwrap_or(0)).min(asked);
        if ttl.is_zero() {
            return Err(BackendError::transient(format!(
                "etcd: {} granted a lease without a TTL",
                self.shown_url
            )));
        }
        let session = Session::new(client, granted.id(), ttl, sent, self.counters.clone());
        self.counters.sessions.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(
            url = %self.shown_url,
            lease = %format_args!("{:x}", session.lease_id),
            ttl_s = ttl.as_secs(),
            "dlock etcd: session opened"
        );
        crate::driver::handle().spawn(session::keeper(Arc::downgrade(&session)));
        crate::driver::handle().spawn(session::reaper(Arc::downgrade(&session)));
        Ok(session)
    }
}
