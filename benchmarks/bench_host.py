"""Host time of one eager decode call: ours (through the serving path vLLM's forward_mqa takes, and through
``mla_decode`` per kernel) against the peers' calls as vLLM makes them.

Under full CUDA graphs a decode step replays a graph and this time does not exist; in the mixed steps of
chunked prefill (decode requests next to prefill chunks) vLLM runs attention eagerly, once per layer, and the
GPU waits for the host whenever the host is the slower side. ``benchmarks/bench_e2e.py`` measured ~0.4 ms of
host time per eager ``forward_mqa`` call there (issue 17); this script takes it apart on one GPU, without vLLM's
engine: per call, the GPU is drained first (so the call never waits for the device), then the call is timed
with ``time.perf_counter_ns``; our serving path is then profiled with cProfile in as many more calls (the listing
only: no time is taken with the profiler on), and ``--breakdown`` splits its time between the launches and our
Python.

    python benchmarks/bench_host.py                       # B 1/32/128 x S 1024/8192, bf16 + fp8
    python benchmarks/bench_host.py --batches 32 --kv-dtypes bf16 --profile-top 25
    python benchmarks/bench_host.py --breakdown --profile-top 0 # where the serving call's host time goes
    python benchmarks/bench_host.py --cpu-dry              # no GPU: the serving path's Python, launches stubbed

Writes ``host_results.md`` (and the cProfile listings) to ``--out-dir``.

``--cpu-dry`` runs on any machine: the serving path as vLLM's eager forward_mqa calls it (q as vLLM 0.26 builds
it, a StepPlans per step shared by ``--layers`` calls, ``max_seq_len`` given), on CPU tensors, with the device
queries answering for an H100 and what needs a GPU stubbed: the compiled CuTe function (and its TVM-FFI argument
conversion), the stream handle, Triton's compile and launcher (the combine's launch Python runs) and the capture
queries. What it times is our Python between ``forward_mqa`` and the launches, which those stubs leave out.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import itertools
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
from bench_decode import OurKernel  # sibling modules: benchmarks/ is the script directory
from peers import PEERS, Cell, PeerCall, cell_inputs

from mla_backend_plugin.ops import serving, tuned

SERVING = "serving:auto"  # DecodeRunner.decode, as CuteMLAImpl.forward_mqa calls it


class ServingPath:
    """Our decode as vLLM 0.26's eager forward_mqa reaches it: ``serving.DecodeRunner.decode`` into the engine's
    workspace, with the autotuner's warm-up hook (its static table here: no tuning), the (q_nope, q_pe) pair for a
    16-bit cache and the fp8 q for an fp8 cache (what vLLM hands CUTE_MLA on Hopper, ``serving.fp8_query``), the
    step's longest length and one ``StepPlans`` per ``layers`` calls (a step: its first call plans, the others
    reuse the plan)."""

    name = SERVING

    def __init__(self, layers: int = 16):
        self.layers = layers

    def unsupported_reason(self, cell, cc):
        return None

    def query_dtype(self, cell, cc):
        return "fp8" if cell.kv_dtype == "fp8" and serving.fp8_query("auto", cc) else "bf16"

    def prepare(self, cell: Cell, inputs) -> PeerCall:
        from mla_backend_plugin.ops.workspace import StepPlans

        q_dtype = self.query_dtype(cell, torch.cuda.get_device_capability(inputs.device))
        q, q_scale = inputs.query(q_dtype)
        if q_dtype != "fp8":
            q = (q[..., :512], q[..., 512:])  # vLLM 0.26 hands decode (q_nope, q_pe)
        kv_dtype = "fp8" if cell.kv_dtype == "fp8" else "auto"
        workspace = serving.make_workspace(inputs.device, max_num_seqs=cell.batch, num_speculative_tokens=0,
                                           num_heads=cell.num_heads, out_dtype=torch.bfloat16)
        deployment = serving.make_deployment(
            num_heads=cell.num_heads, max_num_seqs=cell.batch, num_speculative_tokens=cell.q_len - 1,
            model_dtype=torch.bfloat16, kv_cache_dtype=kv_dtype, block_size=cell.block_size,
            max_model_len=cell.seq_len, fp8_query=q_dtype == "fp8")
        serving.DeploymentTuning(deployment, tune=False, host_lengths=True).run_once(inputs.device)  # as a builder
        runner = serving.DecodeRunner(inputs.softmax_scale, kv_dtype)
        kv_scale = inputs.kv_scale_tensor()
        cache = inputs.kv_caches[0]
        if cell.kv_dtype == "fp8":
            cache = cache.view(torch.uint8)  # vLLM stores an fp8 cache as bytes
        calls = itertools.count()
        step = StepPlans()

        def launch(i):  # i: the KV copy (always 0 here)
            nonlocal step
            if next(calls) % self.layers == 0:  # a step's metadata: its first call plans the step
                step = StepPlans()
            return runner.decode(q, cache, inputs.block_table, inputs.seq_lens, workspace, q_scale=q_scale,
                                 kv_scale=kv_scale, max_seq_len=cell.seq_len, step=step)

        return PeerCall(launch, lambda raw: raw)


def host_times_us(call, iters: int, split: LaunchSplit | None = None, per_drain: int = 1,
                  walls: list[float] | None = None) -> list[float]:
    """Per group of ``per_drain`` calls (``call(i)``, i counting calls from 0): drain the GPU, then time the group's
    host side back to back (the launches return before the kernels end), as a mixed step runs its layers; us per call.
    With ``split``, also what the calls spent inside their launches (``split.per_call``); with ``walls``, also the
    group's time until the GPU finished it, per call (host and GPU overlapped: an eager step's attention share)."""
    for i in range(5):
        call(i)
    out = []
    for g in range(max(1, iters // per_drain)):
        torch.cuda.synchronize()
        if split is not None:
            split.start()
        t = time.perf_counter_ns()
        for i in range(per_drain):
            call(g * per_drain + i)
        dt = (time.perf_counter_ns() - t) / per_drain
        if split is not None:
            split.stop(dt, per_drain)
        if walls is not None:
            torch.cuda.synchronize()
            walls.append((time.perf_counter_ns() - t) / per_drain / 1e3)
        out.append(dt / 1e3)
    torch.cuda.synchronize()
    return out


def profiled(call, iters: int, profile: cProfile.Profile) -> None:
    """``iters`` more calls under cProfile, for its listing only: the profiler costs about a microsecond per
    Python call made, so no time above is taken with it on (the runs before 2026-11-28's fix timed the serving
    path with it on, and the peers without)."""
    for i in range(iters):
        torch.cuda.synchronize()
        profile.enable()
        call(i)
        profile.disable()
    torch.cuda.synchronize()


def time_launches(record) -> None:
    """Wrap cute_sm90's compiled functions (each call: TVM-FFI's argument conversion and the driver's launch) and the
    combine's launch (kernels/combine) so that every call reports ``record("cute" | "combine", ns)``. Process-wide
    and once per process, before any workspace keeps a decision (it keeps the functions it decided on)."""
    import functools

    from mla_backend_plugin.kernels.combine import kernel as combine
    from mla_backend_plugin.kernels.cute_sm90 import launch as sm90

    def timed(fn, piece: str):
        def call(*args, **kwargs):
            t = time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                record(piece, time.perf_counter_ns() - t)
        return call

    compiled = sm90._compiled
    sm90._compiled = functools.cache(lambda variant, use_pdl: timed(compiled(variant, use_pdl), "cute"))
    combine.launch_combine = timed(combine.launch_combine, "combine")


class LaunchSplit:
    """``--breakdown``: where a serving call's host time goes. Wraps the compiled CuTe functions (the split kernel
    and the step-plan kernel: their TVM-FFI call, the argument conversion and the driver's launch) and the combine's
    launch (kernels/combine: the Triton launcher, or the prepared launch) with timers; the rest of a call is our
    Python. Install once per process, before any workspace keeps a decision (it keeps the functions it decided on)."""

    PIECES = ("cute", "combine")

    def __init__(self) -> None:
        self.start()
        # per timed group, per call: (whole us, cute us, combine us, cute launches, combine launches)
        self.per_call: list[tuple[float, float, float, float, float]] = []

    def install(self) -> None:
        time_launches(self._record)

    def _record(self, piece: str, ns: int) -> None:
        self.ns[piece] += ns
        self.calls[piece] += 1

    def start(self) -> None:
        self.ns = dict.fromkeys(self.PIECES, 0)
        self.calls = dict.fromkeys(self.PIECES, 0)

    def stop(self, whole_ns: float, calls: int = 1) -> None:
        self.per_call.append((whole_ns / 1e3, self.ns["cute"] / 1e3 / calls, self.ns["combine"] / 1e3 / calls,
                              self.calls["cute"] / calls, self.calls["combine"] / calls))

    def row(self, label: str, launch_us: float) -> str:
        """One markdown row: medians of the whole call, of its pieces and of the rest, and the launches per call."""
        whole, cute, comb, n_cute, n_comb = (statistics.median(c) for c in zip(*self.per_call))
        rest = statistics.median(w - a - b for w, a, b, _, _ in self.per_call)
        return (f"| {label} | {whole:.1f} | {cute:.1f} ({n_cute:.2g}) | {comb:.1f} ({n_comb:.2g}) | {rest:.1f} | "
                f"{launch_us:.1f} |")


def torch_launch_us(device, iters: int, per_drain: int) -> float:
    """Median host us of one small elementwise kernel launched through torch (``zero_``), timed as the calls are:
    what one launch costs through a C++ dispatcher on this host, beside which the pieces above read."""
    buf = torch.empty(256, device=device)
    return summary(host_times_us(lambda i: buf.zero_(), iters, per_drain=per_drain))[0]


def stage_times(cell: Cell, inputs, iters: int) -> list[tuple[str, float]]:
    """Median host us of each stage of our serving call, one at a time (cute_sm90's launch; the GPU drained before
    stages that launch): what the decision memo skips, and what every call still pays."""
    from mla_backend_plugin import envs
    from mla_backend_plugin.kernels.combine.kernel import launch_combine
    from mla_backend_plugin.kernels.cute_sm90.config import BLOCK_M, BLOCK_N
    from mla_backend_plugin.ops.api import _decide
    from mla_backend_plugin.ops.args import bind, call_fingerprint, check_call
    from mla_backend_plugin.ops.manifest import PlanTile

    q, _ = inputs.query("bf16")
    q_pair = (q[..., :512], q[..., 512:])
    workspace = serving.make_workspace(inputs.device, max_num_seqs=cell.batch, num_speculative_tokens=0,
                                       num_heads=cell.num_heads, out_dtype=torch.bfloat16)
    out, lse = workspace.output_views(cell.tokens)
    kv_scale = inputs.kv_scale_tensor()
    cache = inputs.kv_caches[0]
    call = (q_pair, cache, inputs.block_table, inputs.seq_lens)

    def check():
        return check_call(*call, softmax_scale=inputs.softmax_scale, kv_scale=kv_scale, out=out, lse=lse)

    form = check()
    args = bind(form, *call, inputs.softmax_scale, None, kv_scale, out, lse, None, True, None)
    spec, config, _ = _decide(args, "cute_sm90", None, workspace, None, None, None)
    plan = workspace.plan_for(args, PlanTile(BLOCK_M, BLOCK_N), config)
    stages = [
        ("check_call (validation: a shape's first call)", check, False),
        ("call_fingerprint (every call)",
         lambda: call_fingerprint(*call, inputs.softmax_scale, None, None, kv_scale, out, lse, None, None, True, None),
         False),
        ("bind (every call)", lambda: bind(form, *call, inputs.softmax_scale, None, kv_scale, out, lse, None, True,
                                           None), False),
        ("envs.raw_values()", envs.raw_values, False),
        ("is_current_stream_capturing()", torch.cuda.is_current_stream_capturing, False),
        ("decision without memo (_decide)", lambda: _decide(args, "auto", None, workspace, None, None, None), False),
        ("cute_sm90 launch incl. combine", lambda: spec.launch(args, workspace, config), True),
        ("combine launch alone (Triton)", lambda: launch_combine(args, workspace, plan, BLOCK_N), True),
    ]
    rows = []
    for name, fn, launches in stages:
        rows.append((name, summary(host_times_us(lambda i, f=fn: f(), iters) if launches else _loop_us(fn, iters))[0]))
    return rows


def _loop_us(fn, iters: int) -> list[float]:
    out = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1e6)
    return out


def summary(times_us: list[float]) -> tuple[float, float, float]:
    """(median, 10th and 90th percentile) of the host times."""
    s = sorted(times_us)
    return statistics.median(s), s[len(s) // 10], s[(len(s) * 9) // 10]


def profile_text(profile: cProfile.Profile, top: int, calls: int) -> str:
    stream = io.StringIO()
    stats = pstats.Stats(profile, stream=stream)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return f"(cProfile over {calls} calls: divide the times by {calls} for one call)\n" + stream.getvalue()


class _DryTritonKernel:
    """--cpu-dry: a Triton kernel's stand-in with the real one's parameters, whose launches compile and run
    nothing: the combine's launch Python (kernels/combine ``launch_combine`` and ``prepared_launch``) runs as on a
    GPU, up to Triton's own launcher."""

    class Compiled:
        function, packed_metadata = "function", "metadata"

        @staticmethod
        def run(*args):
            return None

    def __init__(self, real):
        self.params, self.arg_names = real.params, real.arg_names

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.Compiled()


