"""Run kvmesh's Triton kernels under Triton's interpreter on CPU tensors, in a test process.

Triton picks interpreter or compiler when it decorates a kernel (``TRITON_INTERPRET`` at import).
`interpreted_kernels` imports the kernel bodies a second time, under another package name, with
the variable set, so this process has an interpreted copy whatever imported triton or the
compiled kernels first; `kvmesh.kernels._dispatch.kernels_for` is pointed at that copy for CPU
tensors per test (tests/kernels/conftest.py), so nothing leaks into other tests, where the
engine's CPU path stays on the torch reference.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from types import ModuleType

_BODIES = "kvmesh.kernels._triton"
_COPY = "kvmesh.kernels._triton_interpreted"


def patch_interpreter() -> None:
    """Work around four Triton 3.6 interpreter gaps (interpreter only; idempotent).

    1. Scalars are 1-element arrays converted with ``int(array)``, which numpy >= 2.4 refuses, so
       ``range(scalar_tensor)`` fails: re-patch ``__index__``.
    2. ``tl.dot`` on bfloat16 runs ``np.matmul`` on the raw uint16 bit patterns (numpy has no
       bf16): widen bf16 operands to fp32 first, which is exact and is what the tensor cores do
       before accumulating in fp32.
    3. Triton's own helpers written in Triton (``tl.cdiv``, ``tl.sum``, ``tl.cumsum`` and their
       combine functions) are interpreter functions only if triton was imported with
       ``TRITON_INTERPRET=1`` already set; imported before (by transformers, say), they are
       compiler objects and an interpreted kernel that calls one fails ("Cannot call @triton.jit'd
       outside of the scope of a kernel"). While an interpreted kernel runs, those module
       attributes are swapped for interpreter functions, and put back after it.

    4. Casts to ``tl.float8e4nv`` get the exponent wrong where rounding the mantissa carries
       into it (31.6 becomes 16, not 32): round them with torch instead (nearest even, as the
       GPU's ``cvt.rn`` does; the kernels clamp to the finite range first).

    Known remaining difference: the interpreter rounds fp32 -> bf16 casts toward zero where the
    GPU rounds to nearest even, so interpreted bf16 outputs may be 1 ulp off the GPU's; the
    tests' bf16 tolerances allow for that."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as interp

    orig = interp._patch_lang_tensor
    if not getattr(orig, "_kvmesh_patched", False):
        try:
            int(np.zeros(1, dtype=np.int32))
        except TypeError:

            def patched(tensor, scope):
                orig(tensor, scope)
                scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

            patched._kvmesh_patched = True
            interp._patch_lang_tensor = patched

    builder = interp.InterpreterBuilder
    orig_dot = builder.create_dot
    if not getattr(orig_dot, "_kvmesh_patched", False):

        def widen(h):
            if h.dtype == tl.bfloat16:
                data = interp._convert_float(h.data, tl.bfloat16, tl.float32, None).view(np.float32)
                return interp.TensorHandle(data, tl.float32)
            return h

        def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
            return orig_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

        create_dot._kvmesh_patched = True
        builder.create_dot = create_dot

    orig_convert = interp._convert_float
    if not getattr(orig_convert, "_kvmesh_patched", False):
        import torch

        def convert_float(input, input_dtype, output_dtype, rounding_mode):
            if output_dtype == tl.float8e4nv and input_dtype in (tl.float32, tl.float16, tl.bfloat16):
                if input_dtype == tl.float32:
                    wide = np.asarray(input, dtype=np.float32)
                else:
                    wide = orig_convert(input, input_dtype, tl.float32, None).view(np.float32)
                q = torch.from_numpy(np.ascontiguousarray(wide)).to(torch.float8_e4m3fn)
                return q.view(torch.uint8).numpy().reshape(np.shape(input))
            return orig_convert(input, input_dtype, output_dtype, rounding_mode)

        convert_float._kvmesh_patched = True
        interp._convert_float = convert_float

    orig_patch_lang = interp._patch_lang
    if not getattr(orig_patch_lang, "_kvmesh_patched", False):
        from triton.runtime.jit import JITFunction

        wrapped = {}

        def patch_lang(fn):
            scope = orig_patch_lang(fn)
            for obj in (tl, tl.standard, tl.math, tl.core.tensor):
                for name, value in list(vars(obj).items()):
                    if isinstance(value, JITFunction):  # keyed by id: hashing one walks its globals
                        if id(value) not in wrapped:
                            wrapped[id(value)] = (value, interp.InterpretedFunction(value.fn))
                        scope.set_attr(obj, name, wrapped[id(value)][1])
            return scope

        patch_lang._kvmesh_patched = True
        interp._patch_lang = patch_lang


@functools.cache
def interpreted_kernels() -> ModuleType:
    """An interpreted copy of `kvmesh.kernels._triton` (its submodules included), imported once."""
    patch_interpreter()
    path = importlib.util.find_spec(_BODIES).submodule_search_locations
    spec = importlib.util.spec_from_file_location(
        _COPY, os.path.join(path[0], "__init__.py"), submodule_search_locations=list(path)
    )
    mod = importlib.util.module_from_spec(spec)
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        sys.modules[_COPY] = mod
        spec.loader.exec_module(mod)
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved
    return mod
