// `?` and `return` inside the body keep their meaning: they leave the function
// with the declared return type, converting errors with `From`.
use dlock_runtime::{LockError, distributed_lock};

#[derive(Debug)]
pub enum AppError {
    Lock(LockError),
    Parse(std::num::ParseIntError),
    Io(std::io::Error),
}

impl From<LockError> for AppError {
    fn from(e: LockError) -> Self {
        AppError::Lock(e)
    }
}

impl From<std::num::ParseIntError> for AppError {
    fn from(e: std::num::ParseIntError) -> Self {
        AppError::Parse(e)
    }
}

impl From<std::io::Error> for AppError {
    fn from(e: std::io::Error) -> Self {
        AppError::Io(e)
    }
}

#[distributed_lock(key = "parse:{input}")]
pub async fn parse(input: &str) -> Result<u64, AppError> {
    if input.is_empty() {
        return Ok(0);
    }
    let n: u64 = input.parse()?;
    let _ = std::env::current_dir()?;
    Ok(n)
}

#[distributed_lock(key = "first:{name}")]
pub async fn first(name: &str, items: Vec<u8>) -> Option<u8> {
    let first = items.first()?;
    Some(*first)
}

#[tokio::main]
async fn main() {
    let r = parse("12").await;
    assert!(
        matches!(r, Err(AppError::Lock(LockError::NotInitialized))),
        "{r:?}"
    );
    assert_eq!(first("a", vec![1]).await, None);
}
