"""Compile a Gluon kernel's launch for a Hopper GPU without one: what the CPU tests check the
Gluon kernels with. `args` may hold CPU tensors, which stand in for CUDA tensors of the same
shapes, strides, dtypes and alignment. Triton's own argument binder and specializer run as at
a launch, then triton.compile (which runs ptxas); this reads Triton internals (3.6 and 3.9)."""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import make_backend
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import create_function_from_signature


def compile_offline(kernel, args, capability: int = 90):
    """The CompiledKernel of `kernel`'s launch for `args` on compute capability `capability`."""
    plan = kernel.plan(args, cuda=True)
    values, meta = plan.jit_values(plan.values), plan.meta
    target = GPUTarget("cuda", capability, 32)
    backend = make_backend(target)
    fn = plan.kernel
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*values, **meta)
    options, signature, constexprs, attrs = fn._pack_args(backend, meta, bound, specialization, options)
    return triton.compile(GluonASTSource(fn, signature, constexprs, attrs), target=target,
                          options=options.__dict__)
