// `&self`, `&mut self` and `self` receivers, inherent and trait-impl methods.
use dlock_runtime::{LockError, distributed_lock};

#[derive(Debug)]
pub struct AppError(LockError);

impl From<LockError> for AppError {
    fn from(e: LockError) -> Self {
        AppError(e)
    }
}

pub struct Account {
    id: u32,
    balance: i64,
}

impl Account {
    #[distributed_lock(key = "account:{self.id}")]
    pub async fn balance(&self) -> Result<i64, AppError> {
        Ok(self.balance)
    }

    #[distributed_lock(key = "account:{self.id}", wait = "1s")]
    pub async fn deposit(&mut self, amount: i64) -> Result<i64, AppError> {
        self.balance += amount;
        Ok(self.balance)
    }

    #[distributed_lock(key = "account:{self.id}:close")]
    pub async fn close(self) -> Result<i64, AppError> {
        Ok(self.balance)
    }

    #[distributed_lock(key = "account:{id}")]
    pub async fn open(id: u32) -> Result<Self, AppError> {
        Ok(Account { id, balance: 0 })
    }
}

trait Ledger {
    fn name(&self) -> String;
    async fn settle(&self, day: u32) -> Result<u32, AppError>;
}

impl Ledger for Account {
    fn name(&self) -> String {
        format!("account {}", self.id)
    }

    #[distributed_lock(key = "ledger:{self.id}:{day}")]
    async fn settle(&self, day: u32) -> Result<u32, AppError> {
        Ok(day)
    }
}

fn not_initialized<T: std::fmt::Debug>(r: Result<T, AppError>) {
    assert!(
        matches!(r, Err(AppError(LockError::NotInitialized))),
        "{r:?}"
    );
}

#[tokio::main]
async fn main() {
    let mut account = Account { id: 7, balance: 10 };
    not_initialized(account.balance().await);
    not_initialized(account.deposit(5).await);
    assert_eq!(account.balance, 10, "the body must not run");
    not_initialized(account.settle(3).await);
    assert_eq!(account.name(), "account 7");
    not_initialized(account.close().await);
    assert!(matches!(
        Account::open(1).await,
        Err(AppError(LockError::NotInitialized))
    ));
}
