//! What dlock's tests and its chaos harness share: a TCP fault proxy
//! ([`proxy`]), which a protocol's [`RequestFilter`] can make cut a
//! connection just after a given request, a `redis-server` launcher
//! ([`redis_server`]) and a ZooKeeper launcher ([`zookeeper_server`]).

#![forbid(unsafe_code)]

pub mod proxy;
pub mod redis_server;
pub mod zookeeper_server;

pub use proxy::{Fault, FaultProxy, RequestFilter, Verdict};
