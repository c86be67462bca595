//! Semaphores in Curator's `InterProcessSemaphoreV2` layout: one
//! `EPHEMERAL_SEQUENTIAL` lease node per permit holder under the key's
//! `leases` child, holding the owner, the holder's record, the number of
//! permits and the slot.
//!
//! **Grant rule.** An attempt reads the leases, picks the lowest slot no
//! dlock lease carries, creates its lease, and reads the leases again (the
//! listing sent with the create, in its round trip; only leases not read
//! before are read in full): it
//! holds a permit if there are at most `permits` leases and no lease
//! created before it (lower `czxid`) carries its slot. Otherwise it deletes
//! its lease before answering (busy, or trying another slot at once). This
//! is Curator's own rule (its acquirer holds once the leases number at most
//! `maxLeases`, its lease counted), and it holds without Curator's `locks`
//! mutex: of any set of holders, the one that read the leases last saw
//! every other holder's lease, so they are at most `permits`.
//!
//! **Waiters queue in Curator's `locks` mutex.** An attempt that finds the
//! permits taken, or anyone queued in the key's `locks` child, queues there
//! as a mutex contender (`_c_{guid}-lock-{sequence}`, the names Curator's
//! `InterProcessMutex` gives, in the plain lock's queue code). The first in
//! that queue reads the leases, takes a permit if one is free, and leaves
//! the queue (which wakes the next one); else it sets a data watch on each
//! lease it read (Curator's mutex holder watches the leases' children) —
//! the only waiter that watches leases. A lease's deletion names the lease,
//! hence its slot: the woken waiter, still first (nodes queue behind it),
//! creates its lease on that slot at once, without reading the queue or the
//! leases first, and the listing sent with the create is its only read
//! (the grant rule holds as ever: the slot read is checked after the
//! create). Its watches on the other leases are removed then. Every other
//! waiter watches only the node ahead of it. So a release wakes
//! one waiter, which creates one lease, and waiters are served first come
//! first served, a slow connection included. An attempt with nobody queued
//! takes a free permit without queueing (one read more than before, none
//! of the mutex's writes). A Curator acquirer sees dlock's waiters as holders
//! of its mutex ahead of it, and dlock's waiters wait for Curator's. dlock's
//! first waiter holds no lease while it waits: a Curator acquirer creates
//! its lease only once it holds the mutex, and waits with it until the
//! leases are at most its permits; were a dlock waiter's lease counted
//! there while that waiter waited behind the Curator acquirer in the
//! mutex, each would wait for the other. With dlock's waiters lease-less,
//! whoever holds the mutex waits only for holders, which leave.
//!
//! **Permits and modes.** Curator stores no `maxLeases`; dlock stores it in
//! every lease it creates, and an attempt that finds a dlock lease with
//! another number, or lock nodes on the key itself (a plain lock, a reader
//! or a writer), deletes its lease and answers the mismatch. A plain lock
//! or a reader that finds leases on its key does the same. Each side checks
//! after its own create, so of two racing attempts at least one sees the
//! other.
//!
//! **Token**: the lease's `czxid`, strictly increasing per key, so per
//! (key, slot) too.

use std::sync::Arc;
use std::time::{Duration, Instant};

use zookeeper_client::{Acls, CreateMode, Error as ZkError, MultiReadResult, Stat};

use super::acquire::{OurNode, Pending, Turn, unavailable, unavailable_or_failed};
use super::path;
use super::release::{delete_by_guid, delete_node};
use super::session::{Session, delete_until_gone};
use super::{Inner, MAX_STEPS};
use crate::backend::{AcquireRequest, Attempt, HoldMode};
use crate::error::BackendError;

/// The start of the line dlock appends to a lease's data.
const PERMIT_LINE: &str = "dlock-permit ";

/// The data of a dlock lease: the lock node's data, then the permits and
/// the slot on a line of their own.
fn lease_data(node_data: &[u8], permits: u32, slot: u32) -> Vec<u8> {
    let mut data = node_data.to_vec();
    data.extend_from_slice(format!("\n{PERMIT_LINE}{permits} {slot}").as_bytes());
    data
}

