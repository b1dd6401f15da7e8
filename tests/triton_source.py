"""Reading the Triton kernels as source, for the tests that check every kernel
(tests/test_triton_globals.py, tests/test_pdl.py): the modules of custom_ops/triton, their jit
functions, and a throwaway module to show that a check catches what it looks for."""
from __future__ import annotations

import importlib
import pkgutil

import triton

import custom_ops.triton as kernels


def modules():
    """Every module of custom_ops/triton, imported."""
    for info in pkgutil.iter_modules(kernels.__path__):
        yield importlib.import_module(f"{kernels.__name__}.{info.name}")


def jit_functions():
    """(module.name, fn) of every @triton.jit function defined in custom_ops/triton."""
    for mod in modules():
        for name, obj in vars(mod).items():
            if isinstance(obj, triton.runtime.JITFunction) and obj.__module__ == mod.__name__:
                yield f"{mod.__name__}.{name}", obj


def case_module(tmp_path, monkeypatch, name: str, source: str):
    """`source` written as module `name` in tmp_path, imported."""
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    return importlib.import_module(name)
