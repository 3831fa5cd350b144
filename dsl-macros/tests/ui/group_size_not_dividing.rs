kvcc_dsl_macros::kv_format!(pub mod vq = "bad-specs/07_group_size_not_dividing.toml");

fn main() {}
