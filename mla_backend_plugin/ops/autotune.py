"""The autotuner: per decode shape, the fastest *candidate* (a kernel and one of its launch configs) on this GPU,
timed the way production runs, and the graph-safe table ``kernel="auto"`` reads.

**Shape keys.** A choice is made per ``ShapeKey``: compute capability, KV / q / out dtypes, heads, q_len, block
size, the q form (one ``[T, H, 576]`` tensor or vLLM's ``(q_nope, q_pe)`` pair: FlashInfer must join a pair
first) and the scale form (none / host floats / device tensors: FlashInfer takes floats only, cute_sm90 compiles
a variant per form), plus two buckets: the batch rounded up to a power of two, and the KV length rounded up to a
power of two in [``MIN_SEQ_BUCKET``, ``MAX_SEQ_BUCKET``]. A bucket is tuned at its upper end.

**Candidates.** The kernels of ``candidate_kernels(cc)`` (the arch's ``AUTO_ORDER``, FlashInfer's trtllm-gen on
SM100 when its cubins are local, changed by ``CUTE_MLA_CANDIDATES``), each with every config its manifest lists
(``configs(args, cc)``, default first). A kernel that does not support the shape, or is unverified on this arch
and fails its first-use self-check, is refused with the reason; so is a config the workspace cannot hold.

**Timing** (``tune_shape``): the package's one timing core (ops/timing.py) on inputs from
``testing.make_decode_inputs``: every candidate captured in a CUDA graph of several calls cycling through KV
copies that add up to twice L2 (when memory is short, requests share physical pages of a smaller pool instead),
all graphs replayed interleaved, median per call. Before it is timed, each candidate's output is compared with
the static choice's (the testing tolerances). The static choice keeps the shape unless another is at least
``MIN_GAIN`` faster, so that noise does not swap kernels.

**Graph-safe selection** (``lookup``, called by ``mla_decode(kernel="auto")``): a dict lookup on the call's
shape, no device work. Inside CUDA-graph capture the choice may depend on batch, q_len and dtypes but not on
this step's lengths (one graph serves every replay), so it uses the deployment's *context profile*
(``set_seq_profile``: the engine's max_model_len, or ``CUTE_MLA_TUNE_SEQ_LENS``): for a profile of several
lengths, the candidate whose times over the profile's buckets are best on geometric average against each
bucket's best. Outside capture a caller that knows the longest length on the host (``max_seq_len=``) gets that
bucket's winner. Shapes never tuned keep the static table (ops/registry.py).

**Cache** (``TuneCache``): one JSON file (``CUTE_MLA_TUNE_CACHE``), entries grouped by a context of GPU name,
compute capability, SM count, package version, a hash of the kernel sources and the toolchain versions; entries
of another context are ignored with a log line; written atomically (temporary file + rename, under a lock, merged
with what other processes wrote). ``python -m mla_backend_plugin.tune`` fills it ahead of time; vLLM with
``CUTE_MLA_AUTOTUNE=1`` tunes what is missing during warm-up (``prepare_deployment``), within a budget.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import hashlib
import json
import logging
import math
import os
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable

import torch

from mla_backend_plugin import envs
from mla_backend_plugin.ops.constants import FP8_DTYPE, KV_LORA_RANK, QK_HEAD_DIM
from mla_backend_plugin.ops.files import locked
from mla_backend_plugin.ops.manifest import LaunchConfig

logger = logging.getLogger("mla_backend_plugin")

MIN_SEQ_BUCKET = 512
MAX_SEQ_BUCKET = 1 << 17
# A candidate replaces the static choice only when it is at least this much faster (run-to-run spread of a
# median is ~1% in one process; benchmarks/NOTES.md).
MIN_GAIN = 0.01
# 2: a choice is the best worst case over the length profiles (LENGTH_PROFILES); format-1 entries were chosen on
# uniform lengths alone and are ignored
CACHE_FORMAT = 2
DEFAULT_CACHE_FILE = os.path.join("~", ".cache", "mla_backend_plugin", "autotune.json")
# Timing of one candidate (ops/timing.py): seconds of replays, replay counts, calls per graph, KV copies.
TIME_PER_CANDIDATE_S = 0.03
MIN_REPLAYS, MAX_REPLAYS = 10, 200
MIN_CALLS_PER_GRAPH = 8
L2_FACTOR = 2.0
# Inputs may use this share of the free device memory (the rest: graphs, workspace, the compiler).
INPUT_MEMORY_SHARE = 0.4
_STICKY_CUDA_ERRORS = ("illegal memory access", "illegal instruction", "misaligned address",
                       "unspecified launch failure", "device-side assert")

# The length distributions a key is timed on. Under full CUDA graphs one choice serves every step of its (batch,
# longest length) bucket whatever the other lengths are, and uniform lengths alone miss that one long request among
# short ones wants more splits (H100, fp8 B=8 at 32k: the uniform choice 1.11x the best; benchmarks/NOTES.md,
# 2026-11-24). The choice is the candidate whose worst ratio to a profile's best is lowest (``choose_minimax``).
LENGTH_PROFILES = ("uniform", "one-long")
ONE_LONG_SHORT = 1024  # the short requests of "one-long" (bench_decode.py --ragged one-long's default)

DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", FP8_DTYPE: "fp8"}
DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}


# --------------------------------------------------------------------------------------------------------
# Shape keys
# --------------------------------------------------------------------------------------------------------

def _pow2_at_least(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def batch_bucket(batch: int) -> int:
    """The batch rounded up to a power of two (vLLM's graph sizes 24 and 32 share the bucket 32)."""
    return _pow2_at_least(max(1, batch))


def seq_bucket(seq_len: int) -> int:
    """The KV length rounded up to a power of two, within [MIN_SEQ_BUCKET, MAX_SEQ_BUCKET]."""
    return min(MAX_SEQ_BUCKET, max(MIN_SEQ_BUCKET, _pow2_at_least(max(1, seq_len))))


def q_form_of(args) -> str:
    """``"cat"`` when q_nope and q_pe are the two parts of one [T, H, 576] tensor, else ``"pair"``."""
    q_nope, q_pe = args.q_nope, args.q_pe
    joined = (q_pe.data_ptr() == q_nope.data_ptr() + KV_LORA_RANK * q_nope.element_size()
              and q_nope.stride() == q_pe.stride() and q_nope.stride(1) == QK_HEAD_DIM)
    return "cat" if joined else "pair"


def scale_form_of(args) -> str:
    scales = [s for s in (args.q_scale, args.kv_scale) if s is not None]
    if not scales:
        return "none"
    return "tensor" if any(isinstance(s, torch.Tensor) for s in scales) else "float"


@dataclasses.dataclass(frozen=True)
class ShapeKey:
    cc: tuple[int, int]
    kv_dtype: str  # "bf16" | "fp16" | "fp8"
    q_dtype: str
    out_dtype: str
    num_heads: int
    q_len: int
    block_size: int
    q_form: str  # "cat" | "pair"
    scale_form: str  # "none" | "float" | "tensor"
    batch: int  # bucket: calls with batch <= this (and > half of it)
    seq: int  # bucket: KV lengths <= this

    @classmethod
    def of(cls, args, cc, seq_len: int) -> ShapeKey:
        return cls(tuple(cc), DTYPE_NAMES[args.kv_dtype], DTYPE_NAMES[args.q_dtype], DTYPE_NAMES[args.out.dtype],
                   args.num_heads, args.q_len, args.block_size, q_form_of(args), scale_form_of(args),
                   batch_bucket(args.batch), seq_bucket(seq_len))

    @property
    def shape(self) -> tuple:
        """The live table's shape part (everything but the two buckets), in the form ``_live_shape`` builds."""
        return (self.cc, DTYPES[self.kv_dtype], DTYPES[self.q_dtype], DTYPES[self.out_dtype], self.num_heads,
                self.q_len, self.block_size, self.q_form, self.scale_form)

    def id(self) -> str:
        return (f"sm{self.cc[0]}{self.cc[1]} kv={self.kv_dtype} q={self.q_dtype} out={self.out_dtype} "
                f"h{self.num_heads} q_len={self.q_len} bs{self.block_size} {self.q_form} scales={self.scale_form} "
                f"B<={self.batch} S<={self.seq}")

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["cc"] = list(self.cc)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> ShapeKey:
        return cls(**{**d, "cc": tuple(d["cc"])})


def _live_shape(args, cc) -> tuple:
    return (cc, args.kv_dtype, args.q_dtype, args.out.dtype, args.num_heads, args.q_len, args.block_size,
            q_form_of(args), scale_form_of(args))


# --------------------------------------------------------------------------------------------------------
# Candidates
# --------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Candidate:
    kernel: str
    config: LaunchConfig

    @property
    def cid(self) -> str:
        """Stable id (the cache's key of a candidate)."""
        return f"{self.kernel}|{json.dumps(self.config.as_dict(), sort_keys=True)}"

    @classmethod
    def from_cid(cls, cid: str) -> Candidate:
        kernel, config = cid.split("|", 1)
        return cls(kernel, LaunchConfig.from_dict(json.loads(config)))

    @property
    def label(self) -> str:
        from mla_backend_plugin.ops.registry import KERNELS

        spec = KERNELS.get(self.kernel)
        return spec.label(self.config) if spec is not None else f"{self.kernel}:{self.config.label()}"


def candidate_kernels(cc, wanted: Iterable[str] | None = None) -> list[str]:
    """The kernels the tuner times on compute capability ``cc``: the arch's AUTO_ORDER, then FlashInfer's
    trtllm-gen on SM100/103; ``CUTE_MLA_CANDIDATES=a,b`` (or ``wanted``) replaces that list, ``+c`` entries add
    to it."""
    from mla_backend_plugin.ops.registry import AUTO_ORDER, KERNELS

    if cc is None:
        return []
    default = list(AUTO_ORDER.get(cc[0], ()))
    if cc[0] == 10:
        default.append("flashinfer_trtllm")
    wanted = tuple(envs.CUTE_MLA_CANDIDATES if wanted is None else wanted)
    replace = [n for n in wanted if not n.startswith("+")]
    names = (replace or default) + [n[1:] for n in wanted if n.startswith("+")]
    for name in names:
        if name not in KERNELS or name == "reference":
            allowed = ", ".join(k for k in KERNELS if k != "reference")
            raise ValueError(f"CUTE_MLA_CANDIDATES: unknown kernel {name!r}; allowed: {allowed}")
    return list(dict.fromkeys(names))


def candidates_for(args, cc, workspace=None, kernels: Iterable[str] | None = None,
                   extra_configs: dict[str, list[LaunchConfig]] | None = None, check: bool = True
                   ) -> tuple[list[Candidate], dict[str, str]]:
    """Every candidate the tuner may time for ``args`` on ``cc`` (kernel order, each kernel's configs default
    first), and why the others may not (keyed by kernel name, or by candidate label for a single config).
    ``check=False`` skips the self-check of unverified kernels (a dry run without a GPU)."""
    from mla_backend_plugin.ops.arch import device_smem_per_block
    from mla_backend_plugin.ops.registry import KERNELS, self_check_failure, unsupported_reason

    device = args.q_nope.device
    kernels = candidate_kernels(cc) if kernels is None else list(kernels)
    smem = device_smem_per_block(device)
    found: list[Candidate] = []
    refused: dict[str, str] = {}
    for name in kernels:
        spec = KERNELS[name]
        reason = unsupported_reason(spec, args, cc)  # the registry's checks (row_kv_lens) and the family's
        if reason is None and check:
            failure = self_check_failure(spec, device, cc)
            if failure is not None:
                reason = f"failed its self-check: {failure}"
        if reason is not None:
            refused[name] = reason
            continue
        configs = list(spec.configs(args, cc)) + list((extra_configs or {}).get(name, ()))
        for config in dict.fromkeys(configs):
            cand = Candidate(name, config)
            if workspace is not None and spec.plan_tile is not None:
                why = workspace.refusal(args.batch, args.q_len, spec.plan_tile(args.num_heads, smem, config), config)
                if why is not None:
                    refused[cand.label] = why
                    continue
            found.append(cand)
    return found, refused


def static_candidate(args) -> Candidate | None:
    """What ``kernel="auto"`` runs without the tuner (registry.AUTO_ORDER with the kernel's default config)."""
    from mla_backend_plugin.ops.registry import device_capability, select_kernel

    try:
        spec = select_kernel(args, "auto")
    except ValueError:
        return None
    return Candidate(spec.name, spec.default_config(args, device_capability(args.q_nope.device)))


# --------------------------------------------------------------------------------------------------------
# Results and choosing
# --------------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class TuneResult:
    """What timing one shape found: per-call median (us) of each timed candidate, why the others were not
    timed, the winner and the static choice (candidate ids), and what the tuning cost."""

    key: ShapeKey
    timings_us: dict[str, float]
    refused: dict[str, str]
    winner: str | None
    static: str | None
    labels: dict[str, str]
    seconds: float
    tuned_at: str = ""
    # the other length profiles' timings (``timings_us`` is the uniform profile's): profile -> cid -> us
    profile_timings_us: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)

    def as_entry(self) -> dict:
        return {"key": self.key.as_dict(), "timings_us": self.timings_us, "refused": self.refused,
                "winner": self.winner, "static": self.static, "labels": self.labels,
                "seconds": round(self.seconds, 3), "tuned_at": self.tuned_at,
                "profile_timings_us": self.profile_timings_us}

    @classmethod
    def from_entry(cls, entry: dict) -> TuneResult:
        return cls(key=ShapeKey.from_dict(entry["key"]), timings_us=dict(entry["timings_us"]),
                   refused=dict(entry.get("refused", {})), winner=entry.get("winner"), static=entry.get("static"),
                   labels=dict(entry.get("labels", {})), seconds=float(entry.get("seconds", 0.0)),
                   tuned_at=entry.get("tuned_at", ""),
                   profile_timings_us={p: dict(t) for p, t in entry.get("profile_timings_us", {}).items()})

    def ratios_to_best(self) -> dict[str, float]:
        """Per candidate, its worst ratio to the best time over this shape's length profiles (the uniform profile's
        alone where the profiles have no candidate in common)."""
        return (worst_ratios({"uniform": self.timings_us, **self.profile_timings_us})
                or worst_ratios({"uniform": self.timings_us}))

    def summary(self) -> str:
        if self.winner is None:
            return f"{self.key.id()}: nothing could be timed ({len(self.refused)} refused)"
        best = self.timings_us[self.winner]
        static = (f"; static {self.labels.get(self.static, self.static)} {self.timings_us[self.static]:.1f} us"
                  if self.static in self.timings_us and self.static != self.winner else "")
        return (f"{self.key.id()}: {self.labels.get(self.winner, self.winner)} {best:.1f} us{static} "
                f"({len(self.timings_us)} timed, {len(self.refused)} refused, {self.seconds:.1f} s)")


