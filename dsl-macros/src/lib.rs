//! kv_format! lives here (issue 5).
extern crate proc_macro;
