//! Compiled kernels behind a safe API: every call checks the buffer sizes the
//! generated code relies on (the validator proved every index in range for
//! buffers of exactly these sizes).

use std::marker::PhantomData;
use std::ops::Range;

use super::module::Code;
use super::Options;
use crate::ir::Module;

type PrologueFn = unsafe extern "C" fn(*const *const f32, *mut f32);
type ScoreFn = unsafe extern "C" fn(*const u8, u32, *const *const f32, *const f32, *mut f32);
type AccumulateFn =
    unsafe extern "C" fn(*const u8, u32, *const *const f32, *const f32, *const f32, *mut f32);
type EpilogueFn = unsafe extern "C" fn(*const *const f32, *mut f32, f32);

/// The buffers the kernels of one tier read and write, in f32s.
#[derive(Debug, Clone, PartialEq)]
pub struct Shape {
    /// Query heads per score/accumulate call.
    pub heads: usize,
    pub lanes: usize,
    pub head_dim: usize,
    pub page_bytes: usize,
    pub items_per_page: usize,
    /// Per head in `logits`, `weights` and `decays`: items per page rounded
    /// up to whole vectors.
    pub items_stride: usize,
    /// Coordinates of the value accumulator.
    pub dims: usize,
    /// Per head in `acc`: `dims` rounded up to whole vectors.
    pub dims_stride: usize,
    /// One head's shared arrays, every array of the module in order.
    pub arrays_len: usize,
    pub(super) array_offsets: Vec<u32>,
    query: usize,
    accumulator: usize,
    output: usize,
    table_lens: Vec<usize>,
}

impl Shape {
    pub(super) fn new(module: &Module, options: &Options) -> Shape {
        let lanes = options.lanes as usize;
        let mut array_offsets = Vec::with_capacity(module.arrays.len());
        let mut arrays_len = 0u32;
        for (_, array) in module.arrays.iter() {
            array_offsets.push(arrays_len);
            arrays_len += array.len;
        }
        let layout = &module.layout;
        let dims = module.value.dims as usize;
        Shape {
            heads: options.heads as usize,
            lanes,
            head_dim: module.head_dim as usize,
            page_bytes: layout.page_bytes as usize,
            items_per_page: layout.items_per_page as usize,
            items_stride: (layout.items_per_page as usize).next_multiple_of(lanes),
            dims,
            dims_stride: dims.next_multiple_of(lanes),
            arrays_len: arrays_len as usize,
            query: array_offsets[module.query.index()] as usize,
            accumulator: array_offsets[module.value.accumulator.index()] as usize,
            output: array_offsets[module.value.output.index()] as usize,
            array_offsets,
            table_lens: module.tables.iter().map(|(_, t)| t.len as usize).collect(),
        }
    }

    /// Where the query goes in one head's arrays (before the prologue).
    pub fn query(&self) -> Range<usize> {
        self.query..self.query + self.head_dim
    }
    /// Where the accumulator goes in one head's arrays (before the epilogue).
    pub fn accumulator(&self) -> Range<usize> {
        self.accumulator..self.accumulator + self.dims
    }
    /// Where the epilogue leaves the (unnormalized) output.
    pub fn output(&self) -> Range<usize> {
        self.output..self.output + self.head_dim
    }
}

/// One kv head's tables as the kernels read them (a pointer per table).
pub struct Tables<'t> {
    pointers: Vec<*const f32>,
    lens: Vec<usize>,
    tables: PhantomData<&'t [Vec<f32>]>,
}

/// One tier's compiled programs.
pub struct Kernels {
    shape: Shape,
    prologue: PrologueFn,
    score: ScoreFn,
    accumulate: AccumulateFn,
    epilogue: EpilogueFn,
    _code: Code,
}

impl std::fmt::Debug for Kernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Kernels")
            .field("shape", &self.shape)
            .finish_non_exhaustive()
    }
}

impl Kernels {
    /// # Safety
    /// `addresses` are prologue, score, accumulate and epilogue in `code`,
    /// compiled for `shape` with the signatures of the fn types above.
    pub(super) unsafe fn new(shape: Shape, code: Code, addresses: [*const u8; 4]) -> Kernels {
        let [prologue, score, accumulate, epilogue] = addresses;
        // SAFETY: per the contract above.
        unsafe {
            Kernels {
                shape,
                prologue: std::mem::transmute::<*const u8, PrologueFn>(prologue),
                score: std::mem::transmute::<*const u8, ScoreFn>(score),
                accumulate: std::mem::transmute::<*const u8, AccumulateFn>(accumulate),
                epilogue: std::mem::transmute::<*const u8, EpilogueFn>(epilogue),
                _code: code,
            }
        }
    }

