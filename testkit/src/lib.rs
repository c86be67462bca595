//! What dlock's tests and its chaos harness share: a TCP fault proxy
//! ([`proxy`]), which a protocol's [`RequestFilter`] can make cut a
//! connection just after a given request, a `redis-server` launcher
//! ([`redis_server`]) and a ZooKeeper launcher ([`zookeeper_server`]).

#![forbid(unsafe_code)]

pub mod proxy;
pub mod redis_server;
pub mod zookeeper_server;

pub use proxy::{Fault, FaultProxy, RequestFilter, Verdict};

use std::future::Future;
use std::time::{Duration, Instant};

/// Asks `probe` every `every` until it answers true, for up to `within`;
/// whether it did.
async fn poll<F, Fut>(within: Duration, every: Duration, mut probe: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if probe().await {
            return true;
        }
        tokio::time::sleep(every).await;
    }
    false
}
