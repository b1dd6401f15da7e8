"""Train the `toy` preset on the CPU and export it as a native checkpoint (v41/assets/toy-trained).

    nice -n 10 .venv/bin/python tools/train_toy.py      # ~45 min on one shared CPU core

Corpus: the topic texts of CPython's documentation as the standard library ships them
(`pydoc_data.topics`, the text behind `help('if')` etc.), under the PSF License 2.0
(permissive). Not the project's own docs: the toy tokenizer was trained on those. The topics
are joined in key order and tokenized with the toy tokenizer; the last `--holdout` fraction of
the tokens is the held-out slice (`heldout_tokens` below; benchmarks/quality.py reads it).

Model: the reference oracle (tests/reference/oracle.py), a plain full-sequence forward of the
spec, made trainable (`TrainOracle`). Its weights are float32 master copies that every step
turns into the values the checkpoint stores (QAT as the model defines it, spec §2.5, §4): FP8
E4M3 per 32x32 block with E8M0 scales, FP4 E2M1 routed experts with E8M0 per 1x32, FP8 Engram
rows, BF16 and FP32 tensors rounded to their storage dtype; the export writes exactly these
values, so the checkpoint computes what was trained. Gradients pass straight through every
weight and activation quantizer (the oracle's FP8 act quant, FP8 window KV, FP4 index / main
rows). Activations are float32 (the oracle's dtype=float32 path).

Not trained (no gradient reaches them; they keep the preset's seed-0 random values): the
indexers (`indexer.*`: scores only pick rows), the router biases (`gate.bias`: selection only;
`gate.bias_vl`: image tokens), and the DSpark draft stages `mtp.*` (not in the LM loss).

Reproducible: seeded init (the preset's seed-0 checkpoint values), seeded batch order, one
thread. Writes the loss curve as JSON and PNG (benchmarks/results/train-toy.{json,png}).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import platform
import shutil
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.reference import oracle as O  # noqa: E402
from tests.reference import quant as RQ  # noqa: E402
from v41 import quant as VQ  # noqa: E402
from v41.config import TOY_TOKENIZER_DIR, preset  # noqa: E402
from v41.loader import INDEX_FILE, checkpoint_schema, dummy_weights, shard_plan  # noqa: E402
from v41.tokenizer import Tokenizer, load_tokenizer  # noqa: E402

CORPUS = "pydoc_data.topics (CPython documentation topics, PSF License 2.0)"


# ---- corpus -----------------------------------------------------------------------------------

def corpus_text() -> str:
    from pydoc_data.topics import topics
    return "\n\n".join(topics[k].strip() for k in sorted(topics))


def corpus_tokens() -> torch.Tensor:
    tok = Tokenizer(TOY_TOKENIZER_DIR)
    return torch.tensor(tok.encode(corpus_text()), dtype=torch.int64)


def split_tokens(ids: torch.Tensor, holdout: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, held-out): the held-out slice is the last `holdout` fraction of the tokens."""
    if not 0 < holdout < 1:
        raise ValueError(f"holdout: {holdout} must be in (0, 1)")
    cut = int(len(ids) * (1 - holdout))
    return ids[:cut], ids[cut:]


def heldout_tokens(holdout: float = 0.05) -> torch.Tensor:
    return split_tokens(corpus_tokens(), holdout)[1]


# ---- the stored formats, as values -----------------------------------------------------------

def storage_kind(name: str, spec) -> str:
    if spec.kind == "fp8":
        return "fp8_rows" if ".engram.embed." in name else "fp8_block"
    return spec.kind                                        # fp4 | bf16 | f32


def stored_values(kind: str, w: torch.Tensor) -> torch.Tensor:
    """What the checkpoint stores for master values w [..., n, k], dequantized to float32."""
    if kind == "fp8_block":
        return VQ.dequant_fp8_block(*VQ.quant_fp8_block(w), torch.float32)
    if kind == "fp4":
        return VQ.dequant_fp4_expert(*VQ.quant_fp4_expert(w), torch.float32)
    if kind == "fp8_rows":
        return VQ.fp8_qat(w, 32)
    if kind == "bf16":
        return w.to(torch.bfloat16).float()
    return w


