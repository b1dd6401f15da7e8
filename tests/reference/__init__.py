"""The independent reference oracle (DESIGN.md §7): `oracle.Oracle` (full-sequence forward and
DSpark draft of spec/model.md §3), `quant` (its own exact quantizers), `generate` (greedy
generation on the toy: `python -m tests.reference.generate --prompt ... --max-tokens N`).
Imports configs and the loader from v41; never v41 model code (its Engram hashing is its own)."""
