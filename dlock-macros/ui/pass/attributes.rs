// Attributes, inner attributes, visibility and unusual names are kept; the
// generated locals do not clash with the user's names.
#![deny(unused_variables, unused_mut)]

use dlock_runtime::distributed_lock;

pub mod jobs {
    use dlock_runtime::distributed_lock;

    #[distributed_lock(key = "jobs:{name}")]
    #[inline]
    pub(crate) async fn r#run(name: &str) -> Option<usize> {
        #![allow(clippy::needless_return)]
        return Some(name.len());
    }
}

#[distributed_lock(key = "shadow:{__dlock_key}")]
pub async fn shadow(__dlock_key: u32) -> Option<u32> {
    Some(__dlock_key)
}

#[tokio::main]
async fn main() {
    assert_eq!(jobs::r#run("x").await, None);
    assert_eq!(shadow(1).await, None);
}