def choose(timings_us: dict[str, float], static: str | None, min_gain: float = MIN_GAIN) -> str | None:
    """The fastest candidate, unless the static choice is within ``min_gain`` of it."""
    if not timings_us:
        return None
    best = min(timings_us, key=timings_us.__getitem__)
    if static in timings_us and timings_us[static] * (1.0 - min_gain) <= timings_us[best]:
        return static
    return best


def profile_lengths(profile: str, batch: int, seq: int) -> list[int]:
    """The KV lengths of a length profile's ``batch`` requests whose longest is ``seq``."""
    if profile == "uniform":
        return [seq] * batch
    if profile == "one-long":
        return [seq] + [min(seq, ONE_LONG_SHORT)] * (batch - 1)
    raise ValueError(f"autotune: length profile {profile!r} is not one of {LENGTH_PROFILES}")


def profiles_for(key: ShapeKey) -> tuple[str, ...]:
    """The profiles worth timing for ``key``: with one request, or none longer than the short ones of
    "one-long", every profile is the uniform one."""
    return ("uniform",) if key.batch == 1 or key.seq <= ONE_LONG_SHORT else LENGTH_PROFILES


def worst_ratios(timings_by_profile: dict[str, dict[str, float]]) -> dict[str, float]:
    """Per candidate timed under every (non-empty) profile: its worst ratio to that profile's best time."""
    profiles = [t for t in timings_by_profile.values() if t]
    if not profiles:
        return {}
    common = set.intersection(*(set(t) for t in profiles))
    return {cid: max(t[cid] / min(t.values()) for t in profiles) for cid in common}


