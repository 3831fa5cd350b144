//! Numeric building blocks for encoders and trainers: seeded RNG, Hadamard transforms, k-means, PCA.
pub mod hadamard;
pub mod kmeans;
pub mod nearest;
pub mod pca;
pub mod rng;
