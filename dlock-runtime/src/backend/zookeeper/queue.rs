//! The order of a key's queue: by sequence number while the suffixes give
//! it, else by `czxid`, read in one multi-read.

use std::sync::Arc;
use std::time::Instant;

use zookeeper_client::{Error as ZkError, MultiReadResult};

use super::Inner;
use super::acquire::OurNode;
use super::path;
use super::session::Session;

impl Inner {
    /// The lock children of `children` in creation order (see
    /// [`path::position`]): ranked by sequence number while those give the
    /// order, else by `czxid`, read for every other child in one multi-read
    /// (children gone meanwhile are left out).
    pub(super) async fn queue(
        &self,
        session: &Arc<Session>,
        container: &str,
        children: &[String],
        ours: &OurNode,
    ) -> Result<Vec<(String, i64)>, ZkError> {
        let locks: Vec<(&String, i32)> = children
            .iter()
            .filter_map(|name| Some((name, path::sequence_of(name)?)))
            .collect();
        if path::in_sequence_order(locks.iter().map(|(_, seq)| *seq)) {
            return Ok(locks
                .into_iter()
                .map(|(name, seq)| (name.clone(), i64::from(seq)))
                .collect());
        }
        let others: Vec<&String> = locks
            .iter()
            .map(|(name, _)| *name)
            .filter(|name| **name != ours.name)
            .collect();
        let mut queue = Vec::with_capacity(locks.len());
        if others.len() < locks.len() {
            queue.push((ours.name.clone(), ours.czxid));
        }
        if others.is_empty() {
            return Ok(queue);
        }
        let mut reader = session.client.new_multi_reader();
        for name in &others {
            reader.add_get_data(&format!("{container}/{name}"))?;
        }
        let sent = Instant::now();
        let request = reader.commit();
        let results = session.finish(sent, request).await?;
        if results.len() != others.len() {
            return Err(ZkError::UnexpectedError(
                "short multi-read answer".to_owned(),
            ));
        }
        for (name, result) in others.into_iter().zip(results) {
            match result {
                MultiReadResult::Data { stat, .. } => queue.push((name.clone(), stat.czxid)),
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
        Ok(queue)
    }
}
