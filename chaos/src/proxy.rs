//! The TCP fault proxy between one worker and the lock server: delays,
//! holds (a partition) and resets, from the crate the tests share.

pub(crate) use dlock_testkit::{Fault, FaultProxy as Proxy};
