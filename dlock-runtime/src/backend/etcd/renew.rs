//! Renewal, batched: one read transaction per 64 entries that checks every
//! held entry (and a permit's slot claim) still exists, is ours and is
//! under the session's lease, and —
//! when the session's etcd lease could end before the longest lease renewed
//! (`last keep-alive answered + TTL` earlier than its new end) — one
//! keep-alive of it, sent by its keeper after the batch started. A lease is
//! renewed only when both answered: etcd then keeps its entry at least until
//! the lease's new end.
//!
//! An entry read as gone was revoked when the revocation's mark for it is
//! there (see `admin.rs`): the renewal answers
//! [`Renewal::Revoked`](crate::backend::Renewal::Revoked), else
//! [`Renewal::Lost`](crate::backend::Renewal::Lost). The mark is read and
//! deleted in one transaction, sent only when an entry is gone.
//!
//! A permit found lost has what is left of it — its slot claim whose entry
//! went, or its entry whose claim went — deleted at once, in the
//! background: its slot is free for others from the loss, not from the
//! lost holder's release (its body may run on a while).

use std::sync::Arc;
use std::time::{Duration, Instant};

use etcd_client::{GetOptions, Txn, TxnOp, TxnOpResponse};

use super::session::{HeldEntry, Session, delete_entry};
use super::url::revocation_mark;
use super::{Inner, backend_error};
use crate::backend::{Lease, Renewal};
use crate::error::BackendError;

/// Entries checked by one transaction (etcd refuses more than 128
/// operations; a permit's entry takes two, with its slot claim).
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
            let started = Instant::now();
            let longest = items
                .iter()
                .map(|(_, _, ttl)| *ttl)
                .max()
                .unwrap_or_default();
            let kept = async {
                // A keep-alive is needed only when the session's lease could
                // end before the longest renewed lease (a lease close to the
                // session TTL); short leases renew with the reads alone.
                session.outlasts(crate::time::saturating_add(started, longest))
                    || session
                        .keep_alive_since(started, started + session.op_timeout)
                        .await
            };
            let reads = async {
                let mut answers = Vec::new();
                for chunk in items.chunks(PER_TXN) {
                    answers.push(self.read_chunk(&session, chunk).await);
                }
                answers
            };
            let (kept, read) = tokio::join!(kept, reads);
            for (chunk, read) in items.chunks(PER_TXN).zip(read) {
                // Rare: only a chunk with an entry gone asks whether a
                // revocation took it.
                let revoked = match &read {
                    Ok(ours) if session.is_alive() && ours.contains(&false) => {
                        revoked_among(&session, chunk, ours).await
                    }
                    _ => Ok(vec![false; chunk.len()]),
                };
                for (n, (i, entry, ttl)) in chunk.iter().enumerate() {
                    answers[*i] = Some(match &read {
                        // The entry is gone, but whether a revocation took
                        // it is not known yet: asked again at the next
                        // renewal (the entry stays registered), until the
                        // holder's give-up instant.
                        Ok(ours) if !ours[n] && session.is_alive() && revoked.is_err() => {
                            Err(BackendError::transient(format!(
                                "etcd: the entry is gone and its revocation mark could not be \
                                 read: {}",
                                revoked
                                    .as_ref()
                                    .err()
                                    .map(ToString::to_string)
                                    .unwrap_or_default()
                            )))
                        }
                        Ok(ours) if !ours[n] || !session.is_alive() => {
                            session.unregister(entry);
                            if entry.slot.is_some() && session.is_alive() {
                                // What is left of a lost permit — its slot
                                // claim whose entry went, or its entry whose
                                // claim went — goes now, not at the guard's
                                // release: the holder is told, and the slot
                                // is for others from here.
                                let (session, entry) = (session.clone(), entry.clone());
                                crate::driver::handle().spawn(async move {
                                    let slot = entry.slot.as_ref();
                                    let _ = delete_entry(
                                        &session,
                                        &entry.key,
                                        entry.revision,
                                        slot,
                                        None,
                                    )
                                    .await;
                                });
                            }
                            if revoked.as_ref().is_ok_and(|r| r[n]) {
                                Ok(Renewal::Revoked)
                            } else {
                                Ok(Renewal::Lost)
                            }
                        }
                        Ok(_) if !kept => Err(BackendError::transient(
                            "etcd: no keep-alive of the session's lease answered in time",
                        )),
                        Ok(_) if session.extend(entry, started, *ttl) => Ok(Renewal::Renewed),
                        Ok(_) => Ok(Renewal::Lost),
                        Err(_) if !session.is_alive() => Ok(Renewal::Lost),
                        Err(err) if err.is_retryable() => {
                            Err(BackendError::transient(err.to_string()))
                        }
                        Err(err) => Err(BackendError::permanent(err.to_string())),
                    });
                }
            }
        }
        answers
            .into_iter()
            .map(|a| a.unwrap_or_else(|| Err(BackendError::permanent("etcd: no answer"))))
            .collect()
    }

    /// Whether each entry of `chunk` is still ours, read in one transaction.
    async fn read_chunk(
        &self,
        session: &Session,
        chunk: &[(usize, Arc<HeldEntry>, Duration)],
    ) -> Result<Vec<bool>, BackendError> {
        // Served by the member itself, without a round to the leader: a
        // member cut off from it (or a lagging one) is caught by the
        // keep-alive the session needs, and an entry deleted behind our
        // back is seen one replication later.
        let options = || Some(GetOptions::new().with_keys_only().with_serializable());
        let mut reads: Vec<TxnOp> = Vec::new();
        for (_, e, _) in chunk {
            reads.push(TxnOp::get(e.key.as_str(), options()));
            if let Some(claim) = &e.slot {
                reads.push(TxnOp::get(claim.key.as_str(), options()));
            }
        }
        let mut kv = session.client.kv_client();
        let response = session
            .call(kv.txn(Txn::new().and_then(reads)))
            .await
            .map_err(|err| backend_error("renewal", err))?;
        let mut results = response.op_responses().into_iter();
        let mut ours = |revision: i64| match results.next() {
            Some(TxnOpResponse::Get(get)) => get
                .kvs()
                .first()
                .is_some_and(|e| e.create_revision() == revision && e.lease() == session.lease_id),
            _ => false,
        };
        Ok(chunk
            .iter()
            .map(|(_, entry, _)| {
                let entry_ours = ours(entry.revision);
                let claim_ours = entry.slot.as_ref().is_none_or(|c| ours(c.revision));
                entry_ours && claim_ours
            })
            .collect())
    }
}