    pub fn shape(&self) -> &Shape {
        &self.shape
    }

    /// One kv head's tables (`[table]`, the lengths the layout declares).
    pub fn tables<'t>(&self, tables: &'t [Vec<f32>]) -> Tables<'t> {
        let lens: Vec<usize> = tables.iter().map(Vec::len).collect();
        assert_eq!(lens, self.shape.table_lens, "table lengths");
        Tables {
            pointers: tables.iter().map(|t| t.as_ptr()).collect(),
            lens,
            tables: PhantomData,
        }
    }

    fn check_tables(&self, tables: &Tables) {
        assert_eq!(tables.lens, self.shape.table_lens, "tables of another tier");
    }

    /// Item count of `page` (a whole page of this tier), checked against the
    /// page's capacity.
    fn count(&self, page: &[u8]) -> u32 {
        assert_eq!(page.len(), self.shape.page_bytes, "page size");
        let count = u32::from_le_bytes(page[4..8].try_into().expect("4 bytes"));
        assert!(
            count as usize <= self.shape.items_per_page,
            "page holds {count} items, room for {}",
            self.shape.items_per_page
        );
        count
    }

    /// Runs the key prologue for one head: `arrays` (`arrays_len`) holds the
    /// query at `shape().query()`.
    pub fn prologue(&self, tables: &Tables, arrays: &mut [f32]) {
        self.check_tables(tables);
        assert_eq!(arrays.len(), self.shape.arrays_len, "arrays");
        // SAFETY: the sizes the code was compiled for, checked above.
        unsafe { (self.prologue)(tables.pointers.as_ptr(), arrays.as_mut_ptr()) }
    }

    /// `logits[h * items_stride + i] = ⟨q_h, k_i⟩` for the page's items and
    /// the call's heads (`arrays`: `heads` blocks of `arrays_len`, after the
    /// prologue). Returns the page's item count.
    pub fn score(&self, page: &[u8], tables: &Tables, arrays: &[f32], logits: &mut [f32]) -> usize {
        let count = self.count(page);
        self.check_tables(tables);
        assert_eq!(
            arrays.len(),
            self.shape.heads * self.shape.arrays_len,
            "arrays"
        );
        assert_eq!(
            logits.len(),
            self.shape.heads * self.shape.items_stride,
            "logits"
        );
        if count > 0 {
            // SAFETY: sizes checked above; count <= items per page.
            unsafe {
                (self.score)(
                    page.as_ptr(),
                    count,
                    tables.pointers.as_ptr(),
                    arrays.as_ptr(),
                    logits.as_mut_ptr(),
                )
            }
        }
        count as usize
    }

    /// For every item i of the page and head h:
    /// `acc[h * dims_stride + c] = acc[..] * decays[h * items_stride + i] + weights[..] * v_i(c)`.
    pub fn accumulate(
        &self,
        page: &[u8],
        tables: &Tables,
        weights: &[f32],
        decays: &[f32],
        acc: &mut [f32],
    ) {
        let count = self.count(page);
        self.check_tables(tables);
        let rates = self.shape.heads * self.shape.items_stride;
        assert_eq!(
            (weights.len(), decays.len()),
            (rates, rates),
            "weights and decays"
        );
        assert_eq!(
            acc.len(),
            self.shape.heads * self.shape.dims_stride,
            "accumulator"
        );
        if count > 0 {
            // SAFETY: sizes checked above; count <= items per page.
            unsafe {
                (self.accumulate)(
                    page.as_ptr(),
                    count,
                    tables.pointers.as_ptr(),
                    weights.as_ptr(),
                    decays.as_ptr(),
                    acc.as_mut_ptr(),
                )
            }
        }
    }

    /// Runs the value epilogue for one head: `arrays` holds the accumulator at
    /// `shape().accumulator()`; the output lands at `shape().output()`.
    pub fn epilogue(&self, tables: &Tables, arrays: &mut [f32], denominator: f32) {
        self.check_tables(tables);
        assert_eq!(arrays.len(), self.shape.arrays_len, "arrays");
        // SAFETY: the sizes the code was compiled for, checked above.
        unsafe { (self.epilogue)(tables.pointers.as_ptr(), arrays.as_mut_ptr(), denominator) }
    }
}
