//! Opening the backend's session: connecting, creating the chroot, and
//! starting the session's reaper and monitor.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use zookeeper_client::{Acls, Client, CreateMode, Error as ZkError};

use super::session::{self, Session};
use super::{Inner, backend_error, lock};
use crate::error::BackendError;

impl Inner {
    fn current_alive(&self) -> Option<Arc<Session>> {
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
        // The client's tasks live on the runtime that connects: dlock's own.
        let session = crate::driver::run(async move { inner.open().await }).await?;
        *lock(&self.current) = Some(session.clone());
        Ok(session)
    }

    async fn open(self: Arc<Self>) -> Result<Arc<Session>, BackendError> {
        let t = &self.target;
        let mut connector = Client::connector()
            .with_session_timeout(t.session_timeout)
            .with_fail_eagerly();
        if let Some(digest) = &t.digest {
            connector = connector.with_auth("digest", digest.as_bytes());
        }
        let started = Instant::now();
        let bound = t.session_timeout.max(Duration::from_secs(1));
        let root = match tokio::time::timeout(bound, connector.connect(&t.hosts)).await {
            Ok(Ok(client)) => client,
            Ok(Err(err)) => {
                return Err(backend_error(
                    &format!("cannot connect to {}", self.shown_url),
                    err,
                ));
            }
            Err(_) => {
                return Err(BackendError::transient(format!(
                    "zookeeper: no session with {} within {bound:?}",
                    self.shown_url
                )));
            }
        };
        if t.chroot != "/" {
            let exists = tokio::time::timeout(bound, root.check_stat(&t.chroot)).await;
            match exists {
                Ok(Ok(Some(_))) => {}
                Ok(Ok(None)) => {
                    let made = tokio::time::timeout(bound, mkdir(&root, &t.chroot)).await;
                    match made {
                        Ok(Ok(())) => {}
                        Ok(Err(err)) => {
                            return Err(backend_error(
                                &format!("cannot create the chroot {}", t.chroot),
                                err,
                            ));
                        }
                        Err(_) => {
                            return Err(BackendError::transient(format!(
                                "zookeeper: creating the chroot {} timed out",
                                t.chroot
                            )));
                        }
                    }
                }
                Ok(Err(err)) => {
                    return Err(backend_error(
                        &format!("cannot read the chroot {}", t.chroot),
                        err,
                    ));
                }
                Err(_) => {
                    return Err(BackendError::transient(format!(
                        "zookeeper: reading the chroot {} timed out",
                        t.chroot
                    )));
                }
            }
        }
        let client = root
            .clone()
            .chroot(t.chroot.clone())
            .map_err(|_| BackendError::permanent(format!("zookeeper: bad chroot {}", t.chroot)))?;
        let states = client.state_watcher();
        let session = Session::new(client, root, started);
        self.counters.sessions.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(
            url = %self.shown_url,
            session = %format_args!("{:#x}", session.id),
            timeout_ms = session.timeout.as_millis() as u64,
            "dlock zookeeper: session opened"
        );
        crate::driver::handle().spawn(session::reaper(Arc::downgrade(&session)));
        crate::driver::handle().spawn(session::monitor(
            Arc::downgrade(&session),
            states,
            t.loss,
            self.counters.clone(),
        ));
        Ok(session)
    }
}

/// `mkdir -p` of persistent nodes with the open ACL.
pub(super) async fn mkdir(root: &Client, path: &str) -> Result<(), ZkError> {
    root.mkdir(path, &CreateMode::Persistent.with_acls(Acls::anyone_all()))
        .await
}
