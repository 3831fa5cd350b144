kvcc_dsl_macros::kv_format!("bad-specs/01_syntax_error.toml");

fn main() {}
