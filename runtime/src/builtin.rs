//! The bundled specs, compiled into the binary so `kvcc demo` runs anywhere.

/// (file name, TOML source) of every spec in `specs/`.
pub const SPECS: [(&str, &str); 8] = [
    (
        "specs/dense_f16.toml",
        include_str!("../../specs/dense_f16.toml"),
    ),
    (
        "specs/spherical.toml",
        include_str!("../../specs/spherical.toml"),
    ),
    ("specs/kivi.toml", include_str!("../../specs/kivi.toml")),
    (
        "specs/subspace.toml",
        include_str!("../../specs/subspace.toml"),
    ),
    ("specs/shard.toml", include_str!("../../specs/shard.toml")),
    ("specs/mosaic.toml", include_str!("../../specs/mosaic.toml")),
    ("specs/fp8.toml", include_str!("../../specs/fp8.toml")),
    ("specs/kivi2.toml", include_str!("../../specs/kivi2.toml")),
];