def install_cpu_stubs() -> None:
    """--cpu-dry: device queries answer for an H100 (sm_90, 132 SMs); compiled kernels, the stream handle and
    Triton's compile and launcher are no-ops (the combine's launch Python runs: ``_DryTritonKernel``). CPU tensors
    say they are CUDA ones. Process-global: only for a process that runs nothing else."""
    import functools

    from mla_backend_plugin.kernels.combine import kernel as combine
    from mla_backend_plugin.kernels.cute_sm90 import launch as sm90
    from mla_backend_plugin.ops import api, registry
    from mla_backend_plugin.ops import workspace as workspace_mod

    registry.device_capability = lambda device: (9, 0)
    registry.device_smem_per_block = api.device_smem_per_block = lambda device: 232_448
    serving.MLAWorkspace = functools.partial(workspace_mod.MLAWorkspace, num_sms=132)

    def kernel(*args):
        return None

    sm90._compiled = functools.cache(lambda variant, use_pdl: kernel)
    sm90.current_cu_stream = lambda device: None
    sm90._device_sms = lambda index: 132
    combine.combine_balanced_kernel = _DryTritonKernel(combine.combine_balanced_kernel)
    combine.combine_uniform_kernel = _DryTritonKernel(combine.combine_uniform_kernel)
    combine._stream_getter = lambda: (lambda device: 0)
    torch.Tensor.is_cuda = property(lambda t: True)  # the prepared launch is taken for device tensors only


