//! The JIT module: host ISA and settings, function definition, finalizing, and
//! the executable memory the compiled functions live in.

use cranelift_codegen::ir::{self, types, AbiParam, UserFuncName};
use cranelift_codegen::settings::{self, Configurable};
use cranelift_codegen::Context;
use cranelift_frontend::{FunctionBuilder, FunctionBuilderContext};
use cranelift_jit::{JITBuilder, JITModule};
use cranelift_module::{default_libcall_names, FuncId, Linkage, Module};

use super::expr::Fx;
use super::ErrorKind;

pub(super) struct Jit {
    module: JITModule,
    ctx: Context,
    builder: FunctionBuilderContext,
}

impl Jit {
    /// A module for the host, with `settings` applied over the defaults.
    ///
    /// `opt_level = none`: the lowering schedules, folds and hoists itself
    /// (see `expr.rs`); Cranelift's e-graph pass would place every pure value
    /// at its last use, which turns a page's long fma chains into spills
    /// (up to 1.7x slower on the bundled specs, never 1% faster;
    /// docs/cpu-bench.md).
    pub fn new(settings: &[(String, String)]) -> Result<Jit, ErrorKind> {
        let mut flags = settings::builder();
        let defaults = [
            ("opt_level", "none"),
            ("use_colocated_libcalls", "false"),
            ("is_pic", "false"),
        ];
        let requested = settings.iter().map(|(n, v)| (n.as_str(), v.as_str()));
        for (name, value) in defaults.into_iter().chain(requested) {
            flags.set(name, value).map_err(|e| ErrorKind::Setting {
                name: name.to_string(),
                value: value.to_string(),
                message: e.to_string(),
            })?;
        }
        let isa = cranelift_native::builder()
            .map_err(|e| ErrorKind::Isa(e.to_string()))?
            .finish(settings::Flags::new(flags))
            .map_err(|e| ErrorKind::Isa(e.to_string()))?;
        if isa.pointer_type() != types::I64 {
            return Err(ErrorKind::Isa(format!(
                "pointers are {}, the kernels need 64-bit addresses",
                isa.pointer_type()
            )));
        }
        // `fma` on a host without FMA becomes a call to libm's `fmaf`, which
        // the JIT resolves in the running process.
        let module = JITModule::new(JITBuilder::with_isa(isa, default_libcall_names()));
        Ok(Jit {
            ctx: module.make_context(),
            module,
            builder: FunctionBuilderContext::new(),
        })
    }

    /// Declares and compiles a function of `params` (no results) whose body
    /// `build` emits from the entry block, which holds the parameters.
    pub fn define(
        &mut self,
        name: &'static str,
        params: &[ir::Type],
        lanes: usize,
        build: impl FnOnce(&mut Fx, &[ir::Value]),
    ) -> Result<FuncId, ErrorKind> {
        let compile = |message: String| ErrorKind::Compile {
            function: name,
            message,
        };
        let mut signature = self.module.make_signature();
        signature
            .params
            .extend(params.iter().map(|&t| AbiParam::new(t)));
        let id = self
            .module
            .declare_function(name, Linkage::Local, &signature)
            .map_err(|e| compile(e.to_string()))?;
        self.module.clear_context(&mut self.ctx);
        self.ctx.func.signature = signature;
        self.ctx.func.name = UserFuncName::user(0, id.as_u32());
        let config = self.module.target_config();
        let mut b = FunctionBuilder::new(&mut self.ctx.func, &mut self.builder);
        let entry = b.create_block();
        b.append_block_params_for_function_params(entry);
        b.switch_to_block(entry);
        let args = b.block_params(entry).to_vec();
        let mut fx = Fx::new(b, lanes);
        build(&mut fx, &args);
        fx.b.seal_all_blocks();
        fx.b.finalize(config);
        self.module
            .define_function(id, &mut self.ctx)
            .map_err(|e| compile(describe(&e, &self.ctx)))?;
        Ok(id)
    }

    /// Links the defined functions into executable memory; returns it with
    /// the address of each of `functions`.
    pub fn finish<const N: usize>(
        mut self,
        functions: [FuncId; N],
    ) -> Result<(Code, [*const u8; N]), ErrorKind> {
        self.module
            .finalize_definitions()
            .map_err(|e| ErrorKind::Link(e.to_string()))?;
        let addresses = functions.map(|id| self.module.get_finalized_function(id));
        Ok((Code(Some(self.module)), addresses))
    }
}

/// A module error with the verifier's findings spelled out against the
/// function text when there are any.
fn describe(error: &cranelift_module::ModuleError, ctx: &Context) -> String {
    match error {
        cranelift_module::ModuleError::Compilation(cranelift_codegen::CodegenError::Verifier(
            errors,
        )) => {
            cranelift_codegen::print_errors::pretty_verifier_error(&ctx.func, None, errors.clone())
        }
        other => other.to_string(),
    }
}

/// The executable memory of finalized functions; freed on drop.
pub(super) struct Code(Option<JITModule>);

// SAFETY: `Code` exposes nothing: after `finish` the module is only moved
// and, on drop, consumed to free its memory, so its interior-mutable symbol
// cache is never reached from two threads. The code itself is immutable.
unsafe impl Send for Code {}
unsafe impl Sync for Code {}

impl Drop for Code {
    fn drop(&mut self) {
        if let Some(module) = self.0.take() {
            // SAFETY: the function pointers live in `Kernels` next to this
            // `Code` and are dropped with it; no call can still be running,
            // since calls borrow the `Kernels`.
            unsafe { module.free_memory() };
        }
    }
}

#[cfg(test)]
mod tests {
    use cranelift_codegen::ir::InstBuilder;

    use super::Jit;
    use crate::back::clif::ErrorKind;

    /// Cranelift's verifier rejecting a function is an error naming the
    /// function, with the verifier's findings, not a panic.
    #[test]
    fn verifier_errors_are_typed() {
        let mut jit = Jit::new(&[]).expect("host JIT");
        let error = jit
            .define("ill_typed", &[], 1, |fx, _| {
                let int = fx.iconst(1);
                let float = fx.b.ins().f32const(1.0);
                fx.b.ins().iadd(int, float);
                fx.b.ins().return_(&[]);
            })
            .expect_err("an i32 plus an f32 does not verify");
        match error {
            ErrorKind::Compile { function, message } => {
                assert_eq!(function, "ill_typed");
                assert!(message.contains("iadd"), "{message}");
            }
            other => panic!("expected a compile error, got {other:?}"),
        }
    }
}
