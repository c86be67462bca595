//! What dlock's tests and its chaos harness share: a TCP fault proxy
//! ([`proxy`]) and a `redis-server` launcher ([`redis_server`]).

#![forbid(unsafe_code)]

pub mod proxy;
pub mod redis_server;

pub use proxy::{Fault, FaultProxy};
