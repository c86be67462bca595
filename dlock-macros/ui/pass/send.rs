// The future of an annotated function is `Send` whenever the unannotated function's
// would be: the expansion keeps nothing `!Send` alive across an `.await`.
use std::fmt::Display;
use std::rc::Rc;

use dlock_runtime::{LockError, distributed_lock};

fn assert_send<T: Send>(_: T) {}

#[derive(Debug)]
pub struct AppError(LockError);

impl From<LockError> for AppError {
    fn from(e: LockError) -> Self {
        AppError(e)
    }
}

#[distributed_lock(key = "free:{id}", wait = "1s")]
pub async fn free(id: u64) -> Result<u64, AppError> {
    tokio::task::yield_now().await;
    Ok(id)
}

pub struct Account {
    id: u32,
    balance: i64,
}

impl Account {
    #[distributed_lock(key = "account:{self.id}")]
    pub async fn balance(&self) -> Option<i64> {
        tokio::task::yield_now().await;
        Some(self.balance)
    }

    #[distributed_lock(key = "account:{self.id}", on_busy = "skip")]
    pub async fn deposit(&mut self, amount: i64) -> Result<(), AppError> {
        tokio::task::yield_now().await;
        self.balance += amount;
        Ok(())
    }
}

#[distributed_lock(key = "item:{item}")]
pub async fn generic<T: Display + Send + Sync>(item: &T) -> Result<String, AppError> {
    tokio::task::yield_now().await;
    Ok(item.to_string())
}

#[distributed_lock(key = "user:{user}", lease = "10s")]
pub async fn impl_arg(user: impl Display + Send + Sync, count: u32) -> Option<u32> {
    tokio::task::yield_now().await;
    Some(count)
}

#[distributed_lock(key = "rc", on_lost = "continue")]
pub async fn rc_between_awaits(n: u32) {
    tokio::task::yield_now().await;
    let total = {
        // `!Send`, created and dropped between two awaits.
        let rc = Rc::new(n);
        *rc + 1
    };
    tokio::task::yield_now().await;
    assert!(total > n);
}

#[tokio::main]
async fn main() {
    let mut account = Account { id: 7, balance: 10 };
    assert_send(free(1));
    assert_send(account.balance());
    assert_send(account.deposit(1));
    assert_send(generic(&"x"));
    assert_send(impl_arg("ann", 0));
    assert_send(rc_between_awaits(1));

    // And they run on another task of a multi-threaded runtime.
    let r = tokio::spawn(free(1)).await.expect("no panic");
    assert!(
        matches!(r, Err(AppError(LockError::NotInitialized))),
        "{r:?}"
    );
    let r = tokio::spawn(async move { account.deposit(5).await.map(|()| account.balance) })
        .await
        .expect("no panic");
    assert!(
        matches!(r, Err(AppError(LockError::NotInitialized))),
        "{r:?}"
    );
    let r = tokio::spawn(generic::<u8>(&3)).await;
    assert!(matches!(r, Ok(Err(AppError(LockError::NotInitialized)))));
    assert_eq!(
        tokio::spawn(impl_arg(String::from("ann"), 0)).await.ok(),
        Some(None)
    );
    tokio::spawn(rc_between_awaits(1)).await.expect("no panic");
}
