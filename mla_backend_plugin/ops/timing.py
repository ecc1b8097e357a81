"""The one timing core: CUDA graphs, KV rotated past L2, medians of many replays.

Used by the autotuner, ``benchmarks/bench_decode.py`` and the tests' graph checks, so that what the tuner
ranks is what the benchmark reports, and both time the way production runs (vLLM replays one CUDA graph per
batch size; each layer reads its own KV cache, so L2 never holds the KV of the next call).

* ``capture_graph(launch, calls, copies)``: warm ``launch`` up on a side stream (lazy compilation and
  allocation must not happen during capture), then capture ``calls`` calls cycling through ``copies`` KV
  copies (``launch(i)`` runs on copy ``i``);
* ``kv_copies_for`` / ``calls_per_graph_for``: enough copies to exceed L2 ``l2_factor`` times, and a call
  count that reads each copy equally often;
* ``time_graphs``: replay several graphs interleaved (round-robin, so drift hits all alike), each replay
  between its own pair of CUDA events; per-call medians and spreads.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable


def event_times_s(fn: Callable[[], object], iters: int, warmup: int = 3) -> list[float]:
    """Seconds of each of ``iters`` calls of ``fn``, timed by CUDA events after ``warmup`` calls."""
    import torch

    for _ in range(warmup):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) / 1e3 for start, end in events]


def measure_hbm_bytes_per_s(device, nbytes: int = 2**30, iters: int = 20) -> float:
    """A device-to-device copy far larger than L2, counting read + write bytes; the best of ``iters``."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = min(event_times_s(lambda: dst.copy_(src), iters))
    return 2 * nbytes / best


def _matmul_flops_per_s(matmul: Callable[[], object], n: int, iters: int) -> float:
    """2 n^3 over the best of ``iters`` event-timed calls of an n x n x n ``matmul``."""
    return 2 * n**3 / min(event_times_s(matmul, iters))


def measure_bf16_flops_per_s(device, n: int = 8192, iters: int = 20) -> float:
    """An n^3 bf16 matmul (cuBLAS) on random data; the best of ``iters``."""
    import torch

    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    c = torch.empty(n, n, dtype=torch.bfloat16, device=device)
    return _matmul_flops_per_s(lambda: torch.matmul(a, b, out=c), n, iters)


def measure_fp8_flops_per_s(device, n: int = 8192, iters: int = 20) -> float | None:
    """An n^3 e4m3 x e4m3 -> bf16 matmul (cuBLAS through ``torch._scaled_mm``, per-tensor scales, fast
    accumulation: the rate of the fp8 tensor-core instructions an fp8 attention kernel issues) on random data;
    the best of ``iters``. None on a device without fp8 matrix instructions (compute capability below 8.9)."""
    import torch

    if torch.cuda.get_device_capability(device) < (8, 9):
        return None
    fp8 = torch.float8_e4m3fn
    a = torch.randn(n, n, device=device).to(fp8)
    b = torch.randn(n, n, device=device).to(fp8).t()  # column-major, as cuBLASLt's fp8 kernels take B
    one = torch.ones((), dtype=torch.float32, device=device)
    return _matmul_flops_per_s(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                                                        use_fast_accum=True), n, iters)


def kv_copies_for(bytes_per_copy: int, l2_bytes: int, l2_factor: float = 2.0, max_copies: int = 256) -> int:
    """Enough KV copies to add up to ``l2_factor`` x L2, so that reading them round-robin misses L2."""
    return max(1, min(max_copies, math.ceil(l2_factor * l2_bytes / max(bytes_per_copy, 1))))


def calls_per_graph_for(copies: int, min_calls: int) -> int:
    """A multiple of the copy count (each copy read equally often), at least ``min_calls``."""
    return copies * math.ceil(min_calls / copies)


def capture_graph(launch: Callable[[int], object], calls: int = 1, copies: int = 1, warmup: int = 2):
    """One CUDA graph of ``calls`` calls ``launch(k % copies)``, after ``warmup`` eager calls on a side stream."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(warmup):
            launch(i % copies)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for k in range(calls):
            launch(k % copies)
    torch.cuda.synchronize()
    return graph


@dataclasses.dataclass
class Timing:
    median_us: float
    p10_us: float
    p90_us: float
    replays: int


def quantile(sorted_values: list[float], q: float) -> float:
    pos = q * (len(sorted_values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def time_graphs(graphs: dict[str, tuple[object, int]], target_s: float = 0.1, min_replays: int = 10,
                max_replays: int = 1000, warmup: int = 3) -> dict[str, Timing]:
    """Replay every graph interleaved (round-robin), each replay timed by its own pair of CUDA events.

    ``graphs`` maps a name to (graph, calls captured in it). A graph gets about ``target_s`` seconds of
    replays, within [min_replays, max_replays]; times are per call (replay time / calls).
    """
    import torch

    replays = {}
    for name, (graph, _) in graphs.items():
        for _ in range(warmup):
            graph.replay()
        estimate_s = min(event_times_s(graph.replay, iters=1, warmup=0))
        replays[name] = int(min(max_replays, max(min_replays, math.ceil(target_s / max(estimate_s, 1e-7)))))
    events = {name: [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                     for _ in range(n)] for name, n in replays.items()}
    for rep in range(max(replays.values(), default=0)):
        for name, (graph, _) in graphs.items():
            if rep < replays[name]:
                start, end = events[name][rep]
                start.record()
                graph.replay()
                end.record()
    torch.cuda.synchronize()
    timings = {}
    for name, (_, calls) in graphs.items():
        per_call_us = sorted(start.elapsed_time(end) * 1e3 / calls for start, end in events[name])
        timings[name] = Timing(quantile(per_call_us, 0.5), quantile(per_call_us, 0.1), quantile(per_call_us, 0.9),
                               len(per_call_us))
    return timings