/// The permits and slot a dlock lease carries, and the data before them
/// (the owner and the holder's record); `None` for a Curator lease.
pub(super) fn lease_info(data: &[u8]) -> Option<(u32, u32, &[u8])> {
    let at = data.iter().rposition(|b| *b == b'\n')?;
    let line = std::str::from_utf8(&data[at + 1..]).ok()?;
    let (permits, slot) = line.strip_prefix(PERMIT_LINE)?.split_once(' ')?;
    Some((permits.parse().ok()?, slot.parse().ok()?, &data[..at]))
}

/// A lease node read.
#[derive(Clone)]
pub(super) struct LeaseNode {
    pub(super) name: String,
    pub(super) data: Vec<u8>,
    pub(super) stat: Stat,
}

impl LeaseNode {
    fn info(&self) -> Option<(u32, u32)> {
        lease_info(&self.data).map(|(permits, slot, _)| (permits, slot))
    }
}

/// Why an acquisition may not go on beside the key's other holders.
pub(super) enum Refusal {
    /// Holders of another kind: the caller's configuration error.
    Config(BackendError),
    /// The server could not be asked.
    Zk(ZkError),
}

impl From<ZkError> for Refusal {
    fn from(err: ZkError) -> Self {
        Refusal::Zk(err)
    }
}

/// The mode the leases `held` are held in (Curator's leases say nothing
/// of their number: at least two, and at least as many as there are).
fn held_as(held: &[LeaseNode]) -> HoldMode {
    let permits = held
        .iter()
        .find_map(LeaseNode::info)
        .map_or_else(|| (held.len() as u32).max(2), |(permits, _)| permits);
    HoldMode::Permit { permits }
}

/// The lowest slot below `permits` that no lease of `leases` carries.
fn free_slot(leases: &[LeaseNode], permits: u32) -> u32 {
    (0..permits)
        .find(|slot| {
            !leases
                .iter()
                .any(|l| l.info().is_some_and(|(_, s)| s == *slot))
        })
        .unwrap_or(0)
}

impl Inner {
    /// The lease nodes under `leases`, in creation order (`czxid`), read in
    /// one multi-read; empty when it does not exist.
    pub(super) async fn read_leases(
        &self,
        session: &Arc<Session>,
        leases: &str,
    ) -> Result<Vec<LeaseNode>, ZkError> {
        let nodes = session
            .read_children(leases, |n| path::lease_sequence_of(n).is_some())
            .await?;
        Ok(nodes
            .into_iter()
            .map(|(name, data, stat)| LeaseNode { name, data, stat })
            .collect())
    }

    /// The lease nodes under `leases` whose names were `listed`, in
    /// creation order, as [`read_leases`](Self::read_leases) answers them,
    /// reading the data of only those not in `known`: a lease's data and
    /// creation are fixed once it exists (nothing writes a lease node), so
    /// the nodes of a read a moment ago need no second read. No round trip
    /// when every lease listed is known.
    async fn leases_listed(
        &self,
        session: &Arc<Session>,
        leases: &str,
        listed: Result<Vec<String>, ZkError>,
        known: &[LeaseNode],
    ) -> Result<Vec<LeaseNode>, ZkError> {
        let names = match listed {
            Ok(names) => names,
            Err(ZkError::NoNode) => return Ok(Vec::new()),
            Err(err) => return Err(err),
        };
        let mut nodes = Vec::with_capacity(names.len());
        let mut unknown = Vec::new();
        for name in names {
            if path::lease_sequence_of(&name).is_none() {
                continue;
            }
            match known.iter().find(|k| k.name == name) {
                Some(node) => nodes.push(node.clone()),
                None => unknown.push(name),
            }
        }
        if !unknown.is_empty() {
            let mut reader = session.client.new_multi_reader();
            for name in &unknown {
                reader.add_get_data(&format!("{leases}/{name}"))?;
            }
            let sent = Instant::now();
            let request = reader.commit();
            let results = session.finish(sent, request).await?;
            for (name, result) in unknown.into_iter().zip(results) {
                match result {
                    MultiReadResult::Data { data, stat } => {
                        nodes.push(LeaseNode { name, data, stat })
                    }
                    MultiReadResult::Error {
                        err: ZkError::NoNode,
                    } => {}
                    MultiReadResult::Error { err } => return Err(err),
                    other => {
                        return Err(ZkError::UnexpectedError(format!(
                            "unexpected multi-read answer {other:?}"
                        )));
                    }
                }
            }
        }
        nodes.sort_by_key(|n| n.stat.czxid);
        Ok(nodes)
    }

