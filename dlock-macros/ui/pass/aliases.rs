// Result aliases work because the runtime decides by trait, not by tokens.
use dlock_runtime::{LockError, distributed_lock};

#[derive(Debug)]
pub struct MyError(LockError);

impl From<LockError> for MyError {
    fn from(e: LockError) -> Self {
        MyError(e)
    }
}

pub type Result<T> = std::result::Result<T, MyError>;

#[distributed_lock(key = "anyhow:{id}")]
pub async fn with_anyhow(id: u32) -> anyhow::Result<u32> {
    anyhow::ensure!(id > 0, "id must be positive");
    Ok(id)
}

#[distributed_lock(key = "io:{path}")]
pub async fn with_io(path: &str) -> std::io::Result<String> {
    std::fs::read_to_string(path)
}

#[distributed_lock(key = "local:{id}")]
pub async fn with_local_alias(id: u32) -> Result<u32> {
    Ok(id)
}

#[tokio::main]
async fn main() {
    let e = with_anyhow(1).await.unwrap_err();
    assert!(
        matches!(
            e.downcast_ref::<LockError>(),
            Some(LockError::NotInitialized)
        ),
        "{e:?}"
    );

    let e = with_io("/nonexistent").await.unwrap_err();
    assert!(
        matches!(
            e.get_ref()
                .and_then(|inner| inner.downcast_ref::<LockError>()),
            Some(LockError::NotInitialized)
        ),
        "{e:?}"
    );

    let r = with_local_alias(1).await;
    assert!(
        matches!(r, Err(MyError(LockError::NotInitialized))),
        "{r:?}"
    );
}
