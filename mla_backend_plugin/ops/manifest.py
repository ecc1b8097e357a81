"""What a kernel family declares about itself, and the launch knobs a tuner can turn.

Each folder under ``kernels/`` that holds a decode kernel exports ``MANIFEST: KernelManifest`` from its
``__init__.py``. ``ops/registry.py`` collects them (lazily, by walking ``kernels/``), ``compile.py`` builds
from them, and ``mla_decode`` launches through them. A manifest names its functions by module path
(``lazy``), so importing a family's ``__init__`` imports no GPU toolchain (Triton, CuTe-DSL, nvcc).

The kernel contract:

* ``unsupported_reason(args, cc) -> str | None``: None when the family can run this call on a device of
  compute capability ``cc`` (None for a CPU device), else why not, in words a user can act on;
* ``default_config(args, cc) -> LaunchConfig``: what ``mla_decode`` runs when nobody chose (the environment's
  defaults, see ``envs.py``); cheap, it runs on every call;
* ``configs(args, cc) -> list[LaunchConfig]``: every candidate a tuner may time for this call, default first;
* ``launch(args, workspace, config)``: run, writing ``args.out`` / ``args.lse``; no allocation, no host sync;
* ``plan_tile(num_heads, smem_per_block, config) -> PlanTile``: the query rows one CTA owns and the KV tile,
  which the workspace's split plan is computed with (so each family plans for its own grid);
* ``combine``: who merges split-KV partials: ``"shared"`` (kernels/combine, in the layout of the config's
  split plan), ``"own"`` (the family's own kernel) or ``"none"`` (never splits);
* ``compile_variants(arch, one_per_class=False) -> list[VariantResult]``: the ahead-of-time build of every
  variant for an arch, with the family's SASS checks (``python -m mla_backend_plugin.compile``); with
  ``one_per_class`` one variant of each kernel class (``first_of_each_class`` below; PDL on): a check that
  another toolchain version compiles every class, at a fraction of the cost;
* ``scratch(cc, max_batch, max_q_len, num_heads, num_sms) -> (key, bytes) | None``: a zero-initialised device
  buffer the family needs in every workspace made for a device where it may run (FlashInfer: its semaphores and
  split-KV scratch); families that name the same key share one buffer (the largest asked for);
* ``config_label(config) -> str``: how a tuner or benchmark names one of the family's configs (default
  ``LaunchConfig.label``).
* ``prebuild(args, config, cc) -> bool``: start building, in the background, what ``launch(args, ..., config)``
  will need (CuTe families: the variant, compiled in another process into the on-disk cache), so that an
  engine's start-up overlaps the compile with its own work; returns at once, True when a build is running.

A folder may declare several kernels (``MANIFESTS``, a tuple) when they share an adapter (kernels/flashinfer).
* ``supports_row_kv_lens``: the family honours ``args.row_kv_lens`` (per-row key counts, decode context
  parallelism); a family that does not declare it is refused such calls by the registry, never handed them.
* ``writes_lse`` (default True): the kernel writes ``args.lse``. A kernel that writes none (FlashInfer's SM120
  XQA MLA decode) sets it False: the registry refuses it every call whose caller needs the LSE
  (``args.need_lse``, ``mla_decode(return_lse=True)``, the default), so ``auto``, the tuned table and the tuner
  only run it where the caller passed ``return_lse=False``; its self-check compares ``out`` alone.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import Any

from mla_backend_plugin.ops.constants import MAX_SLACK

SPLIT_PLANS = ("balanced", "uniform", "shares", "auto")
FP8_DESIGNS = ("fp8mma", "dequant", "fp8seesaw")
MAX_L2_PREFETCH = 2  # LaunchConfig.l2_prefetch: tile pairs ahead
SCHEDULES = ("seesaw", "lockstep")  # cute_sm90's 16-bit-cache schedules (kernels/cute_sm90/config.py)
LAST_CTA_COMBINE = ("eager", "always", "never")  # cute_sm90: when a request's last CTA merges (LaunchConfig)
COMBINES = ("shared", "own", "none")


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """The knobs of one launch. A family reads the fields it has and ignores the rest; ``configs()`` lists
    only values the family supports. Hashable and JSON-friendly (``as_dict``), so a tuner can cache it."""

    # "balanced" | "uniform" | "shares" | "auto" (cute_sm90: the balanced plan's bounds with requests split at the
    # boundaries of equal shares of the step's tiles; auto: that when the balanced items leave a wave gap): how
    # split-KV work is spread (ops/plan.py)
    split_plan: str = "balanced"
    max_splits: int | None = None  # cap on splits per request; None = the workspace's
    # balanced plan: the cap for a request the max_splits cap would leave as the step's critical path (its items
    # over 1.5x the plan's tiles per item: ops/plan.py balanced_schedule); None = max_splits for all
    long_splits: int | None = None
    min_chunk: int | None = None  # tokens; the smallest chunk a request is split into; None = the workspace's
    enable_pdl: bool = True  # programmatic dependent launch (SM90+)
    fp8_design: str | None = None  # cute_sm90 with an fp8 cache: "fp8mma" | "dequant" | "fp8seesaw"
    tile: tuple[int, ...] | None = None  # a family's tile, e.g. Triton's (block_m, block_n, warps, stages)
    # cute_sm90 with a 16-bit cache: "seesaw" | "lockstep" (SCHEDULES); None = CUTE_MLA_SM90_SCHEDULE
    schedule: str | None = None
    # cute_sm90: merge the split partials inside the split kernel when its grid fits on the device at once (one
    # launch); False = always the combine kernel
    fused_combine: bool = True
    # cute_sm90, a larger split grid (with fused_combine): each request's last CTA merges its partials, in
    # "eager" calls (outside CUDA-graph capture), "always" or "never" (the combine kernel)
    last_cta_combine: str = "eager"
    # cute_sm90 with a 16-bit cache, seesaw schedule: the producer prefetches the KV of the tile pair this many
    # pairs ahead of its TMA loads into L2 (0 = off); None = the family's default
    l2_prefetch: int | None = None
    # cute_sm90 with a 16-bit cache, seesaw schedule, an even m-block count: the m-block CTAs of a work item share
    # each KV tile over a 2-CTA cluster by TMA multicast in split grids too large to run at once; None = the
    # family's default
    kv_multicast: bool | None = None
    # cute_sm90's seesaw schedules (16-bit seesaw, fp8 design C): a row's running max moves only when a tile's max
    # exceeds it by more than this (log2 units, 0..8), which skips most O rescales; None = the family's default
    max_slack: float | None = None

    def __post_init__(self):
        if self.split_plan not in SPLIT_PLANS:
            raise ValueError(f"LaunchConfig: split_plan {self.split_plan!r}; allowed: {', '.join(SPLIT_PLANS)}")
        if self.fp8_design is not None and self.fp8_design not in FP8_DESIGNS:
            raise ValueError(f"LaunchConfig: fp8_design {self.fp8_design!r}; allowed: {', '.join(FP8_DESIGNS)}")
        if self.schedule is not None and self.schedule not in SCHEDULES:
            raise ValueError(f"LaunchConfig: schedule {self.schedule!r}; allowed: {', '.join(SCHEDULES)}")
        if self.last_cta_combine not in LAST_CTA_COMBINE:
            raise ValueError(f"LaunchConfig: last_cta_combine {self.last_cta_combine!r}; allowed: "
                             f"{', '.join(LAST_CTA_COMBINE)}")
        if self.l2_prefetch is not None and not 0 <= self.l2_prefetch <= MAX_L2_PREFETCH:
            raise ValueError(f"LaunchConfig: l2_prefetch must be in 0..{MAX_L2_PREFETCH}, got {self.l2_prefetch}")
        if self.kv_multicast is not None and not isinstance(self.kv_multicast, bool):
            raise ValueError(f"LaunchConfig: kv_multicast must be True, False or None, got {self.kv_multicast!r}")
        if self.max_slack is not None and not (isinstance(self.max_slack, (int, float))
                                               and 0 <= self.max_slack <= MAX_SLACK):
            raise ValueError(f"LaunchConfig: max_slack must be a number in 0..{MAX_SLACK:g} or None, "
                             f"got {self.max_slack!r}")
        if self.max_splits is not None and not 1 <= self.max_splits <= 64:
            raise ValueError(f"LaunchConfig: max_splits must be in 1..64, got {self.max_splits}")
        if self.long_splits is not None and not 1 <= self.long_splits <= 64:
            raise ValueError(f"LaunchConfig: long_splits must be in 1..64, got {self.long_splits}")

    @property
    def balanced(self) -> bool:
        """A plan of work items and a split list (the balanced plan, or the share plan with its bounds); False
        for the uniform plan."""
        return self.split_plan != "uniform"

    @property
    def device_plan(self) -> str:
        """The balanced plans' SplitPlan.device_plan ("balanced" for the uniform plan, which has none)."""
        return "balanced" if self.split_plan == "uniform" else self.split_plan

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["tile"] = list(self.tile) if self.tile is not None else None
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LaunchConfig:
        d = dict(d)
        if d.get("tile") is not None:
            d["tile"] = tuple(d["tile"])
        return cls(**d)

    def label(self) -> str:
        parts = [self.split_plan]
        if self.max_splits is not None:
            parts.append(f"splits<={self.max_splits}")
        if self.long_splits is not None:
            parts.append(f"long<={self.long_splits}")
        if self.min_chunk is not None:
            parts.append(f"chunk>={self.min_chunk}")
        if self.fp8_design:
            parts.append(self.fp8_design)
        if self.schedule:
            parts.append(self.schedule)
        if self.l2_prefetch is not None:
            parts.append(f"l2-prefetch {self.l2_prefetch}")
        if self.kv_multicast is not None:
            parts.append("kv-multicast" if self.kv_multicast else "no-kv-multicast")
        if self.max_slack is not None:
            parts.append(f"slack {self.max_slack:g}")
        if not self.fused_combine:
            parts.append("no-fused-combine")
        elif self.last_cta_combine != "eager":
            parts.append(f"last-cta-combine {self.last_cta_combine}")
        if self.tile:
            parts.append("tile " + "x".join(map(str, self.tile)))
        parts.append("pdl" if self.enable_pdl else "no-pdl")
        return " ".join(parts)