    /// A plain lock or a reader whose node is `node`, on a key whose node
    /// has a `leases` child: refused (its node deleted) if a lease is there.
    pub(super) async fn refuse_beside_leases(
        &self,
        session: &Arc<Session>,
        pending: &Pending,
        node: &OurNode,
        request: &AcquireRequest,
    ) -> Result<(), Refusal> {
        let leases = format!("{}/{}", pending.key_container, path::LEASES);
        let held = self.read_leases(session, &leases).await?;
        if held.is_empty() {
            return Ok(());
        }
        let ours = format!("{}/{}", pending.container, node.name);
        delete_until_gone(session, &ours, Some(Instant::now() + session.op_timeout)).await?;
        pending.forget_node();
        pending.state().maybe_created = false;
        Err(Refusal::Config(BackendError::config(HoldMode::mismatch(
            &request.key,
            held_as(&held),
            request.mode,
        ))))
    }

    /// One attempt for a permit: see the module docs.
    pub(super) async fn attempt_permit(
        self: &Arc<Self>,
        request: &AcquireRequest,
        permits: u32,
    ) -> Result<Attempt, BackendError> {
        let started = Instant::now();
        let pending = self.pending_for(request);
        if let Some(busy) = pending.still_behind() {
            return Ok(busy);
        }
        let session = match self.session().await {
            Ok(session) => session,
            Err(error) => return unavailable_or_failed(error),
        };
        pending.on_session(&session);
        let leases = pending.leases.clone().unwrap_or_default();
        // Woken first in the queue by a lease's deletion: no need to read the
        // queue (nodes queue behind ours) nor the leases (the freed one names
        // its slot) before our lease is created.
        let mut woken = pending.take_freed(&session);
        for _ in 0..MAX_STEPS {
            let freed = woken.take();
            let queued = {
                let st = pending.state();
                st.node.is_some() || st.maybe_created
            };
            if freed.is_none() && !queued {
                // Nobody queued: take a free permit at once.
                let waiting = match session.call(|c| c.list_children(&pending.container)).await {
                    Ok(names) => names.iter().any(|n| path::sequence_of(n).is_some()),
                    Err(ZkError::NoNode) => false,
                    Err(err) => return unavailable("reading the semaphore's queue", err),
                };
                if !waiting {
                    match self
                        .permit_step(&session, &pending, request, permits, None)
                        .await
                    {
                        Ok(Step::Held(node, slot)) => {
                            return Ok(self
                                .grant_permit(request, &pending, &session, &node, slot, started));
                        }
                        Ok(Step::Again) => continue,
                        Ok(Step::Full(_)) => {}
                        Err(refusal) => return self.refused(request, refusal).await,
                    }
                }
                if request.wait.is_zero() {
                    return Ok(Attempt::Busy { retry_in: None });
                }
            }
            if freed.is_none()
                && let Turn::Answer(answer) = self.take_turn(&session, &pending, request).await
            {
                return answer;
            }
            // First in the queue: ours is the next permit.
            match self
                .permit_step(&session, &pending, request, permits, freed)
                .await
            {
                Ok(Step::Held(node, slot)) => {
                    let queued = pending.state().node.clone();
                    if let Some(queued) = queued {
                        // Leaving the queue wakes the next waiter. The delete
                        // is sent now, before the grant is answered (so before
                        // any later request of this session, which the server
                        // runs in order), and its answer is not waited for: a
                        // delete that fails goes on in the background.
                        let queued = format!("{}/{}", pending.container, queued.name);
                        let sent = Instant::now();
                        let delete = session.client.delete(&queued, None);
                        let session = session.clone();
                        crate::driver::handle().spawn(async move {
                            match session.finish(sent, delete).await {
                                Ok(()) | Err(ZkError::NoNode) => {}
                                Err(_) => {
                                    let _ = delete_node(session, queued).await;
                                }
                            }
                        });
                        pending.forget_node();
                    }
                    return Ok(self.grant_permit(request, &pending, &session, &node, slot, started));
                }
                Ok(Step::Again) => {}
                Ok(Step::Full(seen)) => {
                    // Only the first waiter watches the leases: each one (a
                    // data watch, as the queue's), so that a deletion names
                    // the slot it frees. Every watch set on a lease that
                    // exists: the leases were full then, and a permit frees
                    // only when one of them goes.
                    let paths: Vec<String> = seen
                        .iter()
                        .map(|l| format!("{leases}/{}", l.name))
                        .collect();
                    let sent = Instant::now();
                    let requests: Vec<_> = paths
                        .iter()
                        .map(|p| session.client.get_and_watch_data(p))
                        .collect();
                    let mut watchers = Vec::with_capacity(seen.len());
                    let mut gone = false;
                    for (lease, request) in seen.iter().zip(requests) {
                        match session.finish(sent, request).await {
                            Ok((_, _, watcher)) => watchers.push((lease.name.clone(), watcher)),
                            Err(ZkError::NoNode) => gone = true,
                            Err(err) => {
                                return unavailable("watching the semaphore's leases", err);
                            }
                        }
                    }
                    if !gone && !watchers.is_empty() {
                        self.keep_lease_watches(&pending, leases.clone(), seen, watchers);
                        return Ok(Attempt::Busy {
                            retry_in: Some(session.timeout),
                        });
                    }
                    // A lease went meanwhile (the watches set are removed
                    // with their watchers): look again.
                }
                Err(refusal) => return self.refused(request, refusal).await,
            }
        }
        Ok(Attempt::Busy {
            retry_in: Some(Duration::ZERO),
        })
    }

