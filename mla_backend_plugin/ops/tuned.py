"""The tuned choices ``mla_decode(kernel="auto")`` reads: per decode shape, the candidate (a kernel and one of its
launch configs) the tuner found fastest on this GPU, in a graph-safe table filled from the tuning cache.

**Shape keys.** A choice is made per ``ShapeKey``: compute capability, KV / q / out dtypes, heads, q_len, block
size, the q form (one ``[T, H, 576]`` tensor or vLLM's ``(q_nope, q_pe)`` pair: FlashInfer must join a pair
first) and the scale form (none / host floats / device tensors: FlashInfer takes floats only, cute_sm90 compiles
a variant per form), plus two buckets: the batch rounded up to a power of two, and the KV length rounded up to a
power of two in [``MIN_SEQ_BUCKET``, ``MAX_SEQ_BUCKET``]. A bucket is tuned at its upper end.

**Results and choosing.** A ``TuneResult`` holds what timing one shape found (ops/autotune.py times it); the
static choice keeps the shape unless another candidate is at least ``MIN_GAIN`` faster (``choose``), over the
length profiles by the best worst case (``choose_minimax``), over several length buckets by the best geometric
mean (``choose_for_profile``).

**Graph-safe selection** (``lookup``, called by ``mla_decode(kernel="auto")``): a dict lookup on the call's
shape, no device work. Inside CUDA-graph capture the choice may depend on batch, q_len and dtypes but not on
this step's lengths (one graph serves every replay), so it uses the deployment's *context profile*
(``set_seq_profile``: the engine's max_model_len, or ``CUTE_MLA_TUNE_SEQ_LENS``): for a profile of several
lengths, the candidate whose times over the profile's buckets are best on geometric average against each
bucket's best. Outside capture a caller that knows the longest length on the host (``max_seq_len=``) gets that
bucket's winner. Shapes never tuned keep the static table (ops/registry.py ``AUTO_ORDER``). An unverified
kernel's choice passes its first-use self-check before it is used (ops/selfcheck.py).

**Cache** (``TuneCache``): one JSON file (``CUTE_MLA_TUNE_CACHE``), entries grouped by a context of GPU name,
compute capability, SM count, package version, a fingerprint of the kernel sources and the plan (ops/files.py)
and the toolchain versions; entries of another context are ignored with a log line; written atomically
(temporary file + rename, under a lock, merged with what other processes wrote). The first lookup on a device
installs the cache's results for it; the tuner (ops/autotune.py) installs and saves what it times.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import math
import os
import tempfile
import warnings
from collections.abc import Iterable

import torch

from mla_backend_plugin import envs
from mla_backend_plugin.ops import registry, selfcheck
from mla_backend_plugin.ops.constants import FP8_DTYPE, KV_LORA_RANK, QK_HEAD_DIM
from mla_backend_plugin.ops.files import fingerprint, locked
from mla_backend_plugin.ops.manifest import LaunchConfig
from mla_backend_plugin.ops.workspace import capturing as stream_capturing

logger = logging.getLogger("mla_backend_plugin")

MIN_SEQ_BUCKET = 512
MAX_SEQ_BUCKET = 1 << 17
# A candidate replaces the static choice only when it is at least this much faster (run-to-run spread of a
# median is ~1% in one process; docs/perf/method.md).
MIN_GAIN = 0.01
# 2: a choice is the best worst case over the length profiles (ops/autotune.py LENGTH_PROFILES); format-1
# entries were chosen on uniform lengths alone and are ignored
CACHE_FORMAT = 2
DEFAULT_CACHE_FILE = os.path.join("~", ".cache", "mla_backend_plugin", "autotune.json")

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
    # the calls read the LSE (mla_decode's return_lse); False: kernels that write none are candidates too
    lse: bool = True

    @classmethod
    def of(cls, args, cc, seq_len: int) -> ShapeKey:
        return cls(tuple(cc), DTYPE_NAMES[args.kv_dtype], DTYPE_NAMES[args.q_dtype], DTYPE_NAMES[args.out.dtype],
                   args.num_heads, args.q_len, args.block_size, q_form_of(args), scale_form_of(args),
                   batch_bucket(args.batch), seq_bucket(seq_len), args.need_lse)

    @property
    def shape(self) -> tuple:
        """The live table's shape part (everything but the two buckets), in the form ``_live_shape`` builds."""
        return (self.cc, DTYPES[self.kv_dtype], DTYPES[self.q_dtype], DTYPES[self.out_dtype], self.num_heads,
                self.q_len, self.block_size, self.q_form, self.scale_form, self.lse)

    def id(self) -> str:
        return (f"sm{self.cc[0]}{self.cc[1]} kv={self.kv_dtype} q={self.q_dtype} out={self.out_dtype} "
                f"h{self.num_heads} q_len={self.q_len} bs{self.block_size} {self.q_form} scales={self.scale_form} "
                f"B<={self.batch} S<={self.seq}" + ("" if self.lse else " no-lse"))

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["cc"] = list(self.cc)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> ShapeKey:
        return cls(**{**d, "cc": tuple(d["cc"])})


