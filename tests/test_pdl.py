"""Programmatic dependent launch (custom_ops/triton/common.py `pdl`): a kernel launched with it may
run beside the end of the kernel before it, so it must wait (`pdl_wait(PDL)`) before it touches
memory another kernel writes or reads. These read the kernels' source: every kernel that takes
PDL waits first thing, and every launch in custom_ops/triton passes `**pdl(device)`; the sm_90
build shows the wait and the launch trigger in the PTX before the first global access, and
nothing of them without PDL."""
from __future__ import annotations

import ast
import inspect
import os
import textwrap

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed (make setup installs it)")
from custom_ops.triton.common import pdl  # noqa: E402
from tests.triton_source import case_module, jit_functions, modules  # noqa: E402


def pdl_kernels() -> dict:
    return {name: f for name, f in jit_functions() if "PDL" in f.arg_names and f.__name__ != "pdl_wait"}


def first_statement(fn) -> ast.stmt:
    body = ast.parse(textwrap.dedent(fn.src)).body[0].body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]                                   # the docstring
    return body[0]


# kernels that may load constant weights before the wait, with PREFETCH: {kernel: {pointer: its source}}
PREFETCHING = {"_fp8_gemv_kernel": {"w_at": "w_ptr", "s_at": "ws_ptr"}}


def test_every_pdl_kernel_waits_first():
    found = pdl_kernels()
    assert len(found) >= 30, sorted(found)
    bad = [name for name, fn in found.items() if ast.unparse(first_statement(fn)) !=
           ("if not PREFETCH:\n    pdl_wait(PDL)" if fn.__name__ in PREFETCHING else "pdl_wait(PDL)")]
    assert not bad, f"kernels taking PDL whose first statement is not pdl_wait(PDL): {bad}"


def before_wait_with_prefetch(fn) -> list:
    """The statements a PREFETCH launch runs before `pdl_wait(PDL)`: the body's top level with
    `if PREFETCH:` blocks inlined, `if not PREFETCH:` blocks dropped and `if TMA:` blocks
    replaced by their else branch (the launcher refuses TMA with PREFETCH), recursively."""
    def flatten(body):
        flat = []
        for st in body:
            test = ast.unparse(st.test) if isinstance(st, ast.If) else None
            if test == "PREFETCH":
                flat += flatten(st.body)
            elif test == "TMA":
                flat += flatten(st.orelse)
            elif test != "not PREFETCH":
                flat.append(st)
        return flat
    flat = flatten(ast.parse(textwrap.dedent(fn.src)).body[0].body)
    waits = [i for i, st in enumerate(flat) if ast.unparse(st) == "pdl_wait(PDL)"]
    assert waits, f"{fn.__name__}: no pdl_wait(PDL) on the PREFETCH path"
    return flat[:waits[0]]


@pytest.mark.parametrize("name", sorted(PREFETCHING))
def test_a_prefetching_kernel_touches_only_weights_before_its_wait(name):
    fn = next(f for k, f in pdl_kernels().items() if k.endswith("." + name))
    allowed = PREFETCHING[name]
    for st in before_wait_with_prefetch(fn):
        for node in ast.walk(st):
            if isinstance(node, ast.Call) and ast.unparse(node.func).startswith("tl.") and \
                    any(w in ast.unparse(node.func) for w in ("store", "atomic")):
                raise AssertionError(f"{name} writes before its wait: {ast.unparse(st)}")
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "tl.load":
                names = {n.id for n in ast.walk(node.args[0]) if isinstance(n, ast.Name)}
                assert names & set(allowed) and not names - set(allowed) - {"k_lo", "GROUP_K"}, ast.unparse(st)
            if isinstance(node, ast.Assign) and any(ast.unparse(t) in allowed for t in node.targets):
                src = {n.id for n in ast.walk(node.value) if isinstance(n, ast.Name) and n.id.endswith("_ptr")}
                assert src == {allowed[ast.unparse(node.targets[0])]}, ast.unparse(st)


def launches(mod):
    """(kernel name, passes **pdl(...)) of each `kernel[grid](...)` call in `mod`'s source."""
    jit = {n for n, f in vars(mod).items() if isinstance(f, triton.runtime.JITFunction)}
    tree = ast.parse(inspect.getsource(mod))
    # a launcher's `kernel` argument (norm, rope), or `kernel = _a if fp8 else _b`
    local_kernels = {a.arg for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) for a in n.args.args
                     if a.arg == "kernel"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(isinstance(n, ast.Name) and n.id in jit for n in ast.walk(node.value)):
            local_kernels |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript) and \
                isinstance(node.func.value, ast.Name) and node.func.value.id in jit | local_kernels:
            yield node.func.value.id, any(k.arg is None and isinstance(k.value, ast.Call) and
                                          getattr(k.value.func, "id", None) == "pdl" for k in node.keywords)


def test_every_launch_passes_pdl():
    found = [(m.__name__, name, ok) for m in modules() for name, ok in launches(m)]
    assert len(found) >= 30, found
    missing = [(m, name) for m, name, ok in found if not ok]
    assert not missing, f"launches without **pdl(device): {missing}"


def test_the_launch_check_sees_a_launch_without_pdl(tmp_path, monkeypatch):
    case = case_module(tmp_path, monkeypatch, "pdl_launch_case",
                       "import triton\nimport triton.language as tl\nfrom custom_ops.triton.common import pdl\n\n"
                       "@triton.jit\ndef k(x_ptr, PDL: tl.constexpr = False):\n    tl.store(x_ptr, 0)\n\n"
                       "def go(x):\n    k[(1,)](x, **pdl(x.device))\n    k[(1,)](x)\n")
    assert list(launches(case)) == [("k", True), ("k", False)]


def test_no_pdl_off_cuda():
    assert pdl(torch.device("cpu")) == {}


@pytest.mark.parametrize("capability,env,on", [((9, 0), None, True), ((8, 0), None, False), ((9, 0), "0", False)])
def test_pdl_on_hopper_unless_switched_off(monkeypatch, capability, env, on):
    from custom_ops.triton import common
    monkeypatch.setattr(common, "_pdl", {})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: capability)
    if env is None:
        monkeypatch.delenv("V41_PDL", raising=False)
    else:
        monkeypatch.setenv("V41_PDL", env)
    assert pdl(torch.device("cuda", 0)) == ({"PDL": True, "launch_pdl": True} if on else {})


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="builds kernels: needs compiled Triton")
def test_the_hopper_build_waits_before_its_first_load():
    from benchmarks import sass as S
    if not S.tools_present():
        pytest.skip(f"this Triton build ships no CUDA ptxas in {S.NVIDIA_BIN}")
    from custom_ops.triton.norm import _rms_norm_kernel
    sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "N": "i32", "D": "i32", "eps": "fp32",
           "stride_x": "i32", "stride_o": "i32", "BLOCK_R": "constexpr", "BLOCK_D": "constexpr",
           "ONE_PASS": "constexpr"}
    for width, one_pass in ((8192, True), (1024, False)):
        ptx = {on: S.build(_rms_norm_kernel, sig, {"BLOCK_R": 1, "BLOCK_D": width, "ONE_PASS": one_pass,
                                                   "PDL": on}).asm["ptx"] for on in (False, True)}
        assert "griddepcontrol" not in ptx[False]
        body = ptx[True]
        first_load = body.index("ld.global")
        assert body.index("griddepcontrol.wait") < first_load, "the wait comes after a global load"
        assert body.index("griddepcontrol.launch_dependents") < first_load
