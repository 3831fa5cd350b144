//! The page-compress kernel of a tier: exact K/V rows of a dense source page
//! in, one page of the tier out, byte-identical to the CPU encoder
//! (`runtime::encode::encode_page`) on the same rows and tables. The
//! launch contract is [`abi::EncodeKernel`] and [`abi::ENCODE_PARAMS`].
//!
//! One CTA per job. Per side (key, then value) and per chunk of items:
//! the transform into shared memory (`transform`), the codeword search
//! (`fields::choose_codewords`), the page maxima and header scales, then
//! every slot element ORed into a shared image of the chunk's stream bytes,
//! copied out whole. A page that fits shared memory is one chunk; a larger
//! one is transformed twice where it has page scales (maxima first, then
//! the items). The header goes last.

mod emit;
mod fields;
mod plan;
mod transform;

pub(in crate::back::ptx) use transform::load_source_value;

use super::abi::{self, DenseSource, TableBuffer, ENCODE_JOB_WORDS, ENCODE_PARAMS};
use super::builder::{self, Axis, Cmp, Global, Kernel, Reg, Shared, U32, U64};
use super::{identifier, Error, PTX_VERSION};
use crate::layout::{round_up, CodecLayout, Side, TierLayout};
use crate::target::Target;
use emit::{for_each, Ctx};
use plan::Plan;

/// Threads per encode CTA.
pub const THREADS: u32 = 256;

/// One tier's encode module.
#[derive(Debug, Clone)]
pub struct EncodeOutput {
    pub tier: String,
    /// The PTX module text (one `.entry`).
    pub ptx: String,
    pub kernel: abi::EncodeKernel,
}

/// The encode module of tier `layout` of format `format`, reading source
/// pages laid out as `source`.
pub fn write_encoder(
    format: &str,
    layout: &TierLayout,
    source: &DenseSource,
    target: Target,
) -> Result<EncodeOutput, Error> {
    write_encoder_within(format, layout, source, target, target.max_shared_bytes())
}

/// [`write_encoder`] with at most `limit` bytes of dynamic shared memory
/// (smaller than the target's: pages then go in chunks sooner).
pub fn write_encoder_within(
    format: &str,
    layout: &TierLayout,
    source: &DenseSource,
    target: Target,
    limit: u32,
) -> Result<EncodeOutput, Error> {
    let limit = limit.min(target.max_shared_bytes());
    let refuse = |reason: String| Error::Encoder {
        format: format.to_string(),
        tier: layout.name.clone(),
        reason,
    };
    if source.head_dim != layout.head_dim || source.items != layout.items_per_page {
        return Err(refuse(format!(
            "source pages hold {} rows of {} elements, the tier's pages {} of {}",
            source.items, source.head_dim, layout.items_per_page, layout.head_dim
        )));
    }
    let plan = Plan::new(layout, limit).map_err(|needed| {
        refuse(format!(
            "even {} items at once need {needed} bytes of shared memory, more than the {limit} allowed",
            plan::CHUNK_QUANTUM.min(layout.items_per_page)
        ))
    })?;
    let tables = TableBuffer::of_layout(layout);
    let name = format!(
        "kvcc_{}_{}_encode",
        identifier(format),
        identifier(&layout.name)
    );
    let entry = kernel(layout, source, &plan, &tables, &name);
    let ptx = builder::module(PTX_VERSION, target.name(), abi::SHARED_SYMBOL, &[entry]);
    Ok(EncodeOutput {
        tier: layout.name.clone(),
        ptx,
        kernel: abi::EncodeKernel {
            name,
            tier: layout.index,
            threads: THREADS,
            shared_bytes: plan.bytes,
            page_bytes: layout.page_bytes,
            items_per_page: layout.items_per_page,
            chunk_items: plan.chunk,
            tables,
            source: *source,
        },
    })
}

/// The encode module of every tier of `format`.
pub fn write_encoders(
    format: &crate::Format,
    source: &DenseSource,
    target: Target,
) -> Result<Vec<EncodeOutput>, Error> {
    (0..format.tiers().len())
        .map(|t| write_encoder(format.name(), format.layout(t), source, target))
        .collect()
}

