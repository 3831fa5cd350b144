kvcc_dsl_macros::kv_format!("bad-specs/no_such_spec.toml");

fn main() {}
