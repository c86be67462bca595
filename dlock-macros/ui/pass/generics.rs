// Generic functions with `where` clauses, `impl Trait` arguments, lifetimes.
use std::fmt::{Debug, Display};

use dlock_runtime::{LockError, distributed_lock};

#[derive(Debug)]
pub struct AppError(LockError);

impl From<LockError> for AppError {
    fn from(e: LockError) -> Self {
        AppError(e)
    }
}

#[distributed_lock(key = "item:{id}")]
pub async fn generic<T, Id>(id: Id, value: T) -> Result<T, AppError>
where
    T: Debug + Send,
    Id: Display + Send,
{
    Ok(value)
}

#[distributed_lock(key = "user:{user}")]
pub async fn impl_arg(user: impl Display + Send, mut count: u32) -> Result<u32, AppError> {
    count += 1;
    Ok(count)
}

#[distributed_lock(key = "name:{name}")]
pub async fn borrowed<'a>(name: &'a str) -> Option<&'a str> {
    Some(name)
}

#[distributed_lock(key = "elided:{name}")]
pub async fn elided(name: &str) -> Option<&str> {
    Some(name)
}

pub struct Repo<T> {
    items: Vec<T>,
}

impl<T: Clone + Send + Sync> Repo<T> {
    #[distributed_lock(key = "repo:{index}")]
    pub async fn get(&self, index: usize) -> Option<T> {
        self.items.get(index).cloned()
    }
}

#[tokio::main]
async fn main() {
    assert!(matches!(
        generic::<Vec<u8>, _>(1, vec![1]).await,
        Err(AppError(LockError::NotInitialized))
    ));
    assert!(matches!(
        impl_arg("ann", 0).await,
        Err(AppError(LockError::NotInitialized))
    ));
    assert_eq!(borrowed("x").await, None);
    assert_eq!(elided("x").await, None);
    let repo = Repo {
        items: vec![1, 2, 3],
    };
    assert_eq!(repo.get(0).await, None);
}