    /// The grant of our lease `node` on `slot`.
    fn grant_permit(
        &self,
        request: &AcquireRequest,
        pending: &Pending,
        session: &Arc<Session>,
        node: &OurNode,
        slot: u32,
        started: Instant,
    ) -> Attempt {
        let leases = pending.leases.as_deref().unwrap_or_default();
        let path = format!("{leases}/{}", node.name);
        Attempt::Held(
            self.grant(request, session, path, node, node.czxid, started)
                .with_slot(slot),
        )
    }

    /// The answer to a refused permit attempt: its place in the queue is
    /// given up first on a mismatch (which ends the acquisition).
    async fn refused(
        &self,
        request: &AcquireRequest,
        refusal: Refusal,
    ) -> Result<Attempt, BackendError> {
        match refusal {
            Refusal::Config(error) => {
                let _ = self.drop_pending(&request.owner).await;
                Err(error)
            }
            Refusal::Zk(err) => unavailable("taking a permit", err),
        }
    }

    /// Reads the leases (or, woken by the deletion of `freed`'s named
    /// lease, takes the others it had read), creates our lease, reads again;
    /// deletes it unless it holds.
    async fn permit_step(
        &self,
        session: &Arc<Session>,
        pending: &Pending,
        request: &AcquireRequest,
        permits: u32,
        freed: Option<(Vec<LeaseNode>, String)>,
    ) -> Result<Step, Refusal> {
        self.clear_leftover(session, pending).await?;
        let asked = HoldMode::Permit { permits };
        let mismatch = |held: HoldMode| {
            Refusal::Config(BackendError::config(HoldMode::mismatch(
                &request.key,
                held,
                asked,
            )))
        };
        let leases = pending.leases.as_deref().unwrap_or_default();
        let (before, freed_slot) = match freed {
            Some((known, freed)) => {
                let slot = known
                    .iter()
                    .find(|l| l.name == freed)
                    .and_then(LeaseNode::info)
                    .map(|(_, slot)| slot);
                let rest: Vec<LeaseNode> = known.into_iter().filter(|l| l.name != freed).collect();
                (rest, slot)
            }
            None => (self.read_leases(session, leases).await?, None),
        };
        if let Some((other, _)) = before
            .iter()
            .filter_map(LeaseNode::info)
            .find(|(n, _)| *n != permits)
        {
            return Err(mismatch(HoldMode::Permit { permits: other }));
        }
        if before.len() >= permits as usize {
            return Ok(Step::Full(before));
        }
        // The freed lease's slot, unless another lease read carries it.
        let slot = freed_slot
            .filter(|slot| {
                *slot < permits
                    && !before
                        .iter()
                        .any(|l| l.info().is_some_and(|(_, s)| s == *slot))
            })
            .unwrap_or_else(|| free_slot(&before, permits));
        let (node, created, listed) = self.create_lease(session, pending, permits, slot).await?;
        let ours = format!("{leases}/{}", node.name);
        // The leases read before, and ours as created: only leases created
        // since are read in full.
        let mut known = before;
        known.push(created);
        let after = self
            .leases_listed(session, leases, listed.leases, &known)
            .await;
        let locks = listed.locks;
        let outcome = (|| {
            let after = after?;
            let locks = match locks {
                Ok(names) => names,
                Err(ZkError::NoNode) => Vec::new(),
                Err(err) => return Err(Refusal::Zk(err)),
            };
            let lock_nodes: Vec<&String> = locks
                .iter()
                .filter(|n| path::sequence_of(n).is_some())
                .collect();
            if !lock_nodes.is_empty() {
                let held = if lock_nodes.iter().all(|n| path::is_reader(n)) {
                    HoldMode::Shared
                } else {
                    HoldMode::Exclusive
                };
                return Err(mismatch(held));
            }
            let others: Vec<&LeaseNode> = after.iter().filter(|l| l.name != node.name).collect();
            if let Some((other, _)) = others
                .iter()
                .filter_map(|l| l.info())
                .find(|(n, _)| *n != permits)
            {
                return Err(mismatch(HoldMode::Permit { permits: other }));
            }
            if !after.iter().any(|l| l.name == node.name) {
                return Ok(Step::Again);
            }
            let taken = others
                .iter()
                .any(|l| l.stat.czxid < node.czxid && l.info().is_some_and(|(_, s)| s == slot));
            if taken {
                return Ok(Step::Again);
            }
            if after.len() > permits as usize {
                return Ok(Step::Full(
                    after
                        .iter()
                        .filter(|l| l.name != node.name)
                        .cloned()
                        .collect(),
                ));
            }
            Ok(Step::Held(node.clone(), slot))
        })();
        if matches!(outcome, Ok(Step::Held(..))) {
            return outcome;
        }
        delete_until_gone(session, &ours, Some(Instant::now() + session.op_timeout)).await?;
        pending.state().lease = None;
        outcome
    }

