//! Renewal: one read transaction per session (and per 64 entries) checks
//! that every held entry still exists, is ours and is under the session's
//! lease; the lease itself is kept alive by the session's keeper.

use std::sync::Arc;
use std::time::{Duration, Instant};

use etcd_client::{GetOptions, Txn, TxnOp, TxnOpResponse};

use super::session::{HeldEntry, Session};
use super::{Inner, backend_error};
use crate::backend::{Lease, Renewal};
use crate::error::BackendError;

/// Entries checked by one transaction (etcd refuses more than 128 operations).
const PER_TXN: usize = 64;

impl Inner {
    pub(super) async fn renew_batch(
        &self,
        batch: &[(&Lease, Duration)],
    ) -> Vec<Result<Renewal, BackendError>> {
        type Item = (usize, Arc<HeldEntry>, Duration);
        let mut answers: Vec<Option<Result<Renewal, BackendError>>> =
            batch.iter().map(|_| None).collect();
        let mut groups: Vec<(Arc<Session>, Vec<Item>)> = Vec::new();
        for (i, (lease, ttl)) in batch.iter().enumerate() {
            let Some(entry) = held_entry(lease) else {
                answers[i] = Some(Err(BackendError::permanent(
                    "etcd: not a lease granted by this backend",
                )));
                continue;
            };
            let session = entry.session.upgrade().filter(|s| s.is_alive());
            let Some(session) = session.filter(|_| !entry.is_ended() && !entry.lost.is_cancelled())
            else {
                answers[i] = Some(Ok(Renewal::Lost));
                continue;
            };
            match groups.iter_mut().find(|(s, _)| Arc::ptr_eq(s, &session)) {
                Some((_, items)) => items.push((i, entry, *ttl)),
                None => groups.push((session, vec![(i, entry, *ttl)])),
            }
        }
        for (session, items) in groups {
            for chunk in items.chunks(PER_TXN) {
                let reads: Vec<TxnOp> = chunk
                    .iter()
                    .map(|(_, e, _)| {
                        TxnOp::get(e.key.as_str(), Some(GetOptions::new().with_keys_only()))
                    })
                    .collect();
                let sent = Instant::now();
                let mut kv = session.client.kv_client();
                match session.call(kv.txn(Txn::new().and_then(reads))).await {
                    Ok(response) => {
                        let results = response.op_responses();
                        for (n, (i, entry, ttl)) in chunk.iter().enumerate() {
                            let ours = match results.get(n) {
                                Some(TxnOpResponse::Get(get)) => {
                                    get.kvs().first().is_some_and(|e| {
                                        e.create_revision() == entry.revision
                                            && e.lease() == session.lease_id
                                    })
                                }
                                _ => false,
                            };
                            answers[*i] = Some(Ok(
                                if ours && session.is_alive() && session.extend(entry, sent, *ttl) {
                                    Renewal::Renewed
                                } else {
                                    session.unregister(entry);
                                    Renewal::Lost
                                },
                            ));
                        }
                    }
                    Err(_) if !session.is_alive() => {
                        for (i, _, _) in chunk {
                            answers[*i] = Some(Ok(Renewal::Lost));
                        }
                    }
                    Err(err) => {
                        let err = backend_error("renewal", err);
                        for (i, _, _) in chunk {
                            answers[*i] = Some(Err(if err.is_retryable() {
                                BackendError::transient(err.to_string())
                            } else {
                                BackendError::permanent(err.to_string())
                            }));
                        }
                    }
                }
            }
        }
        answers
            .into_iter()
            .map(|a| a.unwrap_or_else(|| Err(BackendError::permanent("etcd: no answer"))))
            .collect()
    }
}

pub(super) fn held_entry(lease: &Lease) -> Option<Arc<HeldEntry>> {
    lease.extra.clone()?.downcast::<HeldEntry>().ok()
}