fn kernel(
    layout: &TierLayout,
    source: &DenseSource,
    plan: &Plan,
    tables: &TableBuffer,
    name: &str,
) -> String {
    let mut k = Kernel::new(name, THREADS, abi::SHARED_SYMBOL);
    let mut params = ENCODE_PARAMS.iter();
    let mut take = |ty: abi::ParamType| {
        let p = params.next().expect("ENCODE_PARAMS lists every parameter");
        assert_eq!(p.ty, ty, "parameter {}", p.name);
        p.name
    };
    let dst_pool = k.param::<U64>(take(abi::ParamType::Pointer));
    let src_pool = k.param::<U64>(take(abi::ParamType::Pointer));
    let table_buffer = k.param::<U64>(take(abi::ParamType::Pointer));
    let jobs = k.param::<U64>(take(abi::ParamType::Pointer));
    let job_count = k.param::<U32>(take(abi::ParamType::U32));

    let job = k.ctaid(Axis::X);
    let job_count = k.ld_param(&job_count);
    let outside = k.setp(Cmp::Ge, job, job_count);
    let start = k.label();
    k.bra_if(outside, false, start);
    k.ret();
    k.place(start);
    let tid = k.tid_x();
    let jobs = k.ld_pointer(&jobs);
    let record = k.global_index(jobs, job, 4 * ENCODE_JOB_WORDS);
    let src_page: Reg<U32> = k.ld_global_nc(Global::at(record));
    let dst_page: Reg<U32> = k.ld_global_nc(Global::at(record).plus(4));
    let head: Reg<U32> = k.ld_global_nc(Global::at(record).plus(8));
    let src_pool = k.ld_pointer(&src_pool);
    let dst_pool = k.ld_pointer(&dst_pool);
    let table_buffer = k.ld_pointer(&table_buffer);
    let ctx = Ctx {
        tid,
        threads: THREADS,
        smem: k.shared_base(),
        tables: k.global_index(table_buffer, head, 4 * tables.stride),
        src: k.global_index(src_pool, src_page, source.page_bytes),
        dst: k.global_index(dst_pool, dst_page, layout.page_bytes),
    };

    k.comment("page maxima start at 0");
    for_each(&mut k, &ctx, layout.header_slots, |k, w| {
        let at = ctx.shared_word(k, plan.scales, w);
        k.st_shared(at, 0u32);
    });
    k.bar_sync();
    for side in [Side::Key, Side::Value] {
        encode_side(&mut k, &ctx, layout, source, plan, tables, side);
    }
    header(&mut k, &ctx, layout, plan);
    k.ret();
    k.finish()
}

/// One side's stream (and its header scales), chunk by chunk.
fn encode_side(
    k: &mut Kernel,
    ctx: &Ctx,
    layout: &TierLayout,
    source: &DenseSource,
    plan: &Plan,
    tables: &TableBuffer,
    side: Side,
) {
    let codec = layout.codec(side);
    let scaled = layout.header_scales.iter().any(|s| s.side == side);
    let items = layout.items_per_page;
    let one_pass = !scaled || plan.chunk >= items;
    let prepare = |k: &mut Kernel, first: Reg<U32>, count: Reg<U32>| {
        transform::forward(k, ctx, plan, codec, tables, source, first, count);
        fields::choose_codewords(k, ctx, plan, codec, tables, count);
    };
    let scales = |k: &mut Kernel, count: Reg<U32>| {
        fields::page_maxima(k, ctx, plan, codec, count);
    };
    if !one_pass {
        k.comment(&format!("{}: page maxima over every chunk", side.name()));
        chunks(k, plan, items, |k, first, count| {
            prepare(k, first, count);
            scales(k, count);
            k.bar_sync();
        });
        fields::finish_scales(k, ctx, plan, codec);
        k.bar_sync();
    }
    chunks(k, plan, items, |k, first, count| {
        prepare(k, first, count);
        if one_pass && scaled {
            scales(k, count);
            k.bar_sync();
            fields::finish_scales(k, ctx, plan, codec);
            k.bar_sync();
        }
        pack(k, ctx, layout, plan, tables, codec, first, count);
    });
    // The stream's padding up to the next region (the value stream's: up
    // to the end of the page).
    let end = match side {
        Side::Key => layout.value_stream_offset,
        Side::Value => layout.page_bytes,
    };
    let written = layout.stream_offset(side) + round_up(items * codec.stride, 16);
    if end > written {
        k.comment(&format!("{}: zero padding after the stream", side.name()));
        for_each(k, ctx, (end - written) / 16, |k, w| {
            let at = k.global_index(ctx.dst, w, 16);
            let zero = k.mov(0u32);
            k.st_global_v4(Global::at(at).plus(i64::from(written)), [zero; 4]);
        });
    }
}