def choose_minimax(timings_by_profile: dict[str, dict[str, float]], static: str | None,
                   min_gain: float = MIN_GAIN) -> str | None:
    """One candidate for every length profile: among those timed in all of them, the lowest worst-case ratio to
    each profile's best (the static choice kept unless a candidate beats its worst case by ``min_gain``)."""
    profiles = [t for t in timings_by_profile.values() if t]
    worst = worst_ratios(timings_by_profile) if len(profiles) > 1 else {}
    if not worst:  # one profile, or no candidate timed in all: the first profile decides
        return choose(profiles[0] if profiles else {}, static, min_gain)
    return choose(worst, static, min_gain)


def choose_for_profile(results: list[TuneResult], min_gain: float = MIN_GAIN) -> str | None:
    """One candidate for several KV-length buckets (a CUDA graph serves all of them): among the candidates timed
    in every bucket, the one with the best geometric mean of its ratio to the bucket's best time (per bucket the
    worst ratio over the bucket's length profiles, ``TuneResult.ratios_to_best``)."""
    results = [r for r in results if r.timings_us]
    if not results:
        return None
    if len(results) == 1:
        return results[0].winner
    ratios = [r.ratios_to_best() for r in results]
    common = set.intersection(*(set(x) for x in ratios))
    if not common:
        return results[-1].winner
    score = {cid: sum(math.log(x[cid]) for x in ratios) / len(ratios) for cid in common}
    return choose({cid: math.exp(s) for cid, s in score.items()}, results[0].static, min_gain)