def straight_through(w: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """q in the forward (exactly: w - w.detach() is 0), identity gradient to w."""
    return q.detach() + (w - w.detach())


@contextmanager
def straight_through_activations():
    """The oracle's activation quantizers (module functions of tests/reference/quant.py, which
    round with torch.round and so pass no gradient) with straight-through gradients."""
    names = ("fp8_qat", "fp4_qat_ue8m0", "fp4_qat_e4m3")
    saved = {n: getattr(RQ, n) for n in names}

    def wrap(fn):
        return lambda x, *a: straight_through(x, fn(x.detach(), *a))
    try:
        for n in names:
            setattr(RQ, n, wrap(saved[n]))
        yield
    finally:
        for n, fn in saved.items():
            setattr(RQ, n, fn)


# ---- trainable oracle -------------------------------------------------------------------------

FROZEN = (".indexer.", ".gate.bias", "mtp.")


class Masters:
    """Float32 master copies of the checkpoint tensors, stacked by (storage kind, shape) so one
    quantizer call per stack makes every step's stored values."""

    def __init__(self, cfg, raw):
        self.schema = checkpoint_schema(cfg)
        self.raw = raw
        deq = O.Oracle.W.__get__(_Dequant(cfg, raw))
        groups: dict[tuple, list[str]] = {}
        for name, spec in self.schema.items():
            if spec.kind == "e8m0" or name.startswith("mtp."):
                continue
            groups.setdefault((storage_kind(name, spec), spec.logical or spec.shape), []).append(name)
        self.groups = []                                    # (kind, names, parameter)
        for (kind, _), names in groups.items():
            vals = torch.stack([self._initial(deq, n) for n in names])
            p = torch.nn.Parameter(vals, requires_grad=not any(f in names[0] for f in FROZEN))
            self.groups.append((kind, names, p))

    def _initial(self, deq, name):
        if ".engram.embed." in name:
            return RQ.dequant_fp8_rows(self.raw[name], self.raw[name[:-7] + ".scale"], torch.float32)
        return deq(name).float()

    def parameters(self):
        return [p for _, names, p in self.groups if p.requires_grad]

    def values(self) -> dict[str, torch.Tensor]:
        """Every tensor's stored value (float32), differentiable to its master."""
        out = {}
        for kind, names, p in self.groups:
            q = straight_through(p, stored_values(kind, p.detach())) if p.requires_grad \
                else stored_values(kind, p.detach())
            out.update(zip(names, q.unbind(0)))
        return out

    def state_dict(self):
        return {"|".join(names): p.detach().clone() for _, names, p in self.groups}

    def load_state_dict(self, sd):
        for _, names, p in self.groups:
            p.data.copy_(sd["|".join(names)])


class _Dequant:
    """Just enough of an Oracle for Oracle.W to dequantize the initial checkpoint values."""

    def __init__(self, cfg, raw):
        self.raw, self.acc, self._w = raw, torch.float32, {}


class TrainOracle(O.Oracle):
    """The oracle reading its weights from `Masters.values()` (refreshed every step)."""

    def __init__(self, cfg, token_map):
        super().__init__(cfg, {}, dtype=torch.float32, index_plane="fp4", token_map=token_map)

    def set_values(self, values: dict):
        self._w = values

    def W(self, name):
        return self._w[name]

    def engram_rows(self, prefix, hids):
        return self._w[prefix + ".embed.weight"][hids]

    def index_select(self, *a, **k):
        # row selection is a sort: no gradient flows through it, and its in-place masking
        # would trip autograd's version checks
        with torch.no_grad():
            return super().index_select(*a, **k)


def lm_loss(model: TrainOracle, ids: torch.Tensor) -> torch.Tensor:
    logits = model.forward(ids[:-1])
    return F.cross_entropy(logits, ids[1:])


# ---- export -------------------------------------------------------------------------------------

def export(cfg, masters: Masters, out: Path) -> Path:
    """A native checkpoint directory: config.json, safetensors shards (as the random-weight
    writer lays them out), the index, the toy tokenizer files. Trained tensors are quantized
    from their masters with the quantizers the forward used; the rest are the preset's."""
    from safetensors.torch import save_file
    schema = masters.schema
    tensors = dict(masters.raw)
    for kind, names, p in masters.groups:
        for name, w in zip(names, p.detach().unbind(0)):
            base = name[: -len(".weight")]
            if kind == "fp8_block":
                tensors[name], tensors[base + ".scale"] = VQ.quant_fp8_block(w)
            elif kind == "fp4":
                tensors[name], tensors[base + ".scale"] = VQ.quant_fp4_expert(w)
            elif kind == "fp8_rows":
                q, s = VQ.fp8_act_quant(w, 32)
                tensors[name], tensors[base + ".scale"] = q.to(torch.float8_e4m3fn), VQ.e8m0_encode(s)
            else:
                tensors[name] = w.to(schema[name].dtype)
    out.mkdir(parents=True, exist_ok=True)
    plan = shard_plan(schema)
    files = [f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors" for i in range(len(plan))]
    weight_map = {}
    for fname, names in zip(files, plan):
        for n in names:
            spec = schema[n]
            t = tensors[n]
            if t.dtype != spec.dtype or tuple(t.shape) != spec.shape:
                raise RuntimeError(f"export {n}: {t.dtype} {list(t.shape)}, schema {spec.dtype} {list(spec.shape)}")
            weight_map[n] = fname
        save_file({n: tensors[n].contiguous() for n in names}, str(out / fname), metadata={"format": "pt"})
    total = sum(s.nbytes for s in schema.values())
    (out / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                             indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2) + "\n")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(TOY_TOKENIZER_DIR / f, out / f)
    return out


# ---- training loop ----------------------------------------------------------------------------

def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


@torch.no_grad()
def evaluate(model, masters, ids: torch.Tensor, seq: int) -> float:
    """Mean NLL (nats/token) over the held-out tokens in windows of `seq` + 1 tokens."""
    model.set_values(masters.values())
    tot, n = 0.0, 0
    for s in range(0, len(ids) - 1, seq):
        w = ids[s: s + seq + 1]
        if len(w) < 2:
            break
        tot += float(lm_loss(model, w)) * (len(w) - 1)
        n += len(w) - 1
    return tot / n


def plot(curve: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    tr = curve["train"]
    ax.plot([r["step"] for r in tr], [r["loss"] for r in tr], lw=0.8, alpha=0.6, label="train (per step)")
    ev = curve["eval"]
    ax.plot([r["step"] for r in ev], [r["nll"] for r in ev], "o-", label="held-out")
    ax.set_xlabel("step")
    ax.set_ylabel("NLL (nats/token)")
    ax.set_title(f"toy (40 layers, hidden 64), {curve['corpus']['name'].split(' (')[0]}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="tools/train_toy.py", description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=450)
    ap.add_argument("--seq", type=int, default=512, help="tokens per training sequence")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--holdout", type=float, default=0.05)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--eval-tokens", type=int, default=2048, help="held-out tokens per evaluation")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=ROOT / "v41" / "assets" / "toy-trained")
    ap.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results" / "train-toy")
    ap.add_argument("--state", type=Path, default=None, help="save masters here every eval (resume with it)")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--export-state", type=Path, default=None,
                    help="no training: export the masters saved in this --state file to --out")
    a = ap.parse_args(argv)
    for field in ("steps", "seq", "eval_every", "eval_tokens", "warmup"):
        if getattr(a, field) <= 0:
            ap.error(f"--{field.replace('_', '-')}: must be positive")
    if importlib.util.find_spec("matplotlib") is None:     # the loss plot: refuse now, not after the run
        ap.error("the loss plot needs matplotlib: pip install -e '.[train]'")
    torch.set_num_threads(1)
    torch.manual_seed(a.seed)

    cfg = preset("toy")
    _, token_map = load_tokenizer("toy", cfg)
    ids = corpus_tokens()
    train, held = split_tokens(ids, a.holdout)
    held_eval = held[: a.eval_tokens + 1]
    raw = dict(dummy_weights(cfg, seed=0, progress=False, process=False))
    masters = Masters(cfg, raw)
    model = TrainOracle(cfg, token_map)
    if a.export_state is not None:
        masters.load_state_dict(torch.load(a.export_state, weights_only=False)["masters"])
        print(f"wrote {export(cfg, masters, a.out)}")
        return 0
    params = masters.parameters()
    opt = torch.optim.AdamW(params, lr=a.lr, betas=(0.9, 0.95), weight_decay=0.0)
    curve = {"corpus": {"name": CORPUS, "python": platform.python_version(), "tokens": len(ids),
                        "train_tokens": len(train), "heldout_tokens": len(held), "holdout": a.holdout},
             "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
             "params_trained": sum(p.numel() for p in params), "train": [], "eval": []}
    start = 0
    if a.resume and a.state and a.state.exists():
        st = torch.load(a.state, weights_only=False)
        masters.load_state_dict(st["masters"]), opt.load_state_dict(st["opt"])
        curve, start = st["curve"], st["step"]
        torch.set_rng_state(st["rng"])
    gen = torch.Generator().manual_seed(a.seed)
    offsets = torch.randint(0, len(train) - a.seq - 1, (a.steps,), generator=gen)
    t0 = time.time()
    with straight_through_activations():
        for step in range(start, a.steps):
            if step % a.eval_every == 0:
                nll = evaluate(model, masters, held_eval, a.seq)
                curve["eval"].append({"step": step, "nll": nll})
                print(f"step {step} held-out nll {nll:.4f} ({time.time() - t0:.0f}s)", flush=True)
                if a.state:
                    torch.save({"masters": masters.state_dict(), "opt": opt.state_dict(), "curve": curve,
                                "step": step, "rng": torch.get_rng_state()}, a.state)
            for g in opt.param_groups:
                g["lr"] = lr_at(step, a.steps, a.lr, a.warmup)
            model.set_values(masters.values())
            w = train[offsets[step]: offsets[step] + a.seq + 1]
            loss = lm_loss(model, w)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gn = float(torch.nn.utils.clip_grad_norm_(params, 1.0))
            opt.step()
            curve["train"].append({"step": step, "loss": loss.item(), "grad_norm": gn})
            if step % 10 == 0:
                print(f"step {step} loss {loss.item():.4f} gn {gn:.2f} ({time.time() - t0:.0f}s)", flush=True)
        nll = evaluate(model, masters, held_eval, a.seq)
    curve["eval"].append({"step": a.steps, "nll": nll})
    curve["seconds"] = round(time.time() - t0, 1)
    print(f"final held-out nll {nll:.4f}", flush=True)
    export(cfg, masters, a.out)
    a.results.parent.mkdir(parents=True, exist_ok=True)
    a.results.with_suffix(".json").write_text(json.dumps(curve, indent=1) + "\n")
    plot(curve, a.results.with_suffix(".png"))
    print(f"wrote {a.out}, {a.results.with_suffix('.json')}, {a.results.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
