"""The variant key every CuTe-DSL family compiles by (no cutlass import: registries and CPU tests read it).

A variant is everything that changes a compiled binary; it is the compile-cache key (aot.py hashes its fields, in
order) and what ``python -m mla_backend_plugin.compile`` prints. Each family subclasses ``Variant`` once: it sets
``FAMILY`` (the first word of the name) and adds the fields of its own kernel forms, with ``options`` naming them.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Variant:
    """The fields of every family's variant."""

    FAMILY = "cute"  # a class attribute, not a field: the family's subclass names itself

    kv_dtype: str  # "bf16" | "fp16" | "fp8"
    q_dtype: str  # "bf16" | "fp16" | "fp8"
    out_dtype: str  # "bf16" | "fp16"
    num_heads: int
    q_len: int
    block_size: int
    q_scale_is_ptr: bool  # the q scale is read from a device tensor (else a value argument)
    kv_scale_is_ptr: bool  # the same for the KV cache's scale

    @property
    def fp8(self) -> bool:
        """An fp8 (e4m3) KV cache."""
        return self.kv_dtype == "fp8"

    @property
    def rows(self) -> int:
        """Query rows of one request: q_len x heads folded into M."""
        return self.q_len * self.num_heads

    @property
    def options(self) -> str:
        """The family's own fields as the name shows them (each part with a leading space; empty by default)."""
        return ""

    @property
    def name(self) -> str:
        scales = f"{'qT' if self.q_scale_is_ptr else 'qF'}{'kT' if self.kv_scale_is_ptr else 'kF'}"
        return (f"{self.FAMILY} h{self.num_heads} q{self.q_len} bs{self.block_size} kv={self.kv_dtype} "
                f"q={self.q_dtype} out={self.out_dtype} {scales}{self.options}")