    /// Deletes what an earlier attempt of this acquisition may have left: a
    /// lease whose create's answer was not seen, or one not deleted yet.
    async fn clear_leftover(
        &self,
        session: &Arc<Session>,
        pending: &Pending,
    ) -> Result<(), ZkError> {
        let leases = pending.leases.as_deref().unwrap_or_default();
        let (lease, maybe_created) = {
            let st = pending.state();
            (st.lease.clone(), st.lease_maybe_created)
        };
        if let Some(lease) = lease {
            let path = format!("{leases}/{}", lease.name);
            delete_until_gone(session, &path, Some(Instant::now() + session.op_timeout)).await?;
            pending.state().lease = None;
        }
        if maybe_created {
            delete_by_guid(session.clone(), leases.to_owned(), pending.guid.clone())
                .await
                .map_err(|e| ZkError::UnexpectedError(e.to_string()))?;
            pending.state().lease_maybe_created = false;
        }
        Ok(())
    }

    /// Creates our lease (and the key's node and its `leases` child, as
    /// containers, when missing): our node, the lease as created, and the
    /// listings sent with the create, which the server reads after it (one
    /// session's requests are served in order), in the same round trip.
    async fn create_lease(
        &self,
        session: &Arc<Session>,
        pending: &Pending,
        permits: u32,
        slot: u32,
    ) -> Result<(OurNode, LeaseNode, Listed), ZkError> {
        let leases = pending.leases.as_deref().unwrap_or_default();
        let prefix = path::lease_prefix(leases, &pending.guid);
        let data = lease_data(&pending.data, permits, slot);
        let options = CreateMode::EphemeralSequential.with_acls(Acls::anyone_all());
        for _ in 0..MAX_STEPS {
            pending.state().lease_maybe_created = true;
            let sent = Instant::now();
            let create = session.client.create(&prefix, &data, &options);
            let listed_leases = session.client.list_children(leases);
            let listed_locks = session.client.list_children(&pending.key_container);
            match session.finish(sent, create).await {
                Ok((stat, sequence)) => {
                    let node = OurNode {
                        name: format!("{}{sequence}", &prefix[leases.len() + 1..]),
                        czxid: stat.czxid,
                    };
                    self.counters
                        .nodes_created
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    {
                        let mut st = pending.state();
                        st.lease = Some(node.clone());
                        st.lease_maybe_created = false;
                    }
                    let created = LeaseNode {
                        name: node.name.clone(),
                        data,
                        stat,
                    };
                    let listed = Listed {
                        leases: session.finish(sent, listed_leases).await,
                        locks: session.finish(sent, listed_locks).await,
                    };
                    return Ok((node, created, listed));
                }
                Err(ZkError::NoNode) => {
                    pending.state().lease_maybe_created = false;
                    self.create_container(session, &pending.key_container)
                        .await?;
                    self.create_container(session, leases).await?;
                }
                Err(err) => return Err(err),
            }
        }
        Err(ZkError::UnexpectedError(format!(
            "the container {leases} kept disappearing"
        )))
    }
}

