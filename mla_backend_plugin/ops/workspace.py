"""The buffers of the kernel API, allocated once: ``MLAWorkspace`` and the per-step ``StepPlans``.

A ``MLAWorkspace`` is made once per (device, max batch, max q_len, heads, dtypes, block size) and owns every
device buffer a decode kernel needs (the split-KV partial outputs and their LSEs, the balanced plan's split list
and step table, the families' scratch), sized for the worst plan (ops/plan.py) of every kernel that may run on
its device. Nothing is allocated per call, so a CUDA graph captured once replays safely. ``StepPlans`` records
what one decode step has planned on the device, so that a step-plan kernel plans once per step, not per layer.
"""

from __future__ import annotations

import torch

from mla_backend_plugin.ops import registry
from mla_backend_plugin.ops.constants import (
    KV_LORA_RANK,
    MAX_Q_LEN,
    SUPPORTED_NUM_HEADS,
    SUPPORTED_Q_LENS,
    WORK_ITEM_INTS,
)
from mla_backend_plugin.ops.plan import MAX_SPLITS, MIN_CHUNK_TOKENS, SPLIT_CAPACITY, SplitPlan, plan_splits


class MLAWorkspace:
    """Buffers and split plans for ``mla_decode`` on one device, allocated once.

    Args:
        device: the CUDA device the kernels run on.
        max_batch: the largest number of requests (decode batch) a call will pass.
        max_q_len: the largest q_len (1..4) a call will pass.
        num_heads: query heads per rank (16, 32, 64 or 128).
        num_sms: streaming multiprocessors to plan for; read from the device when None.
        max_splits: default cap on split-KV partitions per request (what a config with ``max_splits=None`` gets).
        min_chunk: default smallest chunk (tokens) of a split.
        split_capacity: the largest ``max_splits`` a launch config may ask for (the buffers are sized for it);
            default ``max_splits``. The autotuner's candidates go up to 64 (``SPLIT_CAPACITY``).
        plan_rows: CTA row heights (``PlanTile.rows_per_cta``) of the kernels this workspace serves; the
            buffers hold the worst plan of any of them. Default: every kernel that may run on ``device``
            (``registry.plan_rows_for``).
        rows_per_cta: shorthand for ``plan_rows=(rows_per_cta,)``.
        out_dtype: when given, the workspace also owns output buffers ``[max_batch * max_q_len, heads, 512]``
            (that dtype) and ``[max_batch * max_q_len, heads]`` (float32 LSE), so a caller such as the vLLM
            impl can return views of them instead of allocating per call.

    It also owns, zeroed once here, the scratch buffer of every family that may run on ``device`` and declares
    one (``KernelManifest.scratch``, e.g. FlashInfer's semaphores): ``scratch_for(key)``.
    """

    def __init__(self, device, max_batch: int, max_q_len: int = 1, num_heads: int = 128,
                 num_sms: int | None = None, max_splits: int = MAX_SPLITS,
                 min_chunk: int = MIN_CHUNK_TOKENS, rows_per_cta: int | None = None,
                 out_dtype: torch.dtype | None = None, plan_rows: tuple[int, ...] | None = None,
                 split_capacity: int | None = None):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if max_q_len not in SUPPORTED_Q_LENS:
            raise ValueError(f"max_q_len must be one of {SUPPORTED_Q_LENS}, got {max_q_len}")
        if num_heads not in SUPPORTED_NUM_HEADS:
            raise ValueError(f"num_heads must be one of {SUPPORTED_NUM_HEADS}, got {num_heads}")
        if not 1 <= max_splits <= SPLIT_CAPACITY:
            raise ValueError(f"max_splits must be in 1..{SPLIT_CAPACITY}, got {max_splits}")
        split_capacity = max_splits if split_capacity is None else int(split_capacity)
        if not max_splits <= split_capacity <= SPLIT_CAPACITY:
            raise ValueError(f"split_capacity must be in max_splits..{SPLIT_CAPACITY}, got {split_capacity}")
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())  # where the buffers will land
        self.device = device
        self.max_batch = int(max_batch)
        self.max_q_len = int(max_q_len)
        self.num_heads = int(num_heads)
        self.max_splits = int(max_splits)
        self.split_capacity = split_capacity
        self.min_chunk = int(min_chunk)
        if num_sms is None:  # off CUDA only the reference kernel runs, which plans nothing: one SM's plans
            num_sms = (torch.cuda.get_device_properties(self.device).multi_processor_count
                       if self.device.type == "cuda" else 1)
        self.num_sms = int(num_sms)
        if rows_per_cta is not None:
            if plan_rows is not None:
                raise ValueError("pass rows_per_cta or plan_rows, not both")
            plan_rows = (rows_per_cta,)
        if plan_rows is None:
            plan_rows = registry.plan_rows_for(num_heads, self.device)
        self.plan_rows = tuple(sorted({int(r) for r in plan_rows}))
        self._plans: dict[tuple, SplitPlan] = {}
        # mla_decode's checked call forms and decisions (kernel spec, launch config, this workspace) per call
        # fingerprint (ops/api.py)
        self.decisions: dict[tuple, tuple] = {}
        # plan_for's plans per (batch, q_len, tile, config): what its check found once (the buffers never change)
        self._checked_plans: dict[tuple, SplitPlan] = {}
        # output_views' views per (token count, inference mode), made once: a tensor view costs an eager call
        # (once per layer) about a microsecond of host time, and views made in inference mode may not be
        # modified in place outside it
        self._output_views: dict[tuple[int, bool], tuple[torch.Tensor, torch.Tensor]] = {}
        # Worst case over every batch size, q_len, tile and both plans this workspace serves: the uniform plan
        # splits less as the batch grows, so batch * splits peaks somewhere in the middle; the balanced plan
        # needs at most max_slots (< 2 W) slots of q_len * H rows whatever the batch.
        worst_rows = worst_balanced = 0
        worst_index = 1
        worst_items = 1
        for rows_per in self.plan_rows:
            for q_len in range(1, self.max_q_len + 1):
                for batch in range(1, self.max_batch + 1):
                    # the plans grow with max_splits: sized for the largest a config may ask for
                    plan = self.plan(batch, q_len, rows_per_cta=rows_per, max_splits=split_capacity)
                    if plan.num_splits > 1:
                        worst_rows = max(worst_rows, batch * q_len * num_heads * plan.num_splits)
                    bal = self.plan(batch, q_len, balanced=True, rows_per_cta=rows_per, max_splits=split_capacity)
                    worst_balanced = max(worst_balanced, bal.max_slots * q_len * num_heads)
                    worst_index = max(worst_index, 1 + 3 * bal.max_split_requests)
                    worst_items = max(worst_items, bal.grid_items)
        self._plans.clear()  # the sizing visited every batch size; calls plan only the few they use
        # partial rows the uniform plan needs (xqa_sm120 checks it) and the balanced plan needs; the buffers hold
        # the larger (the two differ by a few slots at most).
        self.partial_rows = worst_rows
        self.partial_rows_balanced = worst_balanced
        worst_rows = max(worst_rows, worst_balanced)
        # The balanced plan's list of split requests, written by the split kernel for the combine:
        # [J, (b, S_b, n_b) * J] (balanced_schedule).
        self.split_index = torch.zeros(worst_index, dtype=torch.int32, device=self.device)
        # A step's work items of the balanced plan ([G, WORK_ITEM_INTS]), written by a family's step-plan kernel
        # and read by every layer's split kernel of that step (StepPlans); ``planned`` is the host's record of
        # which plan the stream leaves in it (set by ``StepPlans.needs_plan``).
        self.work_items = torch.zeros(worst_items * WORK_ITEM_INTS, dtype=torch.int32, device=self.device)
        self.planned = None
        # partial outputs (fp32 rows, or 16-bit ones in the same bytes: ``partials_as``) and log2-domain LSEs
        # of every (request, row, split); empty when no batch size this workspace serves ever splits.
        self.partial_out = torch.empty(max(worst_rows, 1), KV_LORA_RANK, dtype=torch.float32, device=self.device)
        self.partial_lse = torch.empty(max(worst_rows, 1), dtype=torch.float32, device=self.device)
        # ``partials_as``'s views, made once: every split launch asks for one (no tensor views per call)
        self._partial_views = {torch.float32: self.partial_out}
        self.scratch = {key: torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
                        for key, nbytes in registry.scratch_for(self.device, self.max_batch, self.max_q_len, num_heads,
                                                       self.num_sms).items()}
        self.out_buffer = self.lse_buffer = None
        if out_dtype is not None:
            max_tokens = self.max_batch * self.max_q_len
            self.out_buffer = torch.empty(max_tokens, num_heads, KV_LORA_RANK, dtype=out_dtype, device=self.device)
            self.lse_buffer = torch.empty(max_tokens, num_heads, dtype=torch.float32, device=self.device)

    @property
    def rows_per_cta(self) -> int:
        """The tile height of a single-tile workspace (``rows_per_cta=`` or one ``plan_rows`` entry)."""
        if len(self.plan_rows) != 1:
            raise ValueError(f"this workspace serves several tiles {self.plan_rows}: name rows_per_cta")
        return self.plan_rows[0]

    def output_views(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the owned output buffers for ``num_tokens`` query tokens (no allocation; the same view objects
        for every call of a token count)."""
        key = (num_tokens, torch.is_inference_mode_enabled())
        views = self._output_views.get(key)
        if views is not None:
            return views
        if self.out_buffer is None:
            raise ValueError("this workspace was made without out_dtype, so it owns no output buffers")
        if num_tokens > self.out_buffer.shape[0]:
            raise ValueError(f"{num_tokens} query tokens exceed the workspace's max_batch * max_q_len = "
                             f"{self.out_buffer.shape[0]}")
        views = self._output_views[key] = (self.out_buffer[:num_tokens], self.lse_buffer[:num_tokens])
        return views

    def plan(self, batch: int, q_len: int, balanced: bool = False, rows_per_cta: int | None = None,
             max_splits: int | None = None, min_chunk: int | None = None,
             device_plan: str = "balanced", long_splits: int | None = None) -> SplitPlan:
        """The split plan of a call (memoised): ``rows_per_cta`` is the launching kernel's tile (may be omitted
        for a single-tile workspace), ``max_splits`` / ``min_chunk`` default to the workspace's, ``long_splits``
        to none."""
        rows_per_cta = self.rows_per_cta if rows_per_cta is None else rows_per_cta
        max_splits = self.max_splits if max_splits is None else max_splits
        min_chunk = self.min_chunk if min_chunk is None else min_chunk
        long_splits = long_splits or 0
        key = (batch, q_len, balanced, rows_per_cta, max_splits, min_chunk, device_plan, long_splits)
        plan = self._plans.get(key)
        if plan is None:
            plan = plan_splits(batch, q_len, self.num_heads, rows_per_cta, self.num_sms, max_splits, min_chunk,
                               balanced=balanced, device_plan=device_plan, long_splits=long_splits)
            self._plans[key] = plan
        return plan

    def refusal(self, batch: int, q_len: int, tile, config) -> str | None:
        """None when a kernel with ``tile`` (PlanTile) can run ``batch`` x ``q_len`` under ``config``
        (LaunchConfig) in this workspace's buffers, else why not (no allocation, no device work)."""
        for name in ("max_splits", "long_splits"):
            cap = getattr(config, name)
            if cap is not None and cap > self.split_capacity:
                return f"config: {name}={cap} exceeds the workspace's split capacity {self.split_capacity}"
        if config.long_splits is not None and (not config.balanced
                                               or config.long_splits < (config.max_splits or self.max_splits)):
            return (f"config: long_splits={config.long_splits} needs a balanced split plan and long_splits >= "
                    f"max_splits ({config.max_splits or self.max_splits})")
        if config.split_plan in ("shares", "auto") and (config.max_splits or self.max_splits) < 2:
            return (f"config: split_plan={config.split_plan!r} needs max_splits >= 2 (it splits requests at share "
                    "boundaries)")
        plan = self.plan(batch, q_len, config.balanced, tile.rows_per_cta, config.max_splits, config.min_chunk,
                         config.device_plan, config.long_splits)
        rows = q_len * self.num_heads
        need = (plan.max_slots * rows if plan.balanced else
                (batch * rows * plan.num_splits if plan.num_splits > 1 else 0))
        if need > self.partial_out.shape[0] or (plan.balanced and (
                1 + 3 * plan.max_split_requests > self.split_index.numel()
                or plan.grid_items * WORK_ITEM_INTS > self.work_items.numel())):
            return (f"workspace: a {tile.rows_per_cta}-row tile needs {need} partial rows; this workspace holds "
                    f"{self.partial_out.shape[0]} (made for tiles {self.plan_rows}: pass plan_rows= including "
                    f"{tile.rows_per_cta})")
        return None

    def plan_for(self, args, tile, config) -> SplitPlan:
        """The plan a kernel with ``tile`` (PlanTile) runs ``args`` on under ``config`` (LaunchConfig), after
        checking the buffers hold it; a config asking for more than the workspace was made for is refused. Each
        (batch, q_len, tile, config) is checked once: the answer depends on nothing else."""
        key = (args.batch, args.q_len, tile, config)
        plan = self._checked_plans.get(key)
        if plan is not None:
            return plan
        why = self.refusal(args.batch, args.q_len, tile, config)
        if why is not None:
            raise ValueError(f"mla_decode: {why}")
        plan = self._checked_plans[key] = self.plan(args.batch, args.q_len, config.balanced, tile.rows_per_cta,
                                                    config.max_splits, config.min_chunk, config.device_plan,
                                                    config.long_splits)
        return plan

    def partials_as(self, dtype: torch.dtype) -> torch.Tensor:
        """The partial outputs as rows of ``dtype`` (float32, or a 16-bit output dtype: the same bytes hold
        twice the rows, of which a plan uses the first ``partial_out.shape[0]``). A split kernel and the combine
        that merges its partials must agree on it (kernels/combine ``launch_combine``'s ``partial_dtype``)."""
        view = self._partial_views.get(dtype)
        if view is None:
            if dtype not in (torch.bfloat16, torch.float16):
                raise ValueError(f"workspace: partial dtype {dtype}; allowed: float32, bfloat16, float16")
            view = self._partial_views[dtype] = self.partial_out.view(dtype).view(-1, KV_LORA_RANK)
        return view

    def scratch_for(self, key: str) -> torch.Tensor:
        """The zero-initialised scratch buffer (uint8) a family declared under ``key``."""
        buf = self.scratch.get(key)
        if buf is None:
            raise ValueError(f"mla_decode: workspace: no {key!r} scratch in this workspace (made for "
                             f"{self.device}; families declare it through KernelManifest.scratch)")
        return buf

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
        owned = [self.partial_out, self.partial_lse, self.split_index, self.work_items, self.out_buffer,
                 self.lse_buffer, *self.scratch.values()]
        return sum(t.numel() * t.element_size() for t in owned if t is not None)

    def __repr__(self) -> str:
        return (f"MLAWorkspace(device={self.device}, max_batch={self.max_batch}, max_q_len={self.max_q_len}, "
                f"num_heads={self.num_heads}, num_sms={self.num_sms}, plan_rows={self.plan_rows}, "
                f"partial_rows={self.partial_rows}, {self.nbytes / 2**20:.1f} MiB)")


