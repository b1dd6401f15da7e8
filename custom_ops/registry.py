"""The `v41` op namespace: every irregular step of the model is an op defined here with
`torch.library` (schema, fake impl, torch reference impl). The reference impl is the definition;
faster impls (Triton on CUDA, AITER on ROCm) register under the same name and are checked
against it. Ops write into caller-allocated outputs (`Tensor(a!)`) and return nothing, so the
compiler sees fixed shapes and the fake impl has nothing to compute.
"""
from __future__ import annotations

import torch

NAMESPACE = "v41"
_defined: dict[str, str] = {}


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
        return fn

    return register


def op(name: str):
    return getattr(torch.ops.v41, name)


def defined() -> dict[str, str]:
    return dict(_defined)
