"""Engram. The host half (`tokens`, `hashing`) imports no Triton; the device half gathers rows
and applies the gate."""
