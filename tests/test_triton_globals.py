"""Compiled Triton (unlike TRITON_INTERPRET=1) reads a module global inside a @triton.jit
function only when it is a tl.constexpr (or a function, module or dtype): a plain `GROUP = 32`
compiles under the interpreter and fails at the first launch on a GPU. This walks every kernel in
custom_ops/triton and names each plain number it reads from its module."""
from __future__ import annotations

import ast
import textwrap

import pytest

triton = pytest.importorskip("triton", reason="triton is not installed (make setup installs it)")
from tests.triton_source import case_module, jit_functions  # noqa: E402


def plain_globals(fn) -> set[str]:
    tree = ast.parse(textwrap.dedent(fn.src))
    local = {a.arg for n in ast.walk(tree) if isinstance(n, ast.arguments) for a in n.args + n.kwonlyargs}
    local |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    env = fn.fn.__globals__
    return {n.id for n in ast.walk(tree)
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id not in local
            and n.id in env and isinstance(env[n.id], (bool, int, float))}


def test_kernels_read_only_constexpr_globals():
    found = dict(jit_functions())
    assert len(found) > 20          # the walk sees the kernels
    bad = {name: sorted(g) for name, fn in found.items() if (g := plain_globals(fn))}
    assert not bad, f"plain module numbers read inside @triton.jit (wrap them in tl.constexpr): {bad}"


def test_the_check_sees_a_plain_global(tmp_path, monkeypatch):
    case = case_module(tmp_path, monkeypatch, "plain_global_case",
                       "import triton\nimport triton.language as tl\nGROUP = 32\nWIDTH = tl.constexpr(32)\n\n"
                       "@triton.jit\ndef k(x_ptr, BLOCK: tl.constexpr):\n"
                       "    tl.store(x_ptr + tl.arange(0, GROUP) + tl.arange(0, WIDTH) + tl.arange(0, BLOCK), 0)\n")
    assert plain_globals(case.k) == {"GROUP"}