/// For each entry of `chunk` that is no longer ours (`ours[n]` false):
/// whether a revocation took it, read from the mark the revocation left
/// (its value is the entry's create revision; read, not deleted: a read
/// whose answer was lost can be made again, and the hold's release deletes
/// the mark with the entry). An error when the marks cannot be
/// read: the caller asks again at the next renewal rather than call a
/// revoked holder's loss another end.
async fn revoked_among(
    session: &Session,
    chunk: &[(usize, Arc<HeldEntry>, Duration)],
    ours: &[bool],
) -> Result<Vec<bool>, BackendError> {
    let gone: Vec<(usize, String, i64)> = chunk
        .iter()
        .enumerate()
        .filter(|(n, _)| !ours[*n])
        .filter_map(|(n, (_, entry, _))| Some((n, revocation_mark(&entry.key)?, entry.revision)))
        .collect();
    let mut revoked = vec![false; chunk.len()];
    let reads: Vec<TxnOp> = gone
        .iter()
        .map(|(_, mark, _)| TxnOp::get(mark.as_str(), None))
        .collect();
    let mut kv = session.client.kv_client();
    let response = session
        .call(kv.txn(Txn::new().and_then(reads)))
        .await
        .map_err(|e| BackendError::transient(e.to_string()))?;
    for ((n, _, revision), answer) in gone.iter().zip(response.op_responses()) {
        if let TxnOpResponse::Get(read) = answer {
            revoked[*n] = read
                .kvs()
                .first()
                .is_some_and(|mark| mark.value() == revision.to_string().as_bytes());
        }
    }
    Ok(revoked)
}

pub(super) fn held_entry(lease: &Lease) -> Option<Arc<HeldEntry>> {
    lease.extra.clone()?.downcast::<HeldEntry>().ok()
}
