//! The append kernel of a live cache: new K/V rows (f32, f16 or bf16: one
//! kernel per row dtype) rounded into the item slots of exact pages (a dense
//! f16 or bf16 tier), and the headers of the pages they fill rewritten. The
//! runtime picks every row's slot and every header's count; the kernel only
//! moves and rounds: rows of the pages' own dtype are copied, others widened
//! to f32 (exact) and rounded once (`cvt.rn`, ties to even, as the CPU's exact
//! rows round from f32).

use super::abi::{
    AppendKernel, DenseSource, ParamType, RowDtype, SourceDtype, APPEND_PARAMS, SHARED_SYMBOL,
};
use super::builder::{Axis, Cmp, Global, Kernel, U32, U64};
use crate::layout::Side;

/// Why a tier cannot hold a live cache's exact rows.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "tier `{tier}` cannot hold exact rows: it is not a dense f16 or bf16 tier without a transform"
)]
pub struct NotExact {
    pub tier: String,
}

/// Threads per CTA: one warp per 32 channels, at most four warps.
fn threads(head_dim: u32) -> u32 {
    head_dim.div_ceil(32).clamp(1, 4) * 32
}

/// The append kernel of exact pages laid out as `rows`, whose headers name
/// tier `tier` (one CTA per row, and per header update), reading new rows of
/// `input`, and its launch facts.
pub fn append(
    rows: &DenseSource,
    tier: u32,
    input: RowDtype,
    name: &str,
) -> (String, AppendKernel) {
    let threads = threads(rows.head_dim);
    let mut k = Kernel::new(name, threads, SHARED_SYMBOL);
    let mut params = APPEND_PARAMS.iter();
    let mut take = |ty: ParamType| {
        let p = params.next().expect("APPEND_PARAMS lists every parameter");
        assert_eq!(p.ty, ty, "parameter {}", p.name);
        p.name
    };
    let pool = k.param::<U64>(take(ParamType::Pointer));
    let keys = k.param::<U64>(take(ParamType::Pointer));
    let values = k.param::<U64>(take(ParamType::Pointer));
    let row_list = k.param::<U64>(take(ParamType::Pointer));
    let row_count = k.param::<U32>(take(ParamType::U32));
    let headers = k.param::<U64>(take(ParamType::Pointer));
    let header_count = k.param::<U32>(take(ParamType::U32));

    let d = rows.head_dim;
    let tid = k.tid_x();
    let cta = k.ctaid(Axis::X);
    let pool = k.ld_pointer(&pool);
    let row_count = k.ld_param(&row_count);
    let header_count = k.ld_param(&header_count);

    let (skip_rows, headers_part) = (k.label(), k.label());
    let past = k.setp(Cmp::Ge, cta, row_count);
    k.bra_if(past, true, skip_rows);
    k.comment("row cta: source row -> item (page * items + item) of the exact pool");
    let row_list = k.ld_pointer(&row_list);
    let pair = k.mul(cta, 2u32);
    let pair_at = Global::at(k.global_index(row_list, pair, 4));
    let source_index = k.ld_global_nc::<U32>(pair_at);
    let slot = k.ld_global_nc::<U32>(pair_at.plus(4));
    let page = k.div_u32(slot, rows.items);
    let item = k.rem_u32(slot, rows.items);
    let page_base = k.global_index(pool, page, rows.page_bytes);
    for (side, source) in [(Side::Key, keys), (Side::Value, values)] {
        let (offset, stride) = rows.stream(side);
        let source = k.ld_pointer(&source);
        let first = k.mul(source_index, d);
        let source_row = k.global_index(source, first, input.bytes());
        let stream = Global::at(page_base).plus(i64::from(offset));
        let item_base = k.global_index(stream.base, item, stride);
        let item_at = Global::at(item_base).plus(stream.offset);
        for c0 in (0..d).step_by(threads as usize) {
            let c = k.add(tid, c0);
            let inside = k.setp(Cmp::Lt, c, d);
            let from = Global::at(k.global_index(source_row, c, input.bytes()));
            let to = k.global_index(item_at.base, c, 2);
            let to = Global::at(to).plus(item_at.offset);
            let dtype = rows.dtype;
            k.guarded(inside, true, |k| {
                let x = match input {
                    RowDtype::F32 => k.ld_global_nc(from),
                    RowDtype::F16 | RowDtype::Bf16 => {
                        let half = k.ld_global_nc_narrow(from, 16);
                        match (input, dtype) {
                            (RowDtype::F16, SourceDtype::F16)
                            | (RowDtype::Bf16, SourceDtype::Bf16) => {
                                let bits = k.low16(half);
                                k.st_global_b16(to, bits);
                                return;
                            }
                            (RowDtype::F16, _) => {
                                let bits = k.low16(half);
                                k.f16_to_f32(bits)
                            }
                            _ => {
                                let wide = k.shl(half, 16u32);
                                k.bitcast(wide)
                            }
                        }
                    }
                };
                let bits = match dtype {
                    SourceDtype::Bf16 => k.f32_to_bf16(x),
                    SourceDtype::F16 => k.f32_to_f16(x),
                };
                k.st_global_b16(to, bits);
            });
        }
    }
    k.place(skip_rows);
    let past = k.setp(Cmp::Ge, cta, header_count);
    k.bra_if(past, true, headers_part);
    k.comment("header cta -> (page, count) pairs: tier, count, flags, 0");
    let first_thread = k.setp(Cmp::Eq, tid, 0u32);
    let headers = k.ld_pointer(&headers);
    let pair = k.mul(cta, 2u32);
    let entry = Global::at(k.global_index(headers, pair, 4));
    k.guarded(first_thread, true, |k| {
        let page = k.ld_global_nc::<U32>(entry);
        let count = k.ld_global_nc::<U32>(entry.plus(4));
        let at = Global::at(k.global_index(pool, page, rows.page_bytes));
        k.st_global(at, tier);
        k.st_global(at.plus(4), count);
        k.st_global(at.plus(8), 0u32);
        k.st_global(at.plus(12), 0u32);
    });
    k.place(headers_part);
    k.ret();
    (
        k.finish(),
        AppendKernel {
            name: name.to_string(),
            threads,
            rows: input,
        },
    )
}