@dataclasses.dataclass(frozen=True)
class PlanTile:
    rows_per_cta: int  # query rows (q_len x heads folded into M) one CTA of the split kernel owns
    block_n: int  # keys per KV tile: the unit split chunks are rounded to


@dataclasses.dataclass
class VariantResult:
    """One row of ``python -m mla_backend_plugin.compile``: a compiled variant and what its build reports."""

    name: str
    ok: bool
    registers: int | None = None
    shared_bytes: int | None = None
    spill_bytes: int | None = None
    seconds: float = 0.0
    error: str = ""


def first_of_each_class(variants, kernel_class: Callable) -> list:
    """The first of ``variants`` of each kernel class, in order. ``kernel_class(variant)`` names the kernel a
    variant instantiates and the specialisations that switch its code paths (dtypes, per-row key counts); what
    the others of a class vary are the sizes it is written over (head counts, q lengths, page sizes). CI compiles
    every variant under the toolchain it ships with and one of each class under the newer one."""
    first: dict = {}
    for v in variants:
        first.setdefault(kernel_class(v), v)
    return list(first.values())


def lazy(module: str, attr: str) -> Callable:
    """``module.attr``, imported on first call, so that a manifest imports nothing heavy. The module is kept, the
    attribute looked up on every call: a replaced ``module.attr`` (a test's monkeypatch) is what the next call
    reaches, never what the first call happened to see."""
    mod = None

    def call(*args, **kwargs):
        nonlocal mod
        if mod is None:
            mod = importlib.import_module(module)
        return getattr(mod, attr)(*args, **kwargs)

    call.__name__ = f"{module.rsplit('.', 1)[-1]}.{attr}"
    call.__qualname__ = call.__name__
    return call


