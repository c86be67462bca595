//! Key checks shared by every backend.

use crate::error::LockError;

/// The longest stored key (prefix included), in bytes.
pub const MAX_KEY_LEN: usize = 1024;

/// The prefix keys get when the registry does not set one.
pub const DEFAULT_PREFIX: &str = "dlock:";

/// Rejects what no backend should store: empty keys, control characters
/// (invisible in logs, `NUL` truncates C strings) and keys longer than
/// [`MAX_KEY_LEN`] bytes once prefixed.
pub(crate) fn check(user_key: &str, prefix: &str) -> Result<(), LockError> {
    if user_key.is_empty() {
        return Err(LockError::invalid_key(user_key, "the key is empty"));
    }
    if let Some(c) = user_key.chars().find(|c| c.is_control()) {
        return Err(LockError::invalid_key(
            user_key,
            format!("control character {c:?} is not allowed in a key"),
        ));
    }
    if prefix.len() + user_key.len() > MAX_KEY_LEN {
        return Err(LockError::invalid_key(
            user_key,
            format!(
                "the key is {} bytes long with its prefix; the limit is {MAX_KEY_LEN}",
                prefix.len() + user_key.len()
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_bad_keys() {
        assert!(check("", "p:").is_err());
        assert!(check("a\nb", "p:").is_err());
        assert!(check("a\0b", "p:").is_err());
        assert!(check(&"x".repeat(MAX_KEY_LEN), "p:").is_err());
        assert!(check("order:{42}/../*ünï", "p:").is_ok());
    }
}
