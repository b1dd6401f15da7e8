"""Run the Triton interpreter's programs in reverse order (V41_PROGRAM_ORDER=reversed).

The interpreter runs a grid's programs one after another, in order, so a kernel whose programs
depend on each other (one reads what another writes, two write one element) can pass the CPU
tests by luck of that order and fail on a GPU, where they run at once. The interpreter tests run
a second time with the order reversed: such a kernel then gives another result.

`apply` also spares the interpreter work that changes nothing: every call of a @triton.jit helper
inside a kernel re-patches triton.language for the interpreter (`_patch_lang`, inspect.getmembers
of its modules: 42% of a test_native_experts.py test's time under cProfile), though the kernel's
launch patched it already and restores it at the end. A helper's call now skips that while the
kernel's patch holds.
"""
from __future__ import annotations

import inspect
import os
import textwrap

REVERSED = os.environ.get("V41_PROGRAM_ORDER") == "reversed"


def apply() -> None:
    """Helpers' calls skip re-patching (`_patch_lang_once`); with V41_PROGRAM_ORDER=reversed,
    patch the interpreter's grid loop (triton.runtime.interpreter.GridExecutor.__call__) to
    visit every grid axis backwards, and check on a kernel whose programs all write one element
    that the last writer is now program 0."""
    _patch_lang_once()
    if not REVERSED:
        return
    import torch
    import triton
    import triton.language as tl
    import triton.runtime.interpreter as interp

    src = textwrap.dedent(inspect.getsource(interp.GridExecutor.__call__))
    for ax in range(3):
        loop = f"range(grid[{ax}])"
        if loop not in src:
            raise RuntimeError(f"triton's interpreter has no `{loop}` loop to reverse: update "
                               "tests/program_order.py for this triton version")
        src = src.replace(loop, f"reversed({loop})")
    scope = dict(vars(interp))
    exec(compile(src, interp.__file__, "exec"), scope)
    interp.GridExecutor.__call__ = scope["__call__"]

    @triton.jit
    def last_writer(out_ptr):
        tl.store(out_ptr, tl.program_id(0))

    out = torch.full((1,), -1, dtype=torch.int32)
    last_writer[(4,)](out)
    assert out.item() == 0, f"program order not reversed (last writer {out.item()})"


def _patch_lang_once() -> None:
    """triton.runtime.interpreter._patch_lang, but a no-op (an empty scope) where every language
    module the function sees is patched already: a helper called inside a running kernel. A
    kernel's launch finds them unpatched (the last launch restored them) and patches as before."""
    import triton.language as tl
    import triton.runtime.interpreter as interp

    real = interp._patch_lang
    if getattr(real, "once", False):
        return

    def patch_lang(fn):
        langs = [v for v in fn.__globals__.values() if v is tl or v is tl.core]
        patched = not tl.core.is_builtin(tl.tensor.__add__) and not any(tl.core.is_builtin(lang.load) for lang in langs)
        return interp._LangPatchScope() if langs and patched else real(fn)
    patch_lang.once = True
    interp._patch_lang = patch_lang
