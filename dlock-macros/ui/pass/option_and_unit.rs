// `Option<T>` returns `None` and `()` returns `()` when the body cannot run.
use std::sync::atomic::{AtomicBool, Ordering};

use dlock_runtime::distributed_lock;

static RAN: AtomicBool = AtomicBool::new(false);

#[distributed_lock(key = "lookup:{id}")]
pub async fn lookup(id: u32) -> Option<String> {
    RAN.store(true, Ordering::SeqCst);
    Some(id.to_string())
}

#[distributed_lock(key = "cleanup")]
pub async fn cleanup() {
    RAN.store(true, Ordering::SeqCst);
}

#[distributed_lock(key = "cleanup:{n}")]
pub async fn explicit_unit(n: u8) -> () {
    let _ = n;
    RAN.store(true, Ordering::SeqCst);
}

#[tokio::main]
async fn main() {
    assert_eq!(lookup(1).await, None);
    cleanup().await;
    explicit_unit(2).await;
    assert!(!RAN.load(Ordering::SeqCst), "no body may run before init");
}
