// `permits = N` and `mode = "read" | "write"`, with `key` and with `keys`.
use dlock_runtime::{LockError, distributed_lock};

#[distributed_lock(key = "payments:{provider}", permits = 3, wait = "1s")]
pub async fn call_provider(provider: &str) -> Result<usize, LockError> {
    Ok(provider.len())
}

#[distributed_lock(key = "k", permits = 1)]
pub async fn one_permit() -> Result<(), LockError> {
    Ok(())
}

#[distributed_lock(key = "k", permits = 1024, on_busy = "skip")]
pub async fn most_permits() -> Option<u8> {
    Some(1)
}

#[distributed_lock(keys = ["a:{n}", "b:{n}"], permits = 2)]
pub async fn permits_of_several_keys(n: u8) -> Option<u8> {
    Some(n)
}

#[distributed_lock(key = "doc:{id}", mode = "read")]
pub async fn read(id: u32) -> Result<u32, LockError> {
    Ok(id)
}

#[distributed_lock(key = "doc:{id}", mode = "write", on_busy = "skip")]
pub async fn write(id: u32) -> Result<(), LockError> {
    let _ = id;
    Ok(())
}

#[distributed_lock(mode = "read", keys = ["doc:{a}", "doc:{b}"])]
pub async fn read_two(a: u32, b: u32) {
    let _ = (a, b);
}

#[tokio::main]
async fn main() {
    let r = call_provider("acme").await;
    assert!(matches!(r, Err(LockError::NotInitialized)), "{r:?}");
    let r = one_permit().await;
    assert!(matches!(r, Err(LockError::NotInitialized)), "{r:?}");
    assert_eq!(most_permits().await, None);
    assert_eq!(permits_of_several_keys(1).await, None);
    let r = read(1).await;
    assert!(matches!(r, Err(LockError::NotInitialized)), "{r:?}");
    let r = write(1).await;
    assert!(matches!(r, Err(LockError::NotInitialized)), "{r:?}");
    read_two(1, 2).await;
}
