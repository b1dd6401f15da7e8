"""`--tensor-parallel-size N`: N processes, one rank each, every one an LLMEngine on its shard of
the checkpoint (v41.parallel), stepping in lockstep (SPMD).

The process the user started is rank 0, the driver: it spawns ranks 1..N-1 (torch.multiprocessing,
spawn) and takes every request and abort. Each `step()` it broadcasts what it took since the last
step, every rank applies that in the same order and runs the same step, and rank 0's sampled
tokens are broadcast before they are committed: the all-reduced logits are the same on every
rank, the tokens then are too, sampled ones included. A worker that exits stops the driver's next
step with its exit code; a rank that stops answering fails the collective after `TIMEOUT`.
NCCL on CUDA (rank r on cuda:r), gloo on the CPU.
"""
from __future__ import annotations

import atexit
import dataclasses
import datetime
import logging
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from v41.parallel import TensorParallel, set_tensor_parallel, tensor_parallel

log = logging.getLogger("v41")
TIMEOUT = datetime.timedelta(minutes=5)     # one step, one load: longer means a rank is gone


def rank_args(args, rank: int):
    """Rank `rank`'s EngineArgs: on CUDA its own device."""
    if torch.device(args.resolved_device()).type == "cuda":
        return dataclasses.replace(args, device=f"cuda:{rank}")
    return args


def join_group(rank: int, size: int, init: str, device: str) -> TensorParallel:
    backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(torch.device(device))
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=size, timeout=TIMEOUT)
    tp = TensorParallel(rank, size)
    set_tensor_parallel(tp)
    return tp


class Driver:
    """Rank 0's side: the workers, the commands since the last step, the broadcasts."""

    def __init__(self, args):
        size = args.tensor_parallel_size
        self._dir = tempfile.TemporaryDirectory(prefix="v41-tp-")
        init = f"file://{Path(self._dir.name) / 'rendezvous'}"
        ctx = mp.get_context("spawn")
        self.workers = [ctx.Process(target=worker_main, args=(rank_args(args, r), r, size, init),
                                    name=f"v41-tp-rank{r}", daemon=True) for r in range(1, size)]
        for p in self.workers:
            p.start()
        self.tp = join_group(0, size, init, rank_args(args, 0).resolved_device())
        self.pending: list[tuple] = []
        atexit.register(self.close)

    def send(self, *cmd) -> None:
        self.pending.append(cmd)

    def begin_step(self) -> None:
        """Ranks 1..N-1 apply the commands taken since the last step and run it with rank 0."""
        self.check_workers()
        cmds, self.pending = self.pending, []
        dist.broadcast_object_list([cmds], src=0)

    def check_workers(self) -> None:
        dead = [(p.name, p.exitcode) for p in self.workers if not p.is_alive()]
        if dead:
            raise RuntimeError(f"tensor-parallel worker {dead[0][0]} exited (code {dead[0][1]}); "
                               "the engine cannot step without it")

    def close(self) -> None:
        if not self.workers:
            return
        try:
            if all(p.is_alive() for p in self.workers):
                dist.broadcast_object_list([[("stop",)]], src=0)
            dist.destroy_process_group()
        finally:
            for p in self.workers:
                p.join(30)
                if p.is_alive():
                    p.kill()
            self.workers = []
            self._dir.cleanup()


def share_tokens(toks: list[int], errors: dict) -> tuple[list[int], dict]:
    """Rank 0's tokens and sampling errors on every rank (a no-op without tensor parallelism)."""
    if tensor_parallel().size == 1:
        return toks, errors
    box = [(toks, errors)]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def worker_main(args, rank: int, size: int, init: str) -> None:
    """Ranks 1..N-1: build the engine on this rank's shard, then step whenever the driver does."""
    from runtime.engine import LLMEngine
    logging.basicConfig(level=logging.WARNING)
    join_group(rank, size, init, args.resolved_device())
    eng = LLMEngine(args)
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0)
        for cmd in box[0]:
            if cmd[0] == "stop":
                dist.destroy_process_group()
                return
            if cmd[0] == "add":
                eng.add_request(*cmd[1:])
            elif cmd[0] == "abort":
                eng.abort(cmd[1])
            elif cmd[0] == "decoder_replay":
                eng.set_decoder_replay(cmd[1])
        eng.step()
