//! Holds a key for a while, to try the `dlock` command on:
//! `cargo run -p dlock-cli --example hold -- URL KEY [SECONDS]`.
//!
//! The holder's instance name comes from `DLOCK_HOLDER`. Prints the token,
//! then `released` after SECONDS (default 600) or `lost` as soon as the key
//! is revoked.

use std::time::Duration;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let (Some(url), Some(key)) = (args.next(), args.next()) else {
        return Err("usage: hold URL KEY [SECONDS]".into());
    };
    let seconds: u64 = args.next().map_or(Ok(600), |s| s.parse())?;
    let registry = dlock_runtime::Registry::from_url(&url).await?;
    let guard = registry
        .lock(&key)
        .lease(Duration::from_secs(15))
        .acquire()
        .await?;
    match guard.fencing_token() {
        Some(token) => println!("holding {key}, token {token}"),
        None => println!("holding {key}, unfenced"),
    }
    tokio::select! {
        () = guard.lost() => println!("lost {key}"),
        () = tokio::time::sleep(Duration::from_secs(seconds)) => {
            guard.release().await?;
            println!("released {key}");
        }
    }
    Ok(())
}