def vllm_decode_inputs(batch: int, seq_len: int, kv_dtype: str, num_heads: int = 128, block_size: int = 64):
    """(q, cache, block_table, seq_lens, q_scale, kv_scale) on the CPU as vLLM 0.26's MLA layer hands forward_mqa
    them: a bf16 cache gets the pair (W_UK^T q_nope's transposed bmm output, q_pe a slice of the projected q); an
    fp8 cache the concatenated fp8 q (supports_quant_query_input) and 0-d scales, the cache as bytes. The cache
    holds a few pages: nothing reads it."""
    qkv = torch.zeros(batch, num_heads, 192, dtype=torch.bfloat16)
    blocks = -(-seq_len // block_size)
    block_table = torch.arange(batch * blocks, dtype=torch.int32).view(batch, blocks) % 8
    seq_lens = torch.full((batch,), seq_len, dtype=torch.int32)
    if kv_dtype == "fp8":
        q = torch.zeros(batch, num_heads, 576, dtype=torch.bfloat16).to(torch.float8_e4m3fn)
        cache = torch.zeros(8, block_size, 576, dtype=torch.uint8)
        return q, cache, block_table, seq_lens, torch.tensor(1.0), torch.tensor(1.0)
    ql_nope = torch.zeros(num_heads, batch, 512, dtype=torch.bfloat16).transpose(0, 1)
    cache = torch.zeros(8, block_size, 576, dtype=torch.bfloat16)
    return (ql_nope, qkv[..., 128:]), cache, block_table, seq_lens, torch.tensor(1.0), torch.tensor(1.0)


def mixed_q_step(batch: int, seq_len: int, kv: str, rng, num_heads: int = 128, block_size: int = 64):
    """--mixed-q: one eager step of n-gram 1 serving as vLLM 0.26's builder sees it: ``batch`` requests of q_len 1
    or 2 (with and without a draft, both present), the step's query tokens (q as ``vllm_decode_inputs`` makes it,
    one row per token), block table, seq_lens and query start offsets."""
    q_lens = [rng.choice((1, 2)) for _ in range(batch)]
    if batch > 1 and len(set(q_lens)) == 1:
        q_lens[0] = 3 - q_lens[0]
    tokens = sum(q_lens)
    q, cache, _, _, q_scale, kv_scale = vllm_decode_inputs(tokens, seq_len, kv, num_heads, block_size)
    blocks = -(-seq_len // block_size)
    block_table = torch.arange(batch * blocks, dtype=torch.int32).view(batch, blocks) % 8
    seq_lens = torch.full((batch,), seq_len, dtype=torch.int32)
    starts = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
    return q_lens, tokens, starts, q, cache, block_table, seq_lens, q_scale, kv_scale


DRY_WARMUP_STEPS = 5  # the first steps of a dry cell decide and plan: not timed


def timed_steps(one_step, iters: int, profile: cProfile.Profile | None) -> list[float]:
    """``one_step()`` (it returns its us per call) DRY_WARMUP_STEPS times untimed, then ``iters`` times timed;
    then, with ``profile``, ``iters`` more times under it."""
    for _ in range(DRY_WARMUP_STEPS):
        one_step()
    times = [one_step() for _ in range(iters)]
    for _ in range(iters if profile is not None else 0):
        profile.enable()
        one_step()
        profile.disable()
    return times


def dry_cell(batch: int, seq_len: int, kv: str, max_batch: int, iters: int, layers: int,
             profile: cProfile.Profile | None, new_batch_each_step: bool = False) -> list[float]:
    """--cpu-dry, one cell: us per call of each timed step (``layers`` calls sharing a new StepPlans); then, with
    ``profile``, ``iters`` more steps under it. ``new_batch_each_step``: each step decodes a batch size no earlier
    step had (batch, batch + 1, ...: as in the mixed steps of chunked prefill, where requests join the decode
    batch as their prefill ends), so each step's first call decides, checks and plans anew."""
    from mla_backend_plugin.ops.workspace import StepPlans

    tuned.set_seq_profile([seq_len])
    steps = iters * (2 if profile is not None else 1) + DRY_WARMUP_STEPS
    sizes = [batch + i for i in range(steps)] if new_batch_each_step else [batch]
    full = vllm_decode_inputs(max(sizes), seq_len, kv)  # each size a view of the first rows (as vLLM slices)
    inputs = {b: (tuple(t[:b] for t in full[0]) if isinstance(full[0], tuple) else full[0][:b], full[1],
                  full[2][:b], full[3][:b], *full[4:]) for b in sizes}
    workspace = serving.make_workspace("cpu", max_num_seqs=max(max_batch, *sizes), num_speculative_tokens=0,
                                       num_heads=128, out_dtype=torch.bfloat16)
    runner = serving.DecodeRunner(0.1, "fp8" if kv == "fp8" else "auto")
    count = iter(range(steps))

    def one_step() -> float:
        t = time.perf_counter()
        q, cache, block_table, seq_lens, q_scale, kv_scale = inputs[sizes[next(count) % len(sizes)]]
        step = StepPlans()  # a step's metadata: its first call plans, the other layers reuse the plan
        for _ in range(layers):
            runner.decode(q, cache, block_table, seq_lens, workspace, q_scale=q_scale, kv_scale=kv_scale,
                          max_seq_len=seq_len, step=step)
        return (time.perf_counter() - t) * 1e6 / layers

    return timed_steps(one_step, iters, profile)


def dry_mixed_q_cell(batch: int, seq_len: int, kv: str, iters: int, layers: int, profile: cProfile.Profile | None,
                     recast_us: list[float]) -> list[float]:
    """--cpu-dry --mixed-q, one cell: as ``dry_cell``, but each step a new batch of mixed q_lens (``mixed_q_step``),
    recast as token requests once per step as the builder does (its us appended to ``recast_us``) and decoded
    through them."""
    import random

    from mla_backend_plugin.ops.workspace import StepPlans

    tuned.set_seq_profile([seq_len])
    workspace = serving.make_workspace("cpu", max_num_seqs=batch, num_speculative_tokens=1, num_heads=128,
                                       out_dtype=torch.bfloat16, token_requests=True)
    runner = serving.DecodeRunner(0.1, "fp8" if kv == "fp8" else "auto")
    rng = random.Random(batch * 7919 + seq_len)
    per_token = serving.token_request_q_len(128)

    step_recast_us = []

    def one_step() -> float:
        q_lens, tokens, starts, q, cache, block_table, seq_lens, q_scale, kv_scale = mixed_q_step(batch, seq_len, kv,
                                                                                                   rng)
        t0 = time.perf_counter()
        recast = serving.token_requests(starts, q_lens, seq_lens, block_table, tokens, q_len=per_token,
                                        max_seq_len=seq_len, block_size=64)
        t1 = time.perf_counter()
        step = StepPlans()
        for _ in range(layers):
            runner.decode(q, cache, block_table, seq_lens, workspace, q_scale=q_scale, kv_scale=kv_scale,
                          max_seq_len=seq_len, token_requests=recast, step=step)
        step_recast_us.append((t1 - t0) * 1e6)
        return (time.perf_counter() - t1) * 1e6 / layers

    times = timed_steps(one_step, iters, profile)
    recast_us += step_recast_us[DRY_WARMUP_STEPS:DRY_WARMUP_STEPS + iters]  # the timed steps' own
    return times


def cpu_dry(args) -> int:
    """Per call us of the serving path (``--layers`` calls per step, one StepPlans each), cProfile of it."""
    install_cpu_stubs()
    lines = ["# Host time of the serving path, CPU dry run (us per call: median [p10, p90])", "",
             f"{args.iters} steps of {args.layers} calls each; compiled kernels, the stream handle and the combine "
             "launch stubbed (bench_host.py --cpu-dry"
             + (" --new-batch-each-step: every step a batch size no step had before, B = the column's and up"
                if args.new_batch_each_step else "")
             + (" --mixed-q: every step B requests of q_len 1 or 2 (n-gram 1 with and without drafts), recast as "
                "token requests once per step (`recast`, us per step) and decoded through them"
                if args.mixed_q else "") + ").", ""]
    profiles = []
    batches = list(map(int, args.batches.split(",")))
    for kv in args.kv_dtypes.split(","):
        for s in map(int, args.seq_lens.split(",")):
            lines += [f"## kv {kv}, S = {s}", "", "| runner | " + " | ".join(f"B={b}" for b in batches) + " |",
                      "|---|" + "---:|" * len(batches)]
            texts, recast_texts = [], []
            for b in batches:
                prof = cProfile.Profile() if args.profile_top else None
                recast: list[float] = []
                times = (dry_mixed_q_cell(b, s, kv, args.iters, args.layers, prof, recast) if args.mixed_q else
                         dry_cell(b, s, kv, max(batches), args.iters, args.layers, prof, args.new_batch_each_step))
                med, lo, hi = summary(times)
                texts.append(f"{med:.1f} [{lo:.1f}, {hi:.1f}]")
                if recast:
                    recast_texts.append("{:.1f} [{:.1f}, {:.1f}]".format(*summary(recast)))
                if prof is not None:
                    profiles.append((f"B={b} S={s} kv={kv}",
                                     profile_text(prof, args.profile_top, args.iters * args.layers)))
            lines += [f"| {SERVING} | " + " | ".join(texts) + " |"]
            if recast_texts:
                lines += ["| recast (us per step) | " + " | ".join(recast_texts) + " |"]
            lines += [""]
    write_results(Path(args.out_dir), lines, profiles)
    return 0


def write_results(out_dir: Path, lines: list[str], profiles: list[tuple[str, str]]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "host_results.md").write_text("\n".join(lines) + "\n")
    (out_dir / "host_profiles.txt").write_text("\n\n".join(f"===== {label}\n{text}" for label, text in profiles))
    print("\n".join(lines))
    if profiles:
        print(f"===== {profiles[0][0]}\n{profiles[0][1]}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,32,128")
    p.add_argument("--seq-lens", default="1024,8192")
    p.add_argument("--kv-dtypes", default="bf16,fp8")
    p.add_argument("--kernels", default="cute_sm90,triton", help="our kernels called through mla_decode")
    p.add_argument("--peers", default="flashmla,fa3_mla,triton_mla")
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--profile-top", type=int, default=18, help="cProfile rows of the serving path (0: none)")
    p.add_argument("--stages", action="store_true", help="also time the serving call's stages (first B and S)")
    p.add_argument("--breakdown", action="store_true",
                   help="split each serving call's host time: inside the CuTe launches, the combine's launch, the rest")
    p.add_argument("--out-dir", default="host_results")
    p.add_argument("--cpu-dry", action="store_true", help="no GPU: our serving path on CPU tensors, launches stubbed")
    p.add_argument("--layers", type=int, default=16,
                   help="calls per step, timed back to back after one drain of the GPU (one StepPlans each)")
    p.add_argument("--new-batch-each-step", action="store_true",
                   help="--cpu-dry: every step decodes a batch size no earlier step had (as mixed steps do)")
    p.add_argument("--mixed-q", action="store_true",
                   help="--cpu-dry: every step a batch of q_len 1 and 2 (n-gram 1's eager steps), as token requests")
    args = p.parse_args(argv)
    if (args.mixed_q or args.new_batch_each_step) and not args.cpu_dry:
        p.error("--mixed-q and --new-batch-each-step are --cpu-dry options")
    if args.mixed_q and args.new_batch_each_step:
        p.error("--mixed-q draws a new batch every step already: drop --new-batch-each-step")
    if args.cpu_dry:
        return cpu_dry(args)
    out_dir = Path(args.out_dir)
    device = torch.device("cuda")
    cc = torch.cuda.get_device_capability(device)
    runners = [ServingPath(args.layers)] + [OurKernel(k, "bf16", False) for k in args.kernels.split(",") if k]
    for name in (n for n in args.peers.split(",") if n):
        ok, why = PEERS[name].available()
        if ok:
            runners.append(PEERS[name])
        else:
            print(f"{name}: not available: {why}", file=sys.stderr)
    lines = ["# Host time of one eager decode call (us: median [p10, p90])", "",
             f"{torch.cuda.get_device_name(device)}; {args.iters} calls per cell in steps of {args.layers} (the GPU "
             f"drained before each step, its calls back to back: us per call); `{SERVING}` is the path vLLM's "
             "forward_mqa takes.", ""]
    profiles, splits = [], []
    launch_split = LaunchSplit() if args.breakdown else None
    if launch_split is not None:
        launch_split.install()  # once per process: before any workspace keeps a decision
    for kv in args.kv_dtypes.split(","):
        for s in map(int, args.seq_lens.split(",")):
            cells = [Cell(batch=b, seq_len=s, q_len=1, kv_dtype=kv) for b in map(int, args.batches.split(","))]
            lines += [f"## kv {kv}, S = {s}", "", "| runner | " + " | ".join(f"B={c.batch}" for c in cells) + " |",
                      "|---|" + "---:|" * len(cells)]
            results: dict[str, list[str]] = {}
            wall_results: dict[str, list[str]] = {}
            for cell in cells:
                inputs = cell_inputs(cell, device)
                tuned.set_seq_profile([cell.seq_len])
                for runner in runners:
                    why = runner.unsupported_reason(cell, cc)
                    if why:
                        results.setdefault(runner.name, []).append("n/a")
                        wall_results.setdefault(runner.name, []).append("n/a")
                        continue
                    try:
                        ours = runner.name == SERVING
                        split = launch_split if ours else None
                        if split is not None:
                            split.per_call = []
                        call = runner.prepare(cell, inputs)
                        walls: list[float] = []
                        timed = host_times_us(lambda i, c=call: c.launch(0), args.iters, split, args.layers, walls)
                        med, lo, hi = summary(timed)
                        results.setdefault(runner.name, []).append(f"{med:.1f} [{lo:.1f}, {hi:.1f}]")
                        med, lo, hi = summary(walls)
                        wall_results.setdefault(runner.name, []).append(f"{med:.1f} [{lo:.1f}, {hi:.1f}]")
                        if split is not None:
                            splits.append(split.row(cell.label(), torch_launch_us(device, args.iters, args.layers)))
                        if ours and args.profile_top:
                            prof = cProfile.Profile()
                            profiled(lambda i, c=call: c.launch(0), args.iters, prof)
                            profiles.append((cell.label(), profile_text(prof, args.profile_top, args.iters)))
                    except Exception as e:  # noqa: BLE001 - one runner's failure is a row, not the end
                        results.setdefault(runner.name, []).append(f"error: {type(e).__name__}: {str(e)[:80]}")
                        wall_results.setdefault(runner.name, []).append("error")
                del inputs
                torch.cuda.empty_cache()
            lines += [f"| {name} | " + " | ".join(texts) + " |" for name, texts in results.items()] + [""]
            lines += ["Until the GPU finished the step (host and GPU overlapped, us per call):", "",
                      "| runner | " + " | ".join(f"B={c.batch}" for c in cells) + " |", "|---|" + "---:|" * len(cells)]
            lines += [f"| {name} | " + " | ".join(texts) + " |" for name, texts in wall_results.items()] + [""]
    if splits:
        lines += ["## Where a serving call's host time goes (`--breakdown`, median us per call)", "",
                  "Inside the compiled CuTe functions (the split kernel, and the step-plan kernel on a step's first "
                  "call: TVM-FFI's argument conversion and the driver's launch), inside the combine's launch, and "
                  "the rest (our Python); launches per call in brackets; beside them one `torch.zero_` launch on the "
                  "same host.", "",
                  "| cell | whole call | CuTe calls | combine launch | the rest | one torch launch |",
                  "|---|---:|---:|---:|---:|---:|", *splits, ""]
    if args.stages:
        cell = Cell(batch=int(args.batches.split(",")[0]), seq_len=int(args.seq_lens.split(",")[0]), q_len=1,
                    kv_dtype="bf16")
        inputs = cell_inputs(cell, device)
        lines += [f"## Stages of the serving call, {cell.label()} (median us)", "", "| stage | us |", "|---|---:|"]
        lines += [f"| {name} | {us:.1f} |" for name, us in stage_times(cell, inputs, args.iters)] + [""]
    write_results(out_dir, lines, profiles)
    return 0


if __name__ == "__main__":
    sys.exit(main())
