//! Provider.
fn main() {}