@dataclasses.dataclass(frozen=True)
class KernelManifest:
    name: str  # what users pass as kernel= / CUTE_MLA_KERNEL
    description: str
    archs: tuple[str, ...]  # ahead-of-time build targets (ops/arch.py names); () = nothing to compile
    # compute capabilities where the GPU test suite passed on real hardware; None = everywhere (reference).
    # Anywhere else the first-use self-check (ops/selfcheck.py) must pass before the kernel runs.
    verified_archs: frozenset[tuple[int, int]] | None
    unsupported_reason: Callable[..., str | None]
    launch: Callable[..., None]
    default_config: Callable[..., LaunchConfig]
    configs: Callable[..., list[LaunchConfig]]
    plan_tile: Callable[..., PlanTile] | None  # None: the family needs no split plan
    combine: str
    compile_variants: Callable[..., list[VariantResult]] | None = None
    scratch: Callable[..., tuple[str, int] | None] | None = None
    config_label: Callable[[LaunchConfig], str] | None = None
    prebuild: Callable[..., bool] | None = None
    supports_row_kv_lens: bool = False
    writes_lse: bool = True

    def __post_init__(self):
        if self.combine not in COMBINES:
            raise ValueError(f"{self.name}: combine {self.combine!r}; allowed: {', '.join(COMBINES)}")

    @property
    def needs_workspace(self) -> bool:
        return self.plan_tile is not None or self.scratch is not None

    def label(self, config: LaunchConfig) -> str:
        """``kernel:config`` as tuners, caches and benchmarks print it."""
        return f"{self.name}:{(self.config_label or LaunchConfig.label)(config)}"
