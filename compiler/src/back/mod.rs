pub mod interp;
pub mod text;
