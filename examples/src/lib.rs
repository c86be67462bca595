//! Examples live beside this crate as `cargo run --example …`.
