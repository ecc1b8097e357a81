"""The autotuner: per decode shape, the fastest *candidate* (a kernel and one of its launch configs) on this GPU,
timed the way production runs; what it finds goes to the tuned table ``kernel="auto"`` reads and to the tuning
cache (ops/tuned.py).

**Candidates.** The kernels of ``registry.candidate_kernels(cc)`` (the arch's ``AUTO_ORDER``, FlashInfer's
trtllm-gen on SM100 when its cubins are local, changed by ``CUTE_MLA_CANDIDATES``), each with every config its
manifest lists (``configs(args, cc)``, default first). A kernel that does not support the shape, or is unverified
on this arch and fails its first-use self-check, is refused with the reason; so is a config the workspace cannot
hold.

**Timing** (``tune_shape``): the package's one timing core (ops/timing.py) on inputs from
``inputs.make_decode_inputs``: every candidate captured in a CUDA graph of several calls cycling through KV
copies that add up to twice L2 (when memory is short, requests share physical pages of a smaller pool instead),
all graphs replayed interleaved, median per call, on each length profile (``LENGTH_PROFILES``). Before it is
timed, each candidate's output is compared with the static choice's (ops/tolerances.py). The choice is
``tuned.choose_minimax``'s.

**A deployment** (``Deployment``): the decode shapes one engine runs. ``python -m mla_backend_plugin.tune``
fills the cache ahead of time; a serving backend's warm-up hook (ops/serving.py ``DeploymentTuning``) calls
``prepare_deployment`` once, before CUDA-graph capture: it installs the cache's results for the engine's shapes
and, with ``CUTE_MLA_AUTOTUNE=1``, times what is missing within a budget. ``prebuild_deployment`` starts the
background builds of what the engine will launch.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import math
import time
from collections.abc import Callable, Iterable

import torch

from mla_backend_plugin.ops import registry, selfcheck, timing, tuned
from mla_backend_plugin.ops.api import expected_launch, mla_decode, prepare_args, select_kernel
from mla_backend_plugin.ops.arch import device_smem_per_block
from mla_backend_plugin.ops.constants import QK_HEAD_DIM
from mla_backend_plugin.ops.inputs import make_decode_inputs
from mla_backend_plugin.ops.manifest import LaunchConfig
from mla_backend_plugin.ops.plan import SPLIT_CAPACITY
from mla_backend_plugin.ops.tolerances import compare_decode
from mla_backend_plugin.ops.tuned import DTYPES, Candidate, ShapeKey, TuneCache, TuneResult
from mla_backend_plugin.ops.workspace import MLAWorkspace, StepPlans

logger = logging.getLogger("mla_backend_plugin")

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
# short ones wants more splits (H100, fp8 B=8 at 32k: the uniform choice 1.11x the best; docs/perf/tuner.md,
# 2026-11-24). The choice is the candidate whose worst ratio to a profile's best is lowest (``tuned.choose_minimax``).
LENGTH_PROFILES = ("uniform", "one-long")
ONE_LONG_SHORT = 1024  # the short requests of "one-long" (bench_decode.py --ragged one-long's default)


# --------------------------------------------------------------------------------------------------------
# Candidates and length profiles
# --------------------------------------------------------------------------------------------------------

def candidates_for(args, cc, workspace=None, kernels: Iterable[str] | None = None,
                   extra_configs: dict[str, list[LaunchConfig]] | None = None, check: bool = True
                   ) -> tuple[list[Candidate], dict[str, str]]:
    """Every candidate the tuner may time for ``args`` on ``cc`` (kernel order, each kernel's configs default
    first), and why the others may not (keyed by kernel name, or by candidate label for a single config).
    ``check=False`` skips the self-check of unverified kernels (a dry run without a GPU)."""
    device = args.q_nope.device
    kernels = registry.candidate_kernels(cc) if kernels is None else list(kernels)
    smem = device_smem_per_block(device)
    found: list[Candidate] = []
    refused: dict[str, str] = {}
    for name in kernels:
        spec = registry.KERNELS[name]
        reason = registry.unsupported_reason(spec, args, cc)  # the registry's checks (row_kv_lens) and the family's
        if reason is None and check:
            failure = selfcheck.self_check_failure(spec, device, cc)
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
    try:
        spec = select_kernel(args, "auto")
    except ValueError:
        return None
    return Candidate(spec.name, spec.default_config(args, registry.device_capability(args.q_nope.device)))


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
    bs = key.block_size
    seq = key.seq if max_blocks is None else max(1, min(key.seq, max_blocks * bs))
    pages = -(-seq // bs)
    width = max(max_blocks or 0, -(-pages // 16) * 16)
    kv_dtype = DTYPES[key.kv_dtype]
    page_bytes = bs * QK_HEAD_DIM * torch.finfo(kv_dtype).bits // 8
    total = key.batch * pages * page_bytes
    copies = timing.kv_copies_for(total, l2_bytes, L2_FACTOR) if l2_bytes else 1
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
    scales = inputs.scale_kwargs(as_tensor=key.scale_form == "tensor") if key.scale_form != "none" else {}
    out, lse = inputs.poisoned_outputs()
    calls = timing.calls_per_graph_for(copies, MIN_CALLS_PER_GRAPH)
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
                              kernel=cand.kernel, config=cand.config, step=step, return_lse=key.lse, **scales)
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
                check = compare_decode(out, lse if key.lse else None, *ref, DTYPES[key.kv_dtype])
                if not check.out_ok:
                    refused[cand.label] = f"differs from the static choice's output: {check.summary()}"
                    continue
            phase = "CUDA-graph capture"
            graphs[cand.cid] = (timing.capture_graph(launch, calls=calls, copies=copies), calls)
        except torch.OutOfMemoryError as e:
            refused[cand.label] = f"out of memory in {phase}: {_one_line(e)}"
        except Exception as e:  # noqa: BLE001 - a candidate that fails is a result, not the end of tuning
            if any(marker in str(e) for marker in _STICKY_CUDA_ERRORS):
                raise
            refused[cand.label] = f"{phase}: {_one_line(e)}"
    if not graphs:
        return {}, refused
    timings = timing.time_graphs(graphs, time_per_candidate, MIN_REPLAYS, MAX_REPLAYS, warmup=2)
    return {cid: t.median_us for cid, t in timings.items()}, refused


def tune_shape(key: ShapeKey, device, *, kernels: Iterable[str] | None = None, max_blocks: int | None = None,
               deadline: float | None = None, time_per_candidate: float = TIME_PER_CANDIDATE_S,
               max_input_bytes: int | None = None, extra_configs: dict[str, list[LaunchConfig]] | None = None,
               measure: Callable | None = None, workspace_factory: Callable | None = None) -> TuneResult:
    """Time every candidate of ``key`` on ``device`` on each of its length profiles (``profiles_for``) and pick
    the best worst case (``tuned.choose_minimax``). ``measure`` replaces ``measure_on_gpu`` (tests);
    ``workspace_factory(key, device)`` makes the workspace (default: one like the serving backends make, with room
    for every split cap)."""
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
                        softmax_scale=inputs.softmax_scale, out=out, lse=lse, need_lse=key.lse, **scales)
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
    winner = tuned.choose_minimax({"uniform": uniform, **timings_by_profile}, static_id)
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
    lse: bool = True  # the engine reads the LSE (vLLM: under DCP); False admits kernels that write none

    def keys(self, cc) -> list[ShapeKey]:
        batches = sorted({tuned.batch_bucket(b) for b in self.batches})
        seqs = sorted({tuned.seq_bucket(s) for s in self.seq_lens})
        return [ShapeKey(tuple(cc), self.kv_dtype, self.q_dtype, self.out_dtype, self.num_heads, self.q_len,
                         self.block_size, self.q_form, self.scale_form, b, s, self.lse)
                for b in batches for s in seqs]


def tune_keys(keys: list[ShapeKey], device, *, budget_s: float | None = None, cache: TuneCache | None = None,
              force: bool = False, progress: Callable | None = None, **tune_kwargs) -> dict:
    """Tune every key not in ``cache`` (all with ``force``) within ``budget_s`` seconds, saving after each;
    install everything (cached and new) into the live table. Returns counts and the results."""
    t0 = time.monotonic()
    deadline = None if budget_s is None else t0 + budget_s
    report = {"cached": 0, "tuned": 0, "not_reached": [], "results": [], "seconds": 0.0}
    todo = []
    for key in keys:
        hit = None if force else (tuned.installed_result(key) or (cache.get(key) if cache is not None else None))
        if hit is not None:
            tuned.install(hit)
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
        tuned.install(result)
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
    device = tuned.norm_device(device)
    if device.type != "cuda":
        return []
    cc = torch.cuda.get_device_capability(device)
    tuned.set_seq_profile(deployment.seq_lens)
    started = []
    seen = set()
    for key in deployment.keys(cc):
        inputs, _ = tuning_inputs(key, device, max_blocks=1)
        scales = inputs.scale_kwargs(as_tensor=key.scale_form == "tensor") if key.scale_form != "none" else {}
        args = prepare_args(inputs.q, inputs.kv_cache, inputs.block_table, inputs.seq_lens,
                            softmax_scale=inputs.softmax_scale, out_dtype=inputs.out_dtype,
                            need_lse=deployment.lse, **scales)
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
    device = tuned.norm_device(device)
    tuned.set_seq_profile(deployment.seq_lens)
    if device.type != "cuda":
        return {"cached": 0, "tuned": 0, "not_reached": [], "results": [], "seconds": 0.0}
    cc = torch.cuda.get_device_capability(device)
    tuned.load_cache(device)
    path = tuned.default_cache_path()
    cache = tuned.cache_for(device, path) if path is not None else TuneCache(None, tuned.context_for(device))
    keys = deployment.keys(cc)
    if tune:
        report = tune_keys(keys, device, budget_s=budget_s, cache=cache, max_blocks=deployment.max_blocks)
    else:
        report = tune_keys([k for k in keys if cache.get(k) is not None], device, cache=cache)
    logger.info("mla_decode: autotune: %d decode shapes (batches %s x context profile %s): %d from the cache, "
                "%d tuned in %.0f s, %d left to the static table%s", len(keys),
                sorted({k.batch for k in keys}), list(tuned.seq_profile()), report["cached"], report["tuned"],
                report["seconds"], len(keys) - report["cached"] - report["tuned"],
                "" if tune else " (CUTE_MLA_AUTOTUNE=1 tunes them during warm-up)")
    return report
