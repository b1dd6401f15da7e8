"""What `python -m v41.serve`, `v41.generate` and `v41.prebuild` share: a dataclass's fields as
flags (`EngineArgs.add_cli_args` is built on it) and the one exit for a refused setting."""
from __future__ import annotations

import argparse
import dataclasses
import sys
import types
import typing

from runtime.geometry import AdmissionError
from v41.config import ConfigError

REFUSED = 2          # exit status of a refused setting (argparse's own usage errors exit 2 too)


class exit_on_refusal:
    """The setup of a command, refused as a whole:

        with exit_on_refusal() as refused:
            ...                              # an AdmissionError/ConfigError/ValueError here
        if refused:                          # printed `error: <message>` on stderr
            return refused.status            # 2
    """

    status = REFUSED

    def __init__(self):
        self.error: BaseException | None = None

    def __enter__(self) -> "exit_on_refusal":
        return self

    def __exit__(self, et, e, tb) -> bool:
        if et is None or not issubclass(et, (AdmissionError, ConfigError, ValueError)):
            return False
        self.error = e
        print(f"error: {e}", file=sys.stderr)
        return True

    def __bool__(self) -> bool:
        return self.error is not None


def _base_type(t):
    if isinstance(t, types.UnionType) or typing.get_origin(t) is typing.Union:
        args = [a for a in typing.get_args(t) if a is not type(None)]
        return args[0] if len(args) == 1 else str
    return t


def add_field_flags(group, cls, exclude=(), actions=None) -> list[str]:
    """One flag per scalar field of dataclass `cls`: `--field-name` plus the field's
    metadata["aliases"] (minus `exclude`), help from metadata["help"] with the default; bool
    fields are `--[no-]field-name` (BooleanOptionalAction, or `actions[name]`). Returns the names."""
    hints = typing.get_type_hints(cls)
    names = []
    for f in dataclasses.fields(cls):
        t = _base_type(hints.get(f.name, str))
        if t not in (bool, int, float, str):
            continue
        flags = [x for x in ["--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ())]
                 if x not in exclude]
        default = f.default if f.default is not dataclasses.MISSING else None
        h = f.metadata.get("help", f.name.replace("_", " "))
        if t is bool:
            group.add_argument(*flags, dest=f.name, default=default,
                               action=(actions or {}).get(f.name, argparse.BooleanOptionalAction),
                               help=f"{h} (default: {'on' if default else 'off'})")
        else:
            group.add_argument(*flags, dest=f.name, type=t, default=default, metavar=f.name.upper(),
                               help=f"{h} (default: {default})" if default is not None else h)
        names.append(f.name)
    return names
