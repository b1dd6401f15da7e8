"""A Triton kernel built for Hopper (sm_90) without a GPU, and read back: Triton's compiler and its
bundled ptxas/cuobjdump give the registers, spills and SASS a launch of that Triton version on an
H100 or H200 would get (`benchmarks/sm90_build.py` builds the repository's kernels with these)."""
from __future__ import annotations

import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

HOPPER = GPUTarget("cuda", 90, 32)
NVIDIA_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def tools_present() -> bool:
    return all(os.path.exists(os.path.join(NVIDIA_BIN, t)) for t in ("ptxas", "cuobjdump"))


def build(fn, signature: dict, constexprs: dict, aligned=(), **options):
    """`fn` compiled for sm_90: pointers and the integer arguments named in `aligned` marked
    divisible by 16, as the launcher marks them at such values. A constexpr left out (PDL) takes
    its default."""
    defaults = {p.name: p.default for p in fn.params if p.has_default and p.name not in signature}
    signature, constexprs = {**signature, **dict.fromkeys(defaults, "constexpr")}, {**defaults, **constexprs}
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name, ty in signature.items()
             if ty.startswith("*") or name in aligned}
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                          target=HOPPER, options={"num_warps": 4, **options})


def _cuobjdump(kernel, flag: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([os.path.join(NVIDIA_BIN, "cuobjdump"), flag, f.name],
                              capture_output=True, text=True, check=True).stdout


def usage(kernel) -> dict:
    """cuobjdump's resource usage of the built kernel: REG (registers a thread), STACK and LOCAL
    (bytes a thread; a Triton kernel's stack frame holds spilled registers), SHARED, ..."""
    line = next(ln for ln in _cuobjdump(kernel, "-res-usage").splitlines() if "REG:" in ln)
    return {k: int(v) for k, v in re.findall(r"(\w+):(\d+)", line)}


def resources(kernel) -> dict:
    """A results row's registers and spilled bytes a thread."""
    u = usage(kernel)
    return {"registers": u["REG"], "spilled_bytes": u["STACK"] + u["LOCAL"]}


def registers(kernel) -> int:
    """Registers a thread of the built kernel uses; a build that spills (a stack frame or local
    memory) fails."""
    u = usage(kernel)
    if u["STACK"] or u["LOCAL"]:
        raise AssertionError(f"spills: {u['STACK']} bytes of stack, {u['LOCAL']} of local memory a thread")
    return u["REG"]


def zero_subtractions(kernel) -> int:
    """The PTX's FP32 subtractions from zero (0 - x, which is +0 where x is +0: how Triton compiles
    `-x`), counted where a sign must survive, as in E4M3 codes."""
    ptx = kernel.asm["ptx"]
    zeros = set(re.findall(r"mov\.(?:b32|f32)\s+(%r\w*\d+),\s*0f00000000;", ptx))
    subs = re.findall(r"sub(?:\.rn)?\.f32\s+%\w+,\s*(%r\w*\d+|0f00000000),", ptx)
    return sum(a == "0f00000000" or a in zeros for a in subs)


def per_weight(body: list[str], warps: int, weights: int) -> float:
    """Thread instructions a weight: the loop body's warp instructions over the weights one
    iteration of the program's `warps` warps reads."""
    return round(len(body) * 32 * warps / weights, 2)


def loop_body(kernel, innermost: bool = False) -> list[str]:
    """The opcodes of the largest loop of the kernel's SASS (the instructions from a backward
    branch's target to the branch); `innermost`: of the loops holding no other loop's backward
    branch (a kernel whose TMA loads wait on barriers branches back from waits placed after its
    K loops, a span that holds them all)."""
    ins = _instructions(kernel)
    loops = []
    for addr, text in ins:
        m = re.search(r"BRA\s+(?:`?\()?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            loops.append((int(m.group(1), 16), addr))
    if innermost:
        loops = [(t, a) for t, a in loops if not any(t <= a2 < a for t2, a2 in loops if (t2, a2) != (t, a))]
    best = max(([t for a, t in ins if lo <= a <= hi] for lo, hi in loops), key=len, default=[])
    return [_opcode(t) for t in best]


def opcodes(kernel) -> list[str]:
    """The opcodes of the kernel's SASS, in order (predicates dropped)."""
    return [_opcode(t) for _, t in _instructions(kernel)]


def _opcode(instruction: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", instruction).split()[0]


def _instructions(kernel) -> list[tuple[int, str]]:
    """(address, instruction) of each line of the kernel's SASS."""
    return [(int(m.group(1), 16), m.group(2)) for ln in _cuobjdump(kernel, "-sass").splitlines()
            if (m := re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", ln))]


def asm_layouts(kernel) -> set[str]:
    """The layouts of the tensors the kernel's inline PTX blocks take and give (TTGIR)."""
    ttgir = kernel.asm["ttgir"]
    defs = dict(re.findall(r"^(#blocked\d*) = (#ttg\.blocked<\{[^}]*\}>)", ttgir, re.M))
    used = {name for line in ttgir.splitlines() if "tt.elementwise_inline_asm" in line
            for name in re.findall(r"tensor<\d+x\w+, (#blocked\d*)>", line.rsplit('"', 1)[-1])}
    return {defs[name] for name in used}
