"""Run ferrum's Gluon kernels (ferrum/ops/gemv_gluon.py) in Triton's CPU interpreter.

Gluon has no interpreter of its own. Its ops mirror Triton's (`gl.load` / `tl.load`, ...) and
differ in that every tensor carries an explicit register layout. `interpreted(kernel)` rebuilds
a Gluon kernel (and the Gluon helpers it calls) from its Python code with `gl` bound to a
namespace that maps each op onto its `tl` twin and drops the layouts, then wraps it in
`triton.jit`, which under TRITON_INTERPRET=1 runs it with numpy. So the tests check the
kernels' arithmetic, indexing and masks against a float64 reference on CPU; the layouts are
checked separately by compiling for sm_90 (tests/test_quant_kernels.py).
Needs TRITON_INTERPRET=1 set before triton is imported.
"""
from __future__ import annotations

import types

import triton
import triton.language as tl
from triton.experimental.gluon._runtime import GluonJITFunction
from triton.runtime.jit import ConstexprFunction


class _Shim:
    """`gl` for the interpreter: each attribute is looked up on `tl` when used (the interpreter
    patches tl's functions while a kernel runs); the ops that take a layout drop it."""

    @staticmethod
    def arange(start, end, layout=None):
        return tl.arange(start, end)

    @staticmethod
    def zeros(shape, dtype, layout=None):
        return tl.zeros(shape, dtype)

    @staticmethod
    def full(shape, value, dtype, layout=None):
        return tl.full(shape, value, dtype)

    @staticmethod
    def convert_layout(x, layout, assert_trivial=False):
        return x

    @staticmethod
    def inline_asm_elementwise(asm, constraints, args, dtype, is_pure, pack):
        """dp4a / dp2a (`gemv_gluon._dp4a`, `_dp2a`) computed with tl ops; PDL's asm returns
        None (the tests launch without it)."""
        if asm.startswith("dp4a.u32.s32"):
            a, b = args
            out = tl.zeros(a.shape, tl.int32)
            for i in range(4):  # byte i of a (unsigned) times byte i of b (signed)
                out += ((a >> (8 * i)) & 0xFF) * ((b << (24 - 8 * i)) >> 24)
            return out
        if asm.startswith("dp2a."):
            a, b, c = args
            first = 2 if asm.startswith("dp2a.hi") else 0
            a, b = tl.broadcast(a, b)
            out = c + tl.zeros(a.shape, tl.int32)
            for i in range(2):  # signed 16-bit half i of a times unsigned byte first + i of b
                out += ((a << (16 - 16 * i)) >> 16) * ((b >> (8 * (first + i))) & 0xFF)
            return out
        return None

    @staticmethod
    def BlockedLayout(*args, **kwargs):
        return None

    @staticmethod
    def SliceLayout(*args, **kwargs):
        return None

    @staticmethod
    def num_warps():
        return 4

    def __getattr__(self, name):
        return getattr(tl, name)


SHIM = _Shim()

_SCOPES: dict[int, dict] = {}  # id of a module's globals -> the shim scope of its kernels


def _constexpr_annotations(kernel):
    """The interpreter re-reads a kernel's source and takes a parameter as constexpr only when
    its (string) annotation normalizes to "constexpr": "tl.constexpr" does, "gl.constexpr" does
    not. Rename those of the rewritten function."""
    rewrite = kernel.rewrite

    def rewrite_constexpr():
        fn = rewrite()
        fn.__annotations__ = {k: "constexpr" if str(v).endswith("constexpr") else v
                              for k, v in fn.__annotations__.items()}
        return fn

    kernel.rewrite = rewrite_constexpr
    return kernel


def _scope(module_globals: dict) -> dict:
    """One scope per module: its globals with `gl` the shim, every Gluon function of the module
    rebuilt on this scope (so helpers call helpers) and constexpr functions unwrapped."""
    key = id(module_globals)
    if key not in _SCOPES:
        scope = _SCOPES[key] = dict(module_globals)
        scope["gl"] = SHIM
        for name, val in module_globals.items():
            if isinstance(val, GluonJITFunction):
                raw = val.fn
                fn = types.FunctionType(raw.__code__, scope, raw.__name__, raw.__defaults__, raw.__closure__)
                scope[name] = _constexpr_annotations(triton.jit(fn))
            elif isinstance(val, ConstexprFunction):
                scope[name] = val.fn
    return _SCOPES[key]


def interpreted(kernel: GluonJITFunction):
    """A `triton.jit` (interpreter) version of a Gluon kernel defined at a module's top level."""
    return _scope(kernel.fn.__globals__)[kernel.fn.__name__]
