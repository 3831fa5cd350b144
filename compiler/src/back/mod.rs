pub mod interp;