# --------------------------------------------------------------------------------------------------------
# The live table (what mla_decode reads) and the context profile
# --------------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Choice:
    spec: object  # KernelManifest
    config: LaunchConfig
    label: str
    time_us: float | None
    cid: str = ""
    checked: bool = False  # passed the self-check in this process (or is verified here)
    logged: bool = False


PROFILE = "profile"  # the per-seq key of the profile's choice
_RESULTS: dict[tuple, dict[int, TuneResult]] = {}  # (live shape, batch bucket) -> seq bucket -> result
_TABLE: dict[tuple, dict] = {}  # (live shape, batch bucket) -> {seq bucket | PROFILE: Choice}
# "version" counts changes of the live table and the profile: mla_decode's per-workspace decisions
# (MLAWorkspace.decisions) are keyed by it, so that a change reaches the next call
_STATE = {"profile": None, "loaded": set(), "version": 0}
_WARNED: set[str] = set()


def seq_profile() -> tuple[int, ...]:
    """The context profile's buckets: ``set_seq_profile``'s, else ``CUTE_MLA_TUNE_SEQ_LENS``'s, else ()."""
    if _STATE["profile"] is not None:
        return _STATE["profile"]
    return tuple(sorted({seq_bucket(n) for n in envs.CUTE_MLA_TUNE_SEQ_LENS}))


def set_seq_profile(lengths: Iterable[int] | None) -> tuple[int, ...]:
    """Set the deployment's context profile (KV lengths; None = back to ``CUTE_MLA_TUNE_SEQ_LENS``): what the
    choice under CUDA-graph capture is tuned for. Returns its buckets."""
    _STATE["profile"] = None if lengths is None else tuple(sorted({seq_bucket(n) for n in lengths}))
    _rebuild_profile_choices()
    return seq_profile()


def _choice_for(cid: str | None, result: TuneResult | None) -> Choice | None:
    from mla_backend_plugin.ops.registry import KERNELS

    if cid is None:
        return None
    cand = Candidate.from_cid(cid)
    spec = KERNELS.get(cand.kernel)
    if spec is None:
        return None
    time_us = result.timings_us.get(cid) if result is not None else None
    return Choice(spec, cand.config, cand.label, time_us, cid)


def table_version() -> int:
    """Changes whenever the live table or the context profile does (what ``lookup`` answers may change)."""
    return _STATE["version"]


def _rebuild_profile_choices() -> None:
    _STATE["version"] += 1
    profile = seq_profile()
    for table_key, per_seq in _RESULTS.items():
        row = _TABLE.setdefault(table_key, {})
        old = row.pop(PROFILE, None)
        picked = [per_seq[b] for b in profile if b in per_seq]
        if picked:
            cid = choose_for_profile(picked)
            if old is not None and old.cid == cid:
                row[PROFILE] = old  # unchanged: keep its self-check and log state
                continue
            choice = _choice_for(cid, picked[-1] if len(picked) == 1 else None)
            if choice is not None:
                row[PROFILE] = choice


def install(result: TuneResult) -> None:
    """Make a result part of the live table (its bucket's winner, and the profile's choice again)."""
    table_key = (result.key.shape, result.key.batch)
    _RESULTS.setdefault(table_key, {})[result.key.seq] = result
    choice = _choice_for(result.winner, result)
    row = _TABLE.setdefault(table_key, {})
    if choice is None:
        row.pop(result.key.seq, None)
    else:
        row[result.key.seq] = choice
    _rebuild_profile_choices()


def clear() -> None:
    """Forget every installed result and the profile (tests)."""
    _RESULTS.clear()
    _TABLE.clear()
    _STATE["profile"] = None
    _STATE["loaded"].clear()
    _STATE["version"] += 1
    _WARNED.clear()


def installed() -> dict[tuple, dict]:
    return _TABLE


def installed_result(key: ShapeKey) -> TuneResult | None:
    """The result installed in this process for ``key`` (tuned here or loaded), if any."""
    return _RESULTS.get((key.shape, key.batch), {}).get(key.seq)


