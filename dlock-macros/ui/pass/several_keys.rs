// `keys = [..]`: one hold of several keys, with every return type mapping.
use dlock_runtime::{LockError, distributed_lock};

pub struct Acct {
    pub id: u32,
}

#[distributed_lock(keys = ["acct:{from.id}", "acct:{to.id}"], wait = "1s")]
pub async fn transfer(from: &Acct, to: &Acct, amount: u64) -> Result<u64, LockError> {
    Ok(amount)
}

#[distributed_lock(keys = ["report:{day}"], on_busy = "skip")]
pub async fn one_key_in_a_list(day: u32) -> Option<u32> {
    Some(day)
}

#[tokio::main]
async fn main() {
    let r = transfer(&Acct { id: 1 }, &Acct { id: 2 }, 5).await;
    assert!(matches!(r, Err(LockError::NotInitialized)), "{r:?}");
    assert_eq!(one_key_in_a_list(3).await, None);
}
