"""Dumps: the pass manager's before/after graphs and Inductor's output code routed into a piece's
dump directory, and depyf's decompiled Dynamo bytecode (`depyf.prepare_debug`; never the
interactive `depyf.debug`)."""
from __future__ import annotations

import contextlib
import logging
from pathlib import Path

log = logging.getLogger("v41.compile")


@contextlib.contextmanager
def _dump_context(pass_manager, directory: Path | None):
    """Route the pass manager's before/after dumps and Inductor's output code to `directory`."""
    if directory is None:
        yield
        return
    from torch._inductor.graph import GraphLowering
    prev_hook = GraphLowering.save_output_code
    n = [0]

    def save(code: str):
        name = "output_code.py" if n[0] == 0 else f"output_code.{n[0]}.py"
        (directory / name).write_text(code)
        n[0] += 1

    GraphLowering.save_output_code = save
    prev_dir = pass_manager.set_dump_dir(directory) if pass_manager is not None else None
    try:
        yield
    finally:
        GraphLowering.save_output_code = prev_hook
        if pass_manager is not None:
            pass_manager.set_dump_dir(prev_dir)



@contextlib.contextmanager
def _depyf(dump_dir: str):
    """depyf's dump of the Dynamo-transformed bytecode (decompiled), when depyf is installed."""
    try:
        import depyf
    except ImportError:
        yield
        return
    path = Path(dump_dir, "depyf")
    path.mkdir(parents=True, exist_ok=True)
    try:
        ctx = depyf.prepare_debug(str(path))
        ctx.__enter__()
    except Exception as e:  # noqa: BLE001  (depyf lags torch; a dump must not break a compile)
        log.warning("depyf unavailable for this torch: %s", e)
        yield
        return
    try:
        yield
    finally:
        try:
            ctx.__exit__(None, None, None)
        except Exception as e:  # noqa: BLE001
            log.warning("depyf dump incomplete: %s", e)