/// The listings sent with our lease's create: the leases' names and the
/// key's children.
struct Listed {
    leases: Result<Vec<String>, ZkError>,
    locks: Result<Vec<String>, ZkError>,
}

/// What one step of a permit attempt found.
enum Step {
    /// Our lease holds this slot.
    Held(OurNode, u32),
    /// Every permit is taken (our lease, if created, is deleted): by the
    /// other leases read.
    Full(Vec<LeaseNode>),
    /// Our slot was taken first, or our lease vanished: try again now.
    Again,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lease_data_carries_permits_and_slot_after_the_record() {
        let data = lease_data(b"owner\n1 42 host name", 5, 3);
        assert_eq!(
            lease_info(&data),
            Some((5, 3, &b"owner\n1 42 host name"[..]))
        );
        assert_eq!(lease_info(b"127.0.0.1"), None);
        assert_eq!(lease_info(b"a\nb"), None);
    }

    fn lease(name: &str, czxid: i64, data: Vec<u8>) -> LeaseNode {
        LeaseNode {
            name: name.to_owned(),
            data,
            stat: Stat {
                czxid,
                mzxid: czxid,
                pzxid: czxid,
                ctime: 0,
                mtime: 0,
                version: 0,
                cversion: 0,
                aversion: 0,
                ephemeral_owner: 1,
                data_length: 0,
                num_children: 0,
            },
        }
    }

    #[test]
    fn the_lowest_free_slot_is_taken_and_curator_leases_carry_none() {
        let leases = [
            lease("a", 1, lease_data(b"x", 3, 0)),
            lease("b", 2, b"127.0.0.1".to_vec()),
            lease("c", 3, lease_data(b"y", 3, 2)),
        ];
        assert_eq!(free_slot(&leases, 3), 1);
        assert_eq!(free_slot(&leases[1..2], 3), 0);
        assert_eq!(held_as(&leases), HoldMode::Permit { permits: 3 });
        assert_eq!(held_as(&leases[1..2]), HoldMode::Permit { permits: 2 });
    }
}