def _live_shape(args, cc) -> tuple:
    return (cc, args.kv_dtype, args.q_dtype, args.out.dtype, args.num_heads, args.q_len, args.block_size,
            q_form_of(args), scale_form_of(args), args.need_lse)


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
        spec = registry.KERNELS.get(self.kernel)
        return spec.label(self.config) if spec is not None else f"{self.kernel}:{self.config.label()}"


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
    if cid is None:
        return None
    cand = Candidate.from_cid(cid)
    spec = registry.KERNELS.get(cand.kernel)
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


def installed_result(key: ShapeKey) -> TuneResult | None:
    """The result installed in this process for ``key`` (tuned here or loaded), if any."""
    return _RESULTS.get((key.shape, key.batch), {}).get(key.seq)


def norm_device(device) -> torch.device:
    """``device`` as a torch device, a CUDA device with its index (the current device's when it has none)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def lookup(args, cc, max_seq_len: int | None = None, check: bool = True) -> Choice | None:
    """The tuned choice for this call, or None (then the static table decides). A dict lookup: no device work,
    no allocation. Under CUDA-graph capture (or without ``max_seq_len``) the context profile's choice.
    ``check=False``: not self-checked and not logged (a guess of what a later call will run, for prebuilding)."""
    if cc is None:
        return None
    device = args.q_nope.device
    load_cache(device)
    row = _TABLE.get((_live_shape(args, cc), batch_bucket(args.batch)))
    if not row:
        return None
    capturing = stream_capturing(device)
    choice = None
    if max_seq_len is not None and not capturing:
        choice = row.get(seq_bucket(max_seq_len))
    if choice is None:
        choice = row.get(PROFILE)
    if choice is None:
        return None
    if registry.unsupported_reason(choice.spec, args, cc) is not None:
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
    try:
        failure = selfcheck.self_check_failure(choice.spec, device, cc)
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
    """Fingerprint of every kernel source and of the plan and buffers they run on (what a tuned choice depends
    on)."""
    here = os.path.dirname(os.path.abspath(__file__))
    files = [os.path.join(os.path.dirname(here), "kernels")] + [os.path.join(here, name) for name in
                                                               ("plan.py", "workspace.py", "manifest.py")]
    return fingerprint(files, suffixes=(".py", ".cu", ".h", ".cuh"))[:16]


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
    device = norm_device(device)
    key = f"{path}|{device}"
    cache = _CACHES.get(key)
    if cache is None:
        cache = TuneCache(path, context_for(device))
        cache.load()
        _CACHES[key] = cache
    return cache


def load_cache(device) -> None:
    """Install the tuning cache's results for ``device`` into the live table, once per device (the first lookup
    on it does; a serving warm-up does before it tunes)."""
    if device not in _STATE["loaded"]:
        _load_cache_for(norm_device(device))
        _STATE["loaded"].add(device)


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
