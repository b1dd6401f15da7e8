"""Native DeepSeek-V4.1 checkpoint: schema, parameter counts, a deterministic random-weight
writer, a header-first checker, the loader and the post-load processing (spec/model.md §5).

    python -m v41.loader write toy /tmp/v41-toy [--seed N]   # random weights of a preset
    python -m v41.loader check /tmp/v41-toy                   # header check only, prints a summary

Names carry no `model.` prefix: `embed.*`, `layers.L.*`, `mtp.M.*`, `norm.*`, `head.*`
(v41 has no vision tower, so no `vision.*` / `aligner.*` / `image_*`). Quantized linears are
`<name>.weight` + `<name>.scale`: FP8 E4M3 with an E8M0 scale per 32x32 block, or routed-expert
FP4 E2M1 packed two per byte (`I8` on disk) with an E8M0 scale per 1x32 group along the input.

Loading checks every shard header against the schema before any tensor data is read, then
reads, then runs the post-load processing exactly once (§5.4): `attn.wo_a` is dequantized to
BF16 (its scale dropped), `head` / `markov_head.head` / `confidence_head.proj` become FP32;
nothing else changes dtype. Engram tables (`*.engram.embed.*`) load on the host: mapped from
their shards (`engram_map`; `load_checkpoint(engram='auto'|'mapped'|'resident')`) or read; the
runner moves read (resident) ones to its device (`engram_tables`).

The package, by concern: `schema` (TensorSpec, checkpoint_schema, parameter counts and totals),
`synthetic` (the deterministic random values), `io` (the writer, shard plan, safetensors headers,
the index and the header check), `engram_map` (Engram tables mapped from disk, the host staging of
their rows), `load` (Weights and the post-load processing, load_checkpoint / load_weights, the
cache of preset checkpoints), `report` (the startup memory report) and `cli`. Import the names
from here.
"""
from __future__ import annotations

from v41.loader.cli import main
from v41.loader.engram_map import (ENGRAM_MAP_BYTES, EngramStager, MappedEngramTable, engram_stager,
                                   map_engram_table)
from v41.loader.io import (COMPLETE_MARKER, DEFAULT_SHARD_BYTES, INDEX_FILE, SINGLE_FILE, CheckReport,
                           check_checkpoint, read_safetensors_header, shard_plan, write_checkpoint)
from v41.loader.load import (Weights, checkpoint_key, dummy_weights,
                             ensure_preset_checkpoint, fp32_copy_names, load_checkpoint, load_weights,
                             postprocess, wo_a_names)
from v41.loader.report import format_memory_report, memory_report
from v41.loader.schema import (KINDS, PARTS, CheckpointError, TensorSpec, checkpoint_schema, count_params,
                               is_host_table, schema_totals)
from v41.loader.synthetic import dummy_tensors, iter_tensor_values, tensor_seed, tensor_values

__all__ = ["COMPLETE_MARKER", "DEFAULT_SHARD_BYTES", "ENGRAM_MAP_BYTES", "INDEX_FILE", "KINDS", "PARTS",
           "SINGLE_FILE", "CheckReport", "CheckpointError", "EngramStager", "MappedEngramTable", "TensorSpec",
           "Weights", "check_checkpoint", "checkpoint_key", "checkpoint_schema", "count_params",
           "dummy_tensors", "dummy_weights", "engram_stager", "ensure_preset_checkpoint",
           "format_memory_report", "fp32_copy_names", "is_host_table", "iter_tensor_values",
           "load_checkpoint", "load_weights", "main", "map_engram_table", "memory_report", "postprocess",
           "read_safetensors_header",
           "schema_totals", "shard_plan", "tensor_seed", "tensor_values", "wo_a_names", "write_checkpoint"]