def capturing(device: torch.device) -> bool:
    """Whether the current stream of ``device`` is capturing a CUDA graph (False for any other device)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _capture_id(device: torch.device):
    """None outside CUDA-graph capture, else the id of the capture in progress on the current stream."""
    if not capturing(device):
        return None
    try:
        from cuda.bindings import runtime

        err, _, capture_id = runtime.cudaStreamGetCaptureInfo(torch.cuda.current_stream(device).cuda_stream)[:3]
        if err == runtime.cudaError_t.cudaSuccess:
            return int(capture_id)
    except ImportError:
        pass
    return object()  # a capture we cannot tell apart from another: equal to nothing, so every launch plans


_NOT_PLANNED = object()  # no plan recorded (None means planned outside any capture)


class StepPlans:
    """What one decode step has planned on the device: a serving integration makes one per step (its metadata
    builder) and passes it to every layer's ``mla_decode(..., step=)``, so a family with a step-plan kernel
    (cute_sm90) plans the step's balanced schedule once and every layer's split kernel reads it from the
    workspace. Without one, every call plans for itself.

    A plan is reused only for the same seq_lens tensor and plan, while the workspace's table still holds it,
    and in the same CUDA-graph capture (or outside any) it was launched in: a graph then holds its own first
    layer's plan launch and replays it with the replayed lengths; an engine's eager warm-up run of the same
    metadata does not stand in for the capture that follows it."""

    def __init__(self):
        self._done: dict[tuple, object] = {}

    def needs_plan(self, workspace: MLAWorkspace, seq_lens: torch.Tensor, key: tuple) -> bool:
        """True when the caller must launch the step-plan kernel for ``key`` (what the plan's table depends on
        besides seq_lens) now; records that it will."""
        full = (seq_lens.data_ptr(), seq_lens.shape[0], key)
        where = _capture_id(workspace.device)
        if workspace.planned == full and self._done.get(full, _NOT_PLANNED) == where:
            return False
        self._done[full] = where
        workspace.planned = full
        return True


def step_needs_plan(step: StepPlans | None, workspace: MLAWorkspace, seq_lens: torch.Tensor, key: tuple) -> bool:
    """``step.needs_plan``, or True for a call outside a step (it plans for itself)."""
    if step is None:
        workspace.planned = None
        return True
    return step.needs_plan(workspace, seq_lens, key)


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
    # with room for every split cap a tuned config may ask for
    ws = MLAWorkspace(device, max_batch=max_batch, max_q_len=MAX_Q_LEN, num_heads=num_heads,
                      split_capacity=SPLIT_CAPACITY)
    _DEFAULT_WORKSPACES[key] = ws
    return ws
