// Key templates: literal braces, tuple fields, nested fields, patterns.
use dlock_runtime::distributed_lock;

pub struct Inner {
    pub name: String,
}

pub struct Outer {
    pub inner: Inner,
    pub pair: (u8, (u16, u32)),
}

pub struct Point {
    pub x: i32,
    pub y: i32,
}

#[distributed_lock(key = "{{literal}}")]
pub async fn literal_braces() -> Option<()> {
    Some(())
}

#[distributed_lock(key = "{{{id}}}:{{}}")]
pub async fn braces_around(id: u32) -> Option<u32> {
    Some(id)
}

#[distributed_lock(key = "pair:{pair.0}-{pair.1}")]
pub async fn tuple_field(pair: (u32, &str)) -> Option<u32> {
    Some(pair.0)
}

#[distributed_lock(key = "outer:{outer.inner.name}:{outer.pair.1.0}")]
pub async fn nested(outer: &Outer) -> Option<usize> {
    Some(outer.inner.name.len())
}

#[distributed_lock(key = "point:{x}:{why}:{a}:{b}")]
pub async fn patterns(Point { x, y: why }: Point, (a, b): (u8, u8)) -> Option<i32> {
    Some(x + why + i32::from(a) + i32::from(b))
}

#[distributed_lock(key = "raw:{r#type}")]
pub async fn raw_ident(r#type: &str) -> Option<usize> {
    Some(r#type.len())
}

#[distributed_lock(key = r"raw-string:{id}")]
pub async fn raw_string_key(id: u32) -> Option<u32> {
    Some(id)
}

#[tokio::main]
async fn main() {
    assert_eq!(literal_braces().await, None);
    assert_eq!(braces_around(1).await, None);
    assert_eq!(tuple_field((1, "a")).await, None);
    let outer = Outer {
        inner: Inner { name: "n".into() },
        pair: (1, (2, 3)),
    };
    assert_eq!(nested(&outer).await, None);
    assert_eq!(outer.pair.0, 1, "the key only borrows the argument");
    assert_eq!(patterns(Point { x: 1, y: 2 }, (3, 4)).await, None);
    assert_eq!(raw_ident("t").await, None);
    assert_eq!(raw_string_key(5).await, None);
}
