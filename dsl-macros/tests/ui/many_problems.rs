kvcc_dsl_macros::kv_format!("bad-specs/20_many_problems.toml");

fn main() {}