def _norm(device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _capturing(device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def lookup(args, cc, max_seq_len: int | None = None, check: bool = True) -> Choice | None:
    """The tuned choice for this call, or None (then the static table decides). A dict lookup: no device work,
    no allocation. Under CUDA-graph capture (or without ``max_seq_len``) the context profile's choice.
    ``check=False``: not self-checked and not logged (a guess of what a later call will run, for prebuilding)."""
    if cc is None:
        return None
    device = args.q_nope.device
    if device not in _STATE["loaded"]:
        _load_cache_for(_norm(device))
        _STATE["loaded"].add(device)
    row = _TABLE.get((_live_shape(args, cc), batch_bucket(args.batch)))
    if not row:
        return None
    capturing = _capturing(device)
    choice = None
    if max_seq_len is not None and not capturing:
        choice = row.get(seq_bucket(max_seq_len))
    if choice is None:
        choice = row.get(PROFILE)
    if choice is None:
        return None
    from mla_backend_plugin.ops.registry import unsupported_reason  # registry imports this module's names lazily

    if unsupported_reason(choice.spec, args, cc) is not None:
        return None
    if not check:
        return choice
    if not choice.checked and not _check(choice, device, cc):
        return None
    if not choice.logged:
        choice.logged = True
        logger.info("mla_decode: autotune: B=%d q_len=%d %d heads %s KV %s -> %s%s", args.batch, args.q_len,
                    args.num_heads, DTYPE_NAMES[args.kv_dtype], "(profile)" if choice is row.get(PROFILE) else
                    f"S<={seq_bucket(max_seq_len or 0)}", choice.label,
                    f" ({choice.time_us:.1f} us when tuned)" if choice.time_us else "")
    return choice


def _check(choice: Choice, device, cc) -> bool:
    """The self-check of an unverified kernel, once (it runs kernels: not during capture)."""
    from mla_backend_plugin.ops.registry import self_check_failure

    try:
        failure = self_check_failure(choice.spec, device, cc)
    except RuntimeError:  # capturing and never checked: keep the static choice for this graph
        if choice.label not in _WARNED:
            _WARNED.add(choice.label)
            warnings.warn(f"mla_decode: autotune: {choice.label} is tuned for this shape but was not self-checked "
                          "before CUDA-graph capture; the static choice is captured instead",
                          RuntimeWarning, stacklevel=4)
        return False
    if failure is not None:
        if choice.label not in _WARNED:
            _WARNED.add(choice.label)
            warnings.warn(f"mla_decode: autotune: {choice.label} failed its self-check and is not used: {failure}",
                          RuntimeWarning, stacklevel=4)
        return False
    choice.checked = True
    return True


# --------------------------------------------------------------------------------------------------------
# The persistent cache
# --------------------------------------------------------------------------------------------------------

def default_cache_path() -> str | None:
    """``CUTE_MLA_TUNE_CACHE``: None when off, else the file."""
    value = envs.CUTE_MLA_TUNE_CACHE
    if value is None:
        return None
    return os.path.expanduser(value or DEFAULT_CACHE_FILE)


@functools.cache
def sources_hash() -> str:
    """Hash of every kernel source and of the plan they run on (what a tuned choice depends on)."""
    import mla_backend_plugin

    root = os.path.dirname(os.path.abspath(mla_backend_plugin.__file__))
    files = [os.path.join("ops", "workspace.py"), os.path.join("ops", "manifest.py")]
    for dirpath, _, names in os.walk(os.path.join(root, "kernels")):
        files += [os.path.relpath(os.path.join(dirpath, n), root) for n in names
                  if n.endswith((".py", ".cu", ".h", ".cuh"))]
    h = hashlib.sha256()
    for rel in sorted(files):
        h.update(rel.replace(os.sep, "/").encode())
        with open(os.path.join(root, rel), "rb") as f:
            h.update(hashlib.sha256(f.read()).digest())
    return h.hexdigest()[:16]


def _dist_version(name: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "-"


def context_for(device) -> dict:
    """What a cached timing is valid for: the GPU, the package and its kernel sources, the toolchains."""
    import mla_backend_plugin

    device = torch.device(device)
    props = torch.cuda.get_device_properties(device)
    return {"gpu": props.name, "cc": f"{props.major}.{props.minor}", "sms": props.multi_processor_count,
            "package": mla_backend_plugin.__version__, "sources": sources_hash(),
            "versions": {d: _dist_version(d) for d in ("torch", "triton", "nvidia-cutlass-dsl", "flashinfer-python")}}


def context_id(ctx: dict) -> str:
    return hashlib.sha256(json.dumps(ctx, sort_keys=True).encode()).hexdigest()[:16]


class TuneCache:
    """The tuning results of one context in a JSON file shared with other contexts (other GPUs, versions)."""

    def __init__(self, path: str | None, context: dict):
        self.path = path
        self.context = context
        self.cid = context_id(context)
        self.entries: dict[str, dict] = {}  # ShapeKey.id() -> TuneResult.as_entry()

    def _read(self) -> dict:
        if self.path is None or not os.path.exists(self.path):
            return {"format": CACHE_FORMAT, "contexts": {}, "entries": {}}
        try:
            with open(self.path) as f:
                data = json.load(f)
        except (OSError, ValueError) as e:
            logger.warning("mla_decode: autotune: the tuning cache %s cannot be read (%s); starting empty",
                           self.path, e)
            return {"format": CACHE_FORMAT, "contexts": {}, "entries": {}}
        if data.get("format") != CACHE_FORMAT:
            logger.info("mla_decode: autotune: %s has cache format %s, this package writes %s: ignored",
                        self.path, data.get("format"), CACHE_FORMAT)
            return {"format": CACHE_FORMAT, "contexts": {}, "entries": {}}
        return data

    def load(self) -> int:
        """Read this context's entries; entries of other contexts for this GPU are stale (logged, ignored)."""
        data = self._read()
        self.entries = dict(data["entries"].get(self.cid, {}))
        for cid, ctx in data["contexts"].items():
            if cid != self.cid and ctx.get("gpu") == self.context["gpu"] and data["entries"].get(cid):
                changed = [k for k in self.context if ctx.get(k) != self.context[k]]
                logger.info("mla_decode: autotune: %d cached results for %s in %s are stale (changed: %s) and "
                            "ignored", len(data["entries"][cid]), ctx.get("gpu"), self.path, ", ".join(changed))
        return len(self.entries)

    def get(self, key: ShapeKey) -> TuneResult | None:
        entry = self.entries.get(key.id())
        return TuneResult.from_entry(entry) if entry is not None else None

    def put(self, result: TuneResult) -> None:
        self.entries[result.key.id()] = result.as_entry()

    def save(self) -> None:
        """Merge this context's entries into the file (other contexts kept, stale ones of this GPU dropped),
        atomically: under a lock, a temporary file in the same directory renamed over the old one."""
        if self.path is None:
            return
        directory = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(directory, exist_ok=True)
        with locked(self.path + ".lock"):
            data = self._read()
            for cid in [c for c, ctx in data["contexts"].items()
                        if c != self.cid and ctx.get("gpu") == self.context["gpu"]]:
                data["contexts"].pop(cid, None)
                data["entries"].pop(cid, None)
            data["contexts"][self.cid] = self.context
            merged = dict(data["entries"].get(self.cid, {}))
            merged.update(self.entries)
            data["entries"][self.cid] = merged
            self.entries = merged
            fd, tmp = tempfile.mkstemp(prefix=".autotune-", suffix=".json", dir=directory)
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(data, f, indent=1, sort_keys=True)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self.path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise


_CACHES: dict[str, TuneCache] = {}


def cache_for(device, path: str | None = ...) -> TuneCache:
    """This process's cache object for ``device`` (loaded once), at ``path`` (default ``CUTE_MLA_TUNE_CACHE``)."""
    path = default_cache_path() if path is ... else path
    device = _norm(device)
    key = f"{path}|{device}"
    cache = _CACHES.get(key)
    if cache is None:
        cache = TuneCache(path, context_for(device))
        cache.load()
        _CACHES[key] = cache
    return cache


def _load_cache_for(device) -> None:
    """Install the cache's results for ``device`` into the live table (once per device)."""
    _STATE["loaded"].add(device)
    if device.type != "cuda" or default_cache_path() is None:
        return
    cache = cache_for(device)
    cc = torch.cuda.get_device_capability(device)
    n = 0
    for entry in cache.entries.values():
        result = TuneResult.from_entry(entry)
        if result.key.cc == tuple(cc):
            install(result)
            n += 1
    if n:
        logger.info("mla_decode: autotune: %d tuned shapes loaded from %s", n, cache.path)


# --------------------------------------------------------------------------------------------------------
# Timing one shape
# --------------------------------------------------------------------------------------------------------

class BudgetExceeded(Exception):
    """The tuning deadline passed before a shape was fully timed (nothing of that shape is kept)."""


def tuning_inputs(key: ShapeKey, device, *, max_blocks: int | None = None, max_input_bytes: int | None = None,
                  l2_bytes: int | None = None, seed: int = 0, profile: str = "uniform"):
    """(DecodeInputs, KV copies) for timing ``key``: ``key.batch`` requests of the length profile ``profile``
    whose longest has ``key.seq`` tokens (at most ``max_blocks`` pages: the engine's block-table width), KV copies
    adding up to L2_FACTOR x L2, within ``max_input_bytes`` (past it, fewer copies, then a pool of pages that
    requests share)."""
    from mla_backend_plugin.ops.timing import kv_copies_for
    from mla_backend_plugin.testing import make_decode_inputs

    bs = key.block_size
    seq = key.seq if max_blocks is None else max(1, min(key.seq, max_blocks * bs))
    pages = -(-seq // bs)
    width = max(max_blocks or 0, -(-pages // 16) * 16)
    kv_dtype = DTYPES[key.kv_dtype]
    page_bytes = bs * QK_HEAD_DIM * torch.finfo(kv_dtype).bits // 8
    total = key.batch * pages * page_bytes
    copies = kv_copies_for(total, l2_bytes, L2_FACTOR) if l2_bytes else 1
    pool = None
    if max_input_bytes is not None and total * copies > max_input_bytes:
        copies = max(1, max_input_bytes // total)
        if total > max_input_bytes:
            pool = max(2, max_input_bytes // page_bytes)
    q_form = "fp8" if key.q_dtype == "fp8" else key.q_form
    fp8_kv = key.kv_dtype == "fp8"
    inputs = make_decode_inputs(
        key.batch, profile_lengths(profile, key.batch, seq), key.q_len, key.num_heads, bs, kv_dtype, q_form,
        device, seed,
        q_dtype=None if q_form == "fp8" else DTYPES[key.q_dtype], out_dtype=DTYPES[key.out_dtype],
        q_scale=0.5 if q_form == "fp8" else None, kv_scale=0.5 if fp8_kv else None, max_blocks=width,
        num_blocks=pool, share_pages=pool is not None, poison=None, kv_copies=copies)
    return inputs, copies


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def measure_on_gpu(key: ShapeKey, candidates: list[Candidate], static: Candidate | None, inputs, copies: int,
                   workspace, deadline: float | None, time_per_candidate: float = TIME_PER_CANDIDATE_S
                   ) -> tuple[dict[str, float], dict[str, str]]:
    """Check every candidate against the static choice's output, capture it in a CUDA graph, replay all graphs
    interleaved (ops/timing.py); per-call medians (us) and why the others were not timed."""
    from mla_backend_plugin.ops.api import mla_decode
    from mla_backend_plugin.ops.timing import calls_per_graph_for, capture_graph, time_graphs
    from mla_backend_plugin.ops.workspace import StepPlans
    from mla_backend_plugin.testing import compare_decode

    scales = inputs.scale_kwargs(as_tensor=key.scale_form == "tensor") if key.scale_form != "none" else {}
    out, lse = inputs.poisoned_outputs()
    calls = calls_per_graph_for(copies, MIN_CALLS_PER_GRAPH)
    refused: dict[str, str] = {}
    graphs = {}
    ref = None

    def runner(cand: Candidate):
        # a graph's calls are the layers of one decode step, as in serving: one StepPlans per candidate, so a
        # kernel with a step-plan kernel plans once per replay (its config's plan; another candidate re-plans)
        step = StepPlans()

        def launch(i: int):
            return mla_decode(inputs.q, inputs.kv_caches[i], inputs.block_table, inputs.seq_lens,
                              softmax_scale=inputs.softmax_scale, out=out, lse=lse, workspace=workspace,
                              kernel=cand.kernel, config=cand.config, step=step, **scales)
        return launch

    ordered = sorted(candidates, key=lambda c: c != static)  # the static choice first: the others' reference
    for cand in ordered:
        if deadline is not None and time.monotonic() > deadline:
            raise BudgetExceeded(key.id())
        phase = "first call"
        try:
            launch = runner(cand)
            out.fill_(math.nan)  # what a candidate leaves unwritten must not pass for the previous one's output
            lse.fill_(math.nan)
            launch(0)
            torch.cuda.synchronize()
            if ref is None:
                ref = (out.float(), lse.clone())
            else:
                phase = "check"
                check = compare_decode(out, lse, *ref, DTYPES[key.kv_dtype])
                if not check.out_ok:
                    refused[cand.label] = f"differs from the static choice's output: {check.summary()}"
                    continue
            phase = "CUDA-graph capture"
            graphs[cand.cid] = (capture_graph(launch, calls=calls, copies=copies), calls)
        except torch.OutOfMemoryError as e:
            refused[cand.label] = f"out of memory in {phase}: {_one_line(e)}"
        except Exception as e:  # noqa: BLE001 - a candidate that fails is a result, not the end of tuning
            if any(marker in str(e) for marker in _STICKY_CUDA_ERRORS):
                raise
            refused[cand.label] = f"{phase}: {_one_line(e)}"
    if not graphs:
        return {}, refused
    timings = time_graphs(graphs, time_per_candidate, MIN_REPLAYS, MAX_REPLAYS, warmup=2)
    return {cid: t.median_us for cid, t in timings.items()}, refused


def tune_shape(key: ShapeKey, device, *, kernels: Iterable[str] | None = None, max_blocks: int | None = None,
               deadline: float | None = None, time_per_candidate: float = TIME_PER_CANDIDATE_S,
               max_input_bytes: int | None = None, extra_configs: dict[str, list[LaunchConfig]] | None = None,
               measure: Callable | None = None, workspace_factory: Callable | None = None) -> TuneResult:
    """Time every candidate of ``key`` on ``device`` on each of its length profiles (``profiles_for``) and pick
    the best worst case (``choose_minimax``). ``measure`` replaces ``measure_on_gpu`` (tests);
    ``workspace_factory(key, device)`` makes the workspace (default: one like the serving backends make, with room
    for every split cap)."""
    from mla_backend_plugin.ops.api import prepare_args
    from mla_backend_plugin.ops.workspace import SPLIT_CAPACITY, MLAWorkspace

    t0 = time.monotonic()
    device = torch.device(device)
    l2 = torch.cuda.get_device_properties(device).L2_cache_size if device.type == "cuda" else None
    if max_input_bytes is None and device.type == "cuda":
        max_input_bytes = int(INPUT_MEMORY_SHARE * torch.cuda.mem_get_info(device)[0])
    inputs, copies = tuning_inputs(key, device, max_blocks=max_blocks, max_input_bytes=max_input_bytes,
                                   l2_bytes=l2)
    scales = inputs.scale_kwargs(as_tensor=key.scale_form == "tensor") if key.scale_form != "none" else {}
    out, lse = inputs.poisoned_outputs()
    args = prepare_args(inputs.q, inputs.kv_cache, inputs.block_table, inputs.seq_lens,
                        softmax_scale=inputs.softmax_scale, out=out, lse=lse, **scales)
    if workspace_factory is not None:
        workspace = workspace_factory(key, device)
    else:
        workspace = MLAWorkspace(device, max_batch=key.batch, max_q_len=key.q_len, num_heads=key.num_heads,
                                 split_capacity=SPLIT_CAPACITY,
                                 num_sms=None if device.type == "cuda" else 132)
    candidates, refused = candidates_for(args, key.cc, workspace, kernels, extra_configs)
    static = static_candidate(args) if device.type == "cuda" else (candidates[0] if candidates else None)
    if static is not None and static not in candidates:
        static = None
    del args, out, lse  # views of the first profile's inputs: let the next profile reuse their memory
    measure = measure or measure_on_gpu
    labels = {c.cid: c.label for c in candidates}
    static_id = static.cid if static is not None else None
    timings_by_profile: dict[str, dict[str, float]] = {}
    for profile in profiles_for(key):
        if profile != "uniform":  # the next profile's inputs, in the memory of the last one's
            if not timings_by_profile["uniform"]:
                break  # nothing could be timed
            del inputs
            inputs, copies = tuning_inputs(key, device, max_blocks=max_blocks, max_input_bytes=max_input_bytes,
                                           l2_bytes=l2, profile=profile)
            # only what the first profile could time (a candidate that failed there is refused already)
            candidates = [c for c in candidates if c.cid in timings_by_profile["uniform"]]
            if static is not None and static not in candidates:
                static = None
        try:
            timings, more_refused = measure(key, candidates, static, inputs, copies, workspace, deadline,
                                            time_per_candidate)
        except BudgetExceeded:
            del inputs, workspace
            if device.type == "cuda":
                torch.cuda.empty_cache()
            raise
        timings_by_profile[profile] = timings
        refused.update({label: f"{profile} lengths: {why}" if profile != "uniform" else why
                        for label, why in more_refused.items()})
    uniform = timings_by_profile.pop("uniform")
    winner = choose_minimax({"uniform": uniform, **timings_by_profile}, static_id)
    result = TuneResult(key=key, timings_us=uniform, refused=refused, winner=winner, static=static_id,
                        labels=labels, seconds=time.monotonic() - t0,
                        tuned_at=datetime.datetime.now().isoformat(timespec="seconds"),
                        profile_timings_us=timings_by_profile)
    del inputs, workspace
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    return result


# --------------------------------------------------------------------------------------------------------
# A deployment: the shapes an engine will run, tuned ahead of time or during its warm-up
# --------------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Deployment:
    """The decode shapes one engine runs: its CUDA-graph batch sizes (requests) and context profile."""

    num_heads: int
    q_len: int
    kv_dtype: str  # "bf16" | "fp16" | "fp8"
    q_dtype: str
    out_dtype: str
    block_size: int
    batches: tuple[int, ...]
    seq_lens: tuple[int, ...]  # the context profile
    q_form: str = "pair"  # vLLM hands decode a (q_nope, q_pe) pair (one tensor when it quantises q to fp8)
    scale_form: str = "none"
    max_blocks: int | None = None  # the engine's block-table width (max_model_len / block size)

    def keys(self, cc) -> list[ShapeKey]:
        batches = sorted({batch_bucket(b) for b in self.batches})
        seqs = sorted({seq_bucket(s) for s in self.seq_lens})
        return [ShapeKey(tuple(cc), self.kv_dtype, self.q_dtype, self.out_dtype, self.num_heads, self.q_len,
                         self.block_size, self.q_form, self.scale_form, b, s) for b in batches for s in seqs]


def tune_keys(keys: list[ShapeKey], device, *, budget_s: float | None = None, cache: TuneCache | None = None,
              force: bool = False, progress: Callable | None = None, **tune_kwargs) -> dict:
    """Tune every key not in ``cache`` (all with ``force``) within ``budget_s`` seconds, saving after each;
    install everything (cached and new) into the live table. Returns counts and the results."""
    t0 = time.monotonic()
    deadline = None if budget_s is None else t0 + budget_s
    report = {"cached": 0, "tuned": 0, "not_reached": [], "results": [], "seconds": 0.0}
    todo = []
    for key in keys:
        hit = None if force else (installed_result(key) or (cache.get(key) if cache is not None else None))
        if hit is not None:
            install(hit)
            report["cached"] += 1
            report["results"].append(hit)
        else:
            todo.append(key)
    bar = progress(todo) if progress is not None else todo
    for key in bar:
        if deadline is not None and time.monotonic() > deadline:
            report["not_reached"].append(key)
            continue
        try:
            result = tune_shape(key, device, deadline=deadline, **tune_kwargs)
        except BudgetExceeded:
            report["not_reached"].append(key)
            continue
        install(result)
        logger.info("mla_decode: autotune: %s", result.summary())
        report["tuned"] += 1
        report["results"].append(result)
        if cache is not None:
            cache.put(result)
            cache.save()
    report["seconds"] = time.monotonic() - t0
    return report


def prebuild_deployment(deployment: Deployment, device, kernel: str = "auto") -> list[str]:
    """Start the background builds (``KernelManifest.prebuild``) of what the deployment's decode calls will launch:
    for each of its shapes, ``mla_decode``'s decision as far as it is known before the first call - the tuning
    cache's choice, else the arch table's kernel with its default config - on a tiny stand-in call of that shape.
    Self-checks are not run here (they launch kernels); a guess that a self-check later refuses only costs a
    background compile. Returns the labels of the builds started."""
    from mla_backend_plugin.ops.api import expected_launch, prepare_args

    device = _norm(device)
    if device.type != "cuda":
        return []
    cc = torch.cuda.get_device_capability(device)
    set_seq_profile(deployment.seq_lens)
    started = []
    seen = set()
    for key in deployment.keys(cc):
        inputs, _ = tuning_inputs(key, device, max_blocks=1)
        scales = inputs.scale_kwargs(as_tensor=key.scale_form == "tensor") if key.scale_form != "none" else {}
        args = prepare_args(inputs.q, inputs.kv_cache, inputs.block_table, inputs.seq_lens,
                            softmax_scale=inputs.softmax_scale, out_dtype=inputs.out_dtype, **scales)
        try:
            spec, config = expected_launch(args, kernel)
        except ValueError:  # no kernel supports the shape: its calls will say so
            continue
        label = spec.label(config)  # a variant depends on the deployment's dtypes and q_len and on the config
        if spec.prebuild is None or label in seen:
            continue
        seen.add(label)
        if spec.prebuild(args, config, cc):
            started.append(label)
    return started


def prepare_deployment(deployment: Deployment, device, *, tune: bool, budget_s: float | None) -> dict:
    """What a serving backend calls once, eagerly, before CUDA-graph capture: set the context profile, install
    the cache's results for the deployment's shapes, and with ``tune`` time the missing ones within
    ``budget_s``. Logs what was tuned, loaded and left to the static table."""
    device = _norm(device)
    set_seq_profile(deployment.seq_lens)
    if device.type != "cuda":
        return {"cached": 0, "tuned": 0, "not_reached": [], "results": [], "seconds": 0.0}
    cc = torch.cuda.get_device_capability(device)
    if device not in _STATE["loaded"]:
        _load_cache_for(device)
    path = default_cache_path()
    cache = cache_for(device, path) if path is not None else TuneCache(None, context_for(device))
    keys = deployment.keys(cc)
    if tune:
        report = tune_keys(keys, device, budget_s=budget_s, cache=cache, max_blocks=deployment.max_blocks)
    else:
        report = tune_keys([k for k in keys if cache.get(k) is not None], device, cache=cache)
    logger.info("mla_decode: autotune: %d decode shapes (batches %s x context profile %s): %d from the cache, "
                "%d tuned in %.0f s, %d left to the static table%s", len(keys),
                sorted({k.batch for k in keys}), list(seq_profile()), report["cached"], report["tuned"],
                report["seconds"], len(keys) - report["cached"] - report["tuned"],
                "" if tune else " (CUTE_MLA_AUTOTUNE=1 tunes them during warm-up)")
    return report
