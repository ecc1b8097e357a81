"""The one plan/workspace object of the kernel API.

A ``MLAWorkspace`` is made once per (device, max batch, max q_len, heads, dtypes, block size) and owns every
device buffer a decode kernel needs (the split-KV partial outputs and their LSEs), sized for the worst case
it was made for. Nothing is allocated per call, so a CUDA graph captured once replays safely.

Split-KV planning is two-level so that it stays correct under graph replay:
* on the host, ``num_splits(batch, q_len)`` fixes the grid from the batch size alone (vLLM captures one graph
  per batch size, and the batch size is known at capture);
* on the device, each request takes ``min(num_splits, cdiv(seq_len, min_chunk))`` of those splits, so a
  short request does not pay for empty splits and a captured graph adapts when seq_lens change.
"""

from __future__ import annotations

import dataclasses

import torch

from mla_backend_plugin.ops.constants import (
    KV_LORA_RANK,
    MAX_Q_LEN,
    SUPPORTED_NUM_HEADS,
    SUPPORTED_Q_LENS,
)

# Split the KV sequence until the grid has this many CTAs per SM. The Triton tile (64 rows, 147 KB of shared
# memory) leaves room for one resident CTA per SM on Hopper, and 1 measured best: 12-18% faster than 2 at
# B=8..64 on an H100, 3% slower only at B=64 q_len 2 (benchmarks/NOTES.md).
TARGET_CTAS_PER_SM = 1
MAX_SPLITS = 32
# Smallest KV chunk (tokens) worth a split of its own: below it the combine and the prologue cost more
# than the parallelism gains.
MIN_CHUNK_TOKENS = 128


@dataclasses.dataclass(frozen=True)
class SplitPlan:
    rows_per_cta: int  # query rows (q_len * heads are folded into M) one CTA of the split kernel owns
    num_splits: int  # grid size along the KV sequence, fixed per batch size
    min_chunk: int  # tokens; the device-side split count per request is cdiv(seq_len, min_chunk), capped


