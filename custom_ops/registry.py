"""The `v41` op namespace: every irregular step of the model is an op defined here with
`torch.library` (schema, fake impl, torch reference impl). The reference impl is the definition;
faster impls (Triton on CUDA, AITER on ROCm) register under the same name and are checked
against it. Ops write into caller-allocated outputs (`Tensor(a!)`) and return nothing, so the
compiler sees fixed shapes and the fake impl has nothing to compute.
"""
from __future__ import annotations

import contextlib
import logging
import os
from typing import Callable

import torch

NAMESPACE = "v41"
_defined: dict[str, str] = {}
_reference_fns: dict[str, Callable] = {}
log = logging.getLogger("v41.custom_ops")


def define(schema: str):
    """Define `v41::<name>` from `schema` ("name(args) -> ()") and register the decorated
    function as its reference impl for every device. Mutating ops return nothing, so their fake
    impl is a no-op."""
    name = schema.split("(", 1)[0]

    def register(fn):
        qual = f"{NAMESPACE}::{name}"
        if qual in _defined:
            raise RuntimeError(f"{qual} defined twice")
        torch.library.define(qual, schema[len(name):])
        torch.library.impl(qual, "CompositeExplicitAutograd")(fn)
        torch.library.register_fake(qual)(lambda *a, **k: None)
        _defined[qual] = fn.__module__
        _reference_fns[qual] = fn
        return fn

    return register


def op(name: str):
    return getattr(torch.ops.v41, name)


def defined() -> dict[str, str]:
    return dict(_defined)


# ---- alternative impls per backend ---------------------------------------------------------
# A backend registers its impl of a defined op for one device type. The first registration for
# (op, device type) installs, under that device's dispatch key, a thin trampoline into a table;
# the table entry is the highest-priority backend registered (or the one V41_OP_BACKEND names),
# so backends can register in any order and the reference (CompositeExplicitAutograd) stays the
# impl of every device nobody registered for. ROCm tensors dispatch under the CUDA key too.

PRIORITY = {"reference": 0, "triton": 10, "aiter": 20}
_DISPATCH_KEYS = {"cuda": "CUDA", "cpu": "CPU", "xpu": "XPU"}
_impls: dict[tuple[str, str], dict[str, Callable]] = {}    # (qual, device type) -> backend -> fn
_table: dict[tuple[str, str], tuple[str, Callable]] = {}   # (qual, device type) -> (backend, fn)


def _qual(name: str) -> str:
    return name if "::" in name else f"{NAMESPACE}::{name}"


def _forced(qual: str) -> str | None:
    """V41_OP_BACKEND: "reference" (every op) or "sparse_attn=reference,index_topk=triton"."""
    spec = os.environ.get("V41_OP_BACKEND", "").strip()
    if not spec:
        return None
    if "=" not in spec:
        return spec
    for item in spec.split(","):
        op_name, _, backend = item.partition("=")
        if _qual(op_name.strip()) == qual:
            return backend.strip()
    return None


def _select(qual: str, device_type: str) -> None:
    impls = _impls[(qual, device_type)]
    want = _forced(qual)
    if want is not None and want in impls:
        backend = want
    else:
        backend = max(impls, key=lambda b: PRIORITY.get(b, 5))
    _table[(qual, device_type)] = (backend, impls[backend])


def register_impl(name: str, backend: str, fn: Callable | None = None, *, device_type: str = "cuda"):
    """Register `fn` (same signature as the op) as `backend`'s impl of `v41::name` for tensors of
    `device_type`; usable as a decorator. The reference impl stays registered for every device
    and is always selectable as backend "reference"."""
    qual = _qual(name)
    if qual not in _defined:
        raise RuntimeError(f"{qual} is not defined; import its custom_ops module first")
    if device_type not in _DISPATCH_KEYS:
        raise ValueError(f"device_type {device_type!r}: expected one of {tuple(_DISPATCH_KEYS)}")

    def register(f):
        key = (qual, device_type)
        if key not in _impls:
            _impls[key] = {"reference": _reference_fns[qual]}

            def trampoline(*args, **kwargs):
                return _table[key][1](*args, **kwargs)

            trampoline.__name__ = f"{qual.split('::')[1]}_{device_type}"
            torch.library.impl(qual, _DISPATCH_KEYS[device_type])(trampoline)
        _impls[key][backend] = f
        _select(qual, device_type)
        log.debug("%s: %s impl registered for %s", qual, backend, device_type)
        return f

    return register(fn) if fn is not None else register


def select(name: str, backend: str, device_type: str = "cuda") -> None:
    """Pin `backend` (registered, or "reference") as the impl of `v41::name` on `device_type`."""
    qual = _qual(name)
    if backend == "reference" and (qual, device_type) not in _impls:
        return
    impls = _impls[(qual, device_type)]
    if backend not in impls:
        raise KeyError(f"{qual}: no {backend!r} impl for {device_type} (have {sorted(impls)})")
    _table[(qual, device_type)] = (backend, impls[backend])


@contextlib.contextmanager
def using(backend: str, device_type: str = "cuda", names=None):
    """Inside the block, the ops in `names` (default: all) that have `backend` for `device_type`
    run it ("reference": every op runs its definition); the previous choice returns after."""
    saved = dict(_table)
    try:
        for (q, dev), impls in _impls.items():
            if dev == device_type and backend in impls and (names is None or q.split("::")[1] in names):
                _table[(q, dev)] = (backend, impls[backend])
        yield
    finally:
        _table.clear()
        _table.update(saved)


def selected() -> dict[str, dict[str, str]]:
    """{op: {device type: backend}} for every defined op ("reference" where nothing else is
    registered)."""
    out = {q: {"cpu": "reference", "cuda": "reference"} for q in _defined}
    for (q, dev), (backend, _) in _table.items():
        out.setdefault(q, {})[dev] = backend
    return out


def log_selected(device_type: str | None = None) -> dict[str, dict[str, str]]:
    """Log (INFO, logger "v41.custom_ops") the impl each op runs with; call once at startup."""
    sel = selected()
    log.info("custom ops: %s", "; ".join(
        f"{q.split('::')[-1]} " + ",".join(f"{d}={b}" for d, b in sorted(by_dev.items())
                                          if device_type is None or d == device_type)
        for q, by_dev in sorted(sel.items())))
    return sel
