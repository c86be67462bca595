//! Release: deleting our entry, only while its create revision is ours,
//! within one request bound, then in the background.

use std::sync::Arc;
use std::time::Instant;

use super::session::{HeldEntry, delete_entry};
use super::{Inner, backend_error, transient};
use crate::error::BackendError;

impl Inner {
    pub(super) async fn release_held(&self, entry: Arc<HeldEntry>) -> Result<(), BackendError> {
        let Some(session) = entry.session.upgrade() else {
            // The session is gone, and its lease with the entry.
            return Ok(());
        };
        session.unregister(&entry);
        let deadline = Instant::now() + session.op_timeout;
        let slot = entry.slot.as_ref();
        match delete_entry(&session, &entry.key, entry.revision, slot, Some(deadline)).await {
            Ok(()) => Ok(()),
            Err(err) if transient(&err) => {
                let message = format!(
                    "etcd: the lock entry {} is not deleted yet ({err}); the delete goes on in \
                     the background until it succeeds or the session ends",
                    entry.key
                );
                crate::driver::handle().spawn(async move {
                    let slot = entry.slot.as_ref();
                    let _ = delete_entry(&session, &entry.key, entry.revision, slot, None).await;
                });
                Err(BackendError::transient(message))
            }
            Err(err) => Err(backend_error(
                &format!("deleting the lock entry {}", entry.key),
                err,
            )),
        }
    }
}