def plan_splits(batch: int, q_len: int, num_heads: int, rows_per_cta: int, num_sms: int,
                max_splits: int = MAX_SPLITS, min_chunk: int = MIN_CHUNK_TOKENS) -> SplitPlan:
    """Host half of split planning: depends only on shapes known at graph-capture time."""
    m_blocks = -(-(q_len * num_heads) // rows_per_cta)
    ctas = batch * m_blocks
    want = TARGET_CTAS_PER_SM * num_sms
    splits = 1 if ctas >= want else min(max_splits, -(-want // ctas))
    return SplitPlan(rows_per_cta=rows_per_cta, num_splits=max(1, splits), min_chunk=min_chunk)


class MLAWorkspace:
    """Buffers and split plans for ``mla_decode`` on one device, allocated once.

    Args:
        device: the CUDA device the kernels run on.
        max_batch: the largest number of requests (decode batch) a call will pass.
        max_q_len: the largest q_len (1..4) a call will pass.
        num_heads: query heads per rank (16, 32, 64 or 128).
        num_sms: streaming multiprocessors to plan for; read from the device when None.
        max_splits: cap on split-KV partitions per request.
        out_dtype: when given, the workspace also owns output buffers ``[max_batch * max_q_len, heads, 512]``
            (that dtype) and ``[max_batch * max_q_len, heads]`` (float32 LSE), so a caller such as the vLLM
            impl can return views of them instead of allocating per call.
    """

    def __init__(self, device, max_batch: int, max_q_len: int = 1, num_heads: int = 128,
                 num_sms: int | None = None, max_splits: int = MAX_SPLITS,
                 min_chunk: int = MIN_CHUNK_TOKENS, rows_per_cta: int | None = None,
                 out_dtype: torch.dtype | None = None):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if max_q_len not in SUPPORTED_Q_LENS:
            raise ValueError(f"max_q_len must be one of {SUPPORTED_Q_LENS}, got {max_q_len}")
        if num_heads not in SUPPORTED_NUM_HEADS:
            raise ValueError(f"num_heads must be one of {SUPPORTED_NUM_HEADS}, got {num_heads}")
        if not 1 <= max_splits <= 64:
            raise ValueError(f"max_splits must be in 1..64, got {max_splits}")
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())  # where the buffers will land
        self.device = device
        self.max_batch = int(max_batch)
        self.max_q_len = int(max_q_len)
        self.num_heads = int(num_heads)
        self.max_splits = int(max_splits)
        self.min_chunk = int(min_chunk)
        if num_sms is None:
            num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        self.num_sms = int(num_sms)
        if rows_per_cta is None:
            from mla_backend_plugin.kernels.triton_decode.config import device_smem_per_block, rows_per_cta_for
            rows_per_cta = rows_per_cta_for(num_heads, device_smem_per_block(self.device))
        self.rows_per_cta = int(rows_per_cta)
        self._plans: dict[tuple[int, int], SplitPlan] = {}
        # Worst case over every batch size and q_len this workspace serves: the planner splits less as
        # the batch grows, so the product batch * splits peaks somewhere in the middle.
        worst_rows = 0
        for q_len in range(1, self.max_q_len + 1):
            for batch in range(1, self.max_batch + 1):
                plan = self.plan(batch, q_len)
                if plan.num_splits > 1:
                    worst_rows = max(worst_rows, batch * q_len * num_heads * plan.num_splits)
        self.partial_rows = worst_rows
        # fp32 partial outputs and log2-domain LSEs of every (request, row, split); empty when no batch
        # size this workspace serves ever splits.
        self.partial_out = torch.empty(max(worst_rows, 1), KV_LORA_RANK, dtype=torch.float32, device=self.device)
        self.partial_lse = torch.empty(max(worst_rows, 1), dtype=torch.float32, device=self.device)
        self.out_buffer = self.lse_buffer = None
        if out_dtype is not None:
            max_tokens = self.max_batch * self.max_q_len
            self.out_buffer = torch.empty(max_tokens, num_heads, KV_LORA_RANK, dtype=out_dtype, device=self.device)
            self.lse_buffer = torch.empty(max_tokens, num_heads, dtype=torch.float32, device=self.device)

    def output_views(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the owned output buffers for ``num_tokens`` query tokens (no allocation)."""
        if self.out_buffer is None:
            raise ValueError("this workspace was made without out_dtype, so it owns no output buffers")
        if num_tokens > self.out_buffer.shape[0]:
            raise ValueError(f"{num_tokens} query tokens exceed the workspace's max_batch * max_q_len = "
                             f"{self.out_buffer.shape[0]}")
        return self.out_buffer[:num_tokens], self.lse_buffer[:num_tokens]

    def plan(self, batch: int, q_len: int) -> SplitPlan:
        key = (batch, q_len)
        plan = self._plans.get(key)
        if plan is None:
            plan = plan_splits(batch, q_len, self.num_heads, self.rows_per_cta, self.num_sms,
                               self.max_splits, self.min_chunk)
            self._plans[key] = plan
        return plan

    def check_fits(self, batch: int, q_len: int, num_heads: int, device: torch.device) -> None:
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device != self.device:
            raise ValueError(f"workspace is on {self.device} but the inputs are on {device}")
        if num_heads != self.num_heads:
            raise ValueError(f"workspace was made for num_heads={self.num_heads}, inputs have {num_heads}")
        if batch > self.max_batch:
            raise ValueError(f"batch {batch} exceeds the workspace's max_batch={self.max_batch}")
        if q_len > self.max_q_len:
            raise ValueError(f"q_len {q_len} exceeds the workspace's max_q_len={self.max_q_len}")

    @property
    def nbytes(self) -> int:
        owned = [self.partial_out, self.partial_lse, self.out_buffer, self.lse_buffer]
        return sum(t.numel() * t.element_size() for t in owned if t is not None)

    def __repr__(self) -> str:
        return (f"MLAWorkspace(device={self.device}, max_batch={self.max_batch}, max_q_len={self.max_q_len}, "
                f"num_heads={self.num_heads}, num_sms={self.num_sms}, partial_rows={self.partial_rows}, "
                f"{self.nbytes / 2**20:.1f} MiB)")


_DEFAULT_WORKSPACES: dict[tuple, MLAWorkspace] = {}


def default_workspace(device: torch.device, batch: int, q_len: int, num_heads: int) -> MLAWorkspace:
    """A cached workspace for callers that pass none (eager use, tests, benchmarks).

    It grows by reallocation when a larger batch arrives, which a CUDA graph must not see: during capture
    a too-small cached workspace is an error that tells the caller to make one up front.
    """
    key = (device.type, device.index or 0, num_heads)
    ws = _DEFAULT_WORKSPACES.get(key)
    if ws is not None and batch <= ws.max_batch and q_len <= ws.max_q_len:
        return ws
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "mla_decode: no workspace large enough for this call was made before CUDA-graph capture; "
            "pass workspace=MLAWorkspace(device, max_batch, max_q_len, num_heads) made outside capture")
    max_batch = max(batch, ws.max_batch if ws else 0)
    ws = MLAWorkspace(device, max_batch=max_batch, max_q_len=MAX_Q_LEN, num_heads=num_heads)
    _DEFAULT_WORKSPACES[key] = ws
    return ws
