//! What the fencing kit's tests share.

use dlock_runtime::{FencingToken, LockError};

/// Asserts that a fenced write was refused as stale: `Fenced` for `resource`,
/// carrying the `stale` token and the larger token `seen`.
pub fn assert_fenced(result: Result<(), LockError>, resource: &str, stale: u64, seen: u64) {
    match result {
        Err(LockError::Fenced {
            resource: r,
            token,
            seen: s,
        }) => {
            assert_eq!(r, resource);
            assert_eq!(token, FencingToken::new(stale));
            assert_eq!(s, Some(FencingToken::new(seen)));
        }
        other => panic!("expected Fenced for {resource}, got {other:?}"),
    }
}
