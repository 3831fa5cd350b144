//! Numeric building blocks for the trainers: seeded RNG, k-means, PCA. The
//! Hadamard transforms and codebook searches are the reference encoder's
//! (`kvcc_compiler::back::interp::encode`).
pub mod kmeans;
pub mod pca;
pub mod rng;
