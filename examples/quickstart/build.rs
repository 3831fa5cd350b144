//! The build-script path: the spec's PTX and layout report in `OUT_DIR`
//! (`$OUT_DIR/quickstart/high.sm_90.ptx`, `.../layout.txt`, ...).

use kvcc_compiler::target::Target;

fn main() {
    let out_dir = std::env::var_os("OUT_DIR").expect("Cargo sets OUT_DIR");
    if let Err(e) = kvcc_compiler::build::generate("specs/quickstart.toml", out_dir, &Target::ALL) {
        panic!("{e}");
    }
}
