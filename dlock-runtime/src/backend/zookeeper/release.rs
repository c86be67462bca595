//! Release and abandonment: deleting our node (or, when the create's answer
//! was not seen, the nodes of our GUID) within half a session timeout, then
//! in the background.

use std::sync::Arc;
use std::time::{Duration, Instant};

use zookeeper_client::Error as ZkError;

use super::session::{HeldNode, Session, delete_until_gone, within};
use super::{Inner, backend_error, path, session_over, transient};
use crate::error::BackendError;

impl Inner {
    pub(super) async fn release_held(&self, node: Arc<HeldNode>) -> Result<(), BackendError> {
        let Some(session) = node.session.upgrade() else {
            // The session is gone, and its ephemeral nodes with it.
            return Ok(());
        };
        session.unregister(&node);
        delete_node(session, node.path.clone()).await
    }
}

/// Deletes the nodes an acquisition with `guid` created, until none is
/// left or the session has ended; stops at `deadline` with the last error.
async fn delete_guid_nodes(
    session: &Session,
    container: &str,
    guid: &str,
    deadline: Option<Instant>,
) -> Result<(), ZkError> {
    let mine = path::guid_prefix(guid);
    let mut backoff = Duration::from_millis(10);
    loop {
        if !session.is_alive() {
            return Ok(());
        }
        match within(deadline, session.call(|c| c.list_children(container))).await {
            Ok(children) => {
                for name in children.iter().filter(|c| c.starts_with(&mine)) {
                    delete_until_gone(session, &format!("{container}/{name}"), deadline).await?;
                }
                return Ok(());
            }
            Err(ZkError::NoNode) => return Ok(()),
            Err(err) if session_over(&err) => return Ok(()),
            Err(err) if transient(&err) => {
                if deadline.is_some_and(|d| Instant::now() + backoff >= d) {
                    return Err(err);
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(1));
            }
            Err(err) => return Err(err),
        }
    }
}

/// Deletes our node within half a session timeout, or goes on in the
/// background (until it is gone or the session ends) and says so.
pub(super) async fn delete_node(session: Arc<Session>, path: String) -> Result<(), BackendError> {
    let deadline = Instant::now() + session.op_timeout;
    match delete_until_gone(&session, &path, Some(deadline)).await {
        Ok(()) => Ok(()),
        Err(err) if transient(&err) => {
            let message = format!(
                "zookeeper: the lock node {path} is not deleted yet ({err}); the delete goes on \
                 in the background until it succeeds or the session ends"
            );
            crate::driver::handle().spawn(async move {
                let _ = delete_until_gone(&session, &path, None).await;
            });
            Err(BackendError::transient(message))
        }
        Err(err) => Err(backend_error(
            &format!("deleting the lock node {path}"),
            err,
        )),
    }
}

/// [`delete_node`] for an acquisition whose node is known only by its GUID.
pub(super) async fn delete_by_guid(
    session: Arc<Session>,
    container: String,
    guid: String,
) -> Result<(), BackendError> {
    let deadline = Instant::now() + session.op_timeout;
    match delete_guid_nodes(&session, &container, &guid, Some(deadline)).await {
        Ok(()) => Ok(()),
        Err(err) if transient(&err) => {
            let message = format!(
                "zookeeper: the queued nodes under {container} are not deleted yet ({err}); \
                 the delete goes on in the background until it succeeds or the session ends"
            );
            crate::driver::handle().spawn(async move {
                let _ = delete_guid_nodes(&session, &container, &guid, None).await;
            });
            Err(BackendError::transient(message))
        }
        Err(err) => Err(backend_error(
            &format!("deleting the nodes under {container}"),
            err,
        )),
    }
}
