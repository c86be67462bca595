//! Renewal: one multi-read per session checks that every held node still
//! exists and belongs to it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use zookeeper_client::{Error as ZkError, MultiReadResult};

use super::session::{HeldNode, Session};
use super::{Inner, backend_error, session_over};
use crate::backend::{Lease, Renewal};
use crate::error::BackendError;

impl Inner {
    pub(super) async fn renew_batch(
        &self,
        batch: &[(&Lease, Duration)],
    ) -> Vec<Result<Renewal, BackendError>> {
        type Group = (Arc<Session>, Vec<(usize, Arc<HeldNode>, Duration)>);
        let mut answers: Vec<Option<Result<Renewal, BackendError>>> =
            batch.iter().map(|_| None).collect();
        let mut groups: Vec<Group> = Vec::new();
        for (i, (lease, ttl)) in batch.iter().enumerate() {
            let Some(node) = held_node(lease) else {
                answers[i] = Some(Err(BackendError::permanent(
                    "zookeeper: not a lease granted by this backend",
                )));
                continue;
            };
            let session = node.session.upgrade().filter(|s| s.is_alive());
            let Some(session) = session.filter(|_| !node.is_ended() && !node.lost.is_cancelled())
            else {
                answers[i] = Some(Ok(Renewal::Lost));
                continue;
            };
            match groups.iter_mut().find(|(s, _)| Arc::ptr_eq(s, &session)) {
                Some((_, items)) => items.push((i, node, *ttl)),
                None => groups.push((session, vec![(i, node, *ttl)])),
            }
        }
        // One multi-read per session (one in practice): every node, its owner.
        for (session, items) in groups {
            let mut reader = session.client.new_multi_reader();
            let added = items
                .iter()
                .try_for_each(|(_, node, _)| reader.add_get_data(&node.path));
            if let Err(err) = added {
                for (i, _, _) in &items {
                    answers[*i] = Some(Err(backend_error("renewal", err.clone())));
                }
                continue;
            }
            let sent = Instant::now();
            let request = reader.commit();
            match session.finish(sent, request).await {
                Ok(results) if results.len() == items.len() => {
                    for ((i, node, ttl), result) in items.into_iter().zip(results) {
                        answers[i] = Some(match result {
                            MultiReadResult::Data { stat, .. }
                                if stat.ephemeral_owner == session.id =>
                            {
                                Ok(if session.extend(&node, sent, ttl) {
                                    Renewal::Renewed
                                } else {
                                    Renewal::Lost
                                })
                            }
                            MultiReadResult::Data { .. } => {
                                session.unregister(&node);
                                Ok(Renewal::Lost)
                            }
                            // Deleted while our session lives: by an
                            // operator (`revoke`), not by an expiry.
                            MultiReadResult::Error {
                                err: ZkError::NoNode,
                            } => {
                                session.unregister(&node);
                                Ok(Renewal::Revoked)
                            }
                            MultiReadResult::Error { err } => Err(backend_error("renewal", err)),
                            other => Err(BackendError::permanent(format!(
                                "zookeeper: unexpected renewal answer {other:?}"
                            ))),
                        });
                    }
                }
                Ok(_) => {
                    for (i, _, _) in &items {
                        answers[*i] = Some(Err(BackendError::permanent(
                            "zookeeper: short multi-read answer",
                        )));
                    }
                }
                Err(err) if session_over(&err) => {
                    for (i, _, _) in &items {
                        answers[*i] = Some(Ok(Renewal::Lost));
                    }
                }
                Err(err) => {
                    for (i, _, _) in &items {
                        answers[*i] = Some(Err(backend_error("renewal", err.clone())));
                    }
                }
            }
        }
        answers
            .into_iter()
            .map(|a| a.unwrap_or_else(|| Err(BackendError::permanent("zookeeper: no answer"))))
            .collect()
    }
}

pub(super) fn held_node(lease: &Lease) -> Option<Arc<HeldNode>> {
    lease.extra.clone()?.downcast::<HeldNode>().ok()
}