/// `body(first, count)` for every chunk of the page, in order.
fn chunks(
    k: &mut Kernel,
    plan: &Plan,
    items: u32,
    body: impl FnOnce(&mut Kernel, Reg<U32>, Reg<U32>),
) {
    let first = k.mov(0u32);
    let top = k.label();
    k.place(top);
    let left = k.sub(items, first);
    let count = k.min(left, plan.chunk);
    body(k, first, count);
    k.add_to(first, first, plan.chunk);
    let more = k.setp(Cmp::Lt, first, items);
    k.bra_if(more, true, top);
}

/// Zeroes the image, packs the chunk's items into it and copies it to the
/// chunk's bytes of the stream.
#[allow(clippy::too_many_arguments)]
fn pack(
    k: &mut Kernel,
    ctx: &Ctx,
    layout: &TierLayout,
    plan: &Plan,
    tables: &TableBuffer,
    codec: &CodecLayout,
    first: Reg<U32>,
    count: Reg<U32>,
) {
    let side = codec.side;
    let stride = codec.stride;
    let bytes = round_up(plan.chunk * stride, 16);
    k.comment(&format!("{}: pack the chunk's items", side.name()));
    for_each(k, ctx, bytes / 16, |k, w| {
        let at = k.mad_lo(w, 16u32, ctx.smem);
        let zero = k.mov(0u32);
        k.st_shared_v4(Shared::at(at).plus(i64::from(plan.image)), [zero; 4]);
    });
    k.bar_sync();
    fields::pack_items(k, ctx, plan, codec, tables, count);
    let chunk_bytes = k.mul(count, stride);
    let chunk_bytes = k.add(chunk_bytes, 15u32);
    let vectors = k.shr(chunk_bytes, 4u32);
    let base = k.mul(first, stride);
    let base = k.add(base, layout.stream_offset(side));
    for_each(k, ctx, vectors, |k, w| {
        let at = k.mad_lo(w, 16u32, ctx.smem);
        let words = k.ld_shared_v4::<U32>(Shared::at(at).plus(i64::from(plan.image)));
        let byte = k.mad_lo(w, 16u32, base);
        let to = k.global_index(ctx.dst, byte, 1);
        k.st_global_v4(Global::at(to), words);
    });
    k.bar_sync();
}

/// The page header: tier, count, flags 0, reserved 0, the scales, zeros.
fn header(k: &mut Kernel, ctx: &Ctx, layout: &TierLayout, plan: &Plan) {
    k.comment("header: tier, count, flags, reserved, scales, zero padding");
    let slots = layout.header_slots;
    for_each(k, ctx, layout.header_bytes / 4, |k, w| {
        let value = k.mov(0u32);
        let slot = k.sub(w, 4u32);
        let scale = k.setp(Cmp::Lt, slot, slots);
        let index = k.min(slot, slots.max(1) - 1);
        let at = ctx.shared_word(k, plan.scales, index);
        let s: Reg<U32> = k.ld_shared(at);
        emit::assign_if(k, value, s, scale);
        let tier = k.setp(Cmp::Eq, w, 0u32);
        emit::assign_if(k, value, layout.index, tier);
        let count = k.setp(Cmp::Eq, w, 1u32);
        emit::assign_if(k, value, layout.items_per_page, count);
        let at = k.global_index(ctx.dst, w, 4);
        k.st_global(Global::at(at), value);
    });
}
