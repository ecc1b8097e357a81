"""A timeline of a vLLM engine's model steps, for any attention backend: what serving spends its time on.

With ``CUTE_MLA_STEP_TRACE=DIR`` the plugin (which vLLM loads in every process, whichever backend serves) wraps the
GPU model runner's ``execute_model``: every step that schedules tokens appends one JSON line to
``DIR/steps-<pid>.jsonl`` with its composition and three times:

* ``period_ms``: CUDA events recorded on the step's stream at its entry and the next step's entry: the GPU's time
  from this step to the next, idle gaps (host work of the scheduler, the sampler, the n-gram proposer) included.
  Summed over the steps of a window it is the window's duration as the GPU sees it.
* ``forward_ms``: from the entry event to one recorded when ``execute_model`` returns (the forward enqueued): the
  GPU's time for the step's model forward, gaps of a host that launches slower than the GPU runs included.
* ``host_ms``: wall time inside ``execute_model`` (input preparation, metadata builders, eager launches or the
  graph replay).

Composition: requests and tokens scheduled, how many requests prefill (more tokens than 1 + their drafts), the
decode requests' query lengths, and the CUDA-graph mode vLLM chose (``FULL``, ``PIECEWISE`` or ``NONE``, from
its batch-execution decision when the runner has one). ``step_kind`` classifies the step:
``decode`` (every request decodes with the same query length), ``decode_mixed_q`` (decodes of different query
lengths, e.g. some requests with a draft and some without), ``mixed`` (prefill chunks beside decodes) and
``prefill``. ``benchmarks/bench_serve.py --step-trace`` sets the variable for its servers and summarises each row's
window; ``summarise`` below is that summary.

Diagnostics only: two CUDA events and a perf_counter per step, events resolved a few steps later (no sync).
"""

from __future__ import annotations

import atexit
import collections
import json
import os
import statistics
import threading
import time
from pathlib import Path

STEP_KINDS = ("decode", "decode_mixed_q", "mixed", "prefill")
# requests a step schedules, in buckets: steps of one kind compare between servers only at like batch sizes
REQUEST_BUCKETS = ((1, 8), (9, 16), (17, 32), (33, 64), (65, 128), (129, 1 << 30))


def step_composition(scheduler_output) -> dict:
    """Requests, tokens, prefills and decode query lengths of one step (vLLM's ``SchedulerOutput``)."""
    drafts = scheduler_output.scheduled_spec_decode_tokens or {}
    new = {r.req_id for r in scheduler_output.scheduled_new_reqs}
    q_lens: dict[int, int] = {}
    prefills = 0
    for req_id, tokens in scheduler_output.num_scheduled_tokens.items():
        if req_id in new or tokens > 1 + len(drafts.get(req_id, ())):
            prefills += 1
        else:
            q_lens[tokens] = q_lens.get(tokens, 0) + 1
    decodes = sum(q_lens.values())
    if prefills and decodes:
        kind = "mixed"
    elif prefills:
        kind = "prefill"
    else:
        kind = "decode" if len(q_lens) == 1 else "decode_mixed_q"
    return {"reqs": len(scheduler_output.num_scheduled_tokens),
            "tokens": int(scheduler_output.total_num_scheduled_tokens), "prefills": prefills, "decodes": decodes,
            "decode_q_lens": {str(q): n for q, n in sorted(q_lens.items())}, "step_kind": kind}


class StepTrace:
    """Records steps; a step is written once the next step's entry event has completed (no host sync), by the
    step loop or, while the engine idles, by a daemon thread twice a second."""

    def __init__(self, path: Path, flush_every: int = 64, background_s: float | None = 0.5):
        self.path = path
        self.flush_every = flush_every
        self.pending: collections.deque = collections.deque()  # (record, entry event, forward-end event)
        self.lines: list[str] = []
        self.lock = threading.Lock()
        self.graph_mode: str | None = None  # set by the batch-execution wrapper during the current step
        atexit.register(self.close)
        if background_s:
            threading.Thread(target=self._background, args=(background_s,), daemon=True,
                             name="cute-mla-step-trace").start()

    def _background(self, every_s: float) -> None:
        while True:
            time.sleep(every_s)
            with self.lock:
                self._resolve(None)
                self.flush()

    def begin(self, torch_mod):
        entry = torch_mod.cuda.Event(enable_timing=True)
        entry.record()
        self.graph_mode = None
        with self.lock:
            self._resolve(entry)
        return entry, time.perf_counter(), time.time()

    def end(self, torch_mod, scheduler_output, entry, t_host: float, wall: float) -> None:
        done = torch_mod.cuda.Event(enable_timing=True)
        done.record()
        record = {"t": round(wall, 6), "host_ms": round((time.perf_counter() - t_host) * 1e3, 4),
                  "graph": self.graph_mode, **step_composition(scheduler_output)}
        with self.lock:
            self.pending.append((record, entry, done))

    def _resolve(self, next_entry) -> None:
        """Give every pending step whose successor's entry has been reached its GPU times (``next_entry``: the
        entry of the step being started, None when no step is)."""
        while self.pending:
            record, entry, done = self.pending[0]
            successor = self.pending[1][1] if len(self.pending) > 1 else next_entry
            if successor is None or not successor.query():
                break
            self.pending.popleft()
            record["period_ms"] = round(entry.elapsed_time(successor), 4)
            record["forward_ms"] = round(entry.elapsed_time(done), 4) if done.query() else None
            self.lines.append(json.dumps(record))
        if len(self.lines) >= self.flush_every:
            self.flush()

    def flush(self) -> None:
        if self.lines:
            with open(self.path, "a") as f:
                f.write("\n".join(self.lines) + "\n")
            self.lines.clear()

    def close(self) -> None:
        with self.lock:
            self.flush()  # a step whose successor never came keeps no period


_trace: StepTrace | None = None


def install(directory: str) -> bool:
    """Wrap vLLM's GPU model runner (once per process). False when this vLLM has none to wrap."""
    global _trace
    try:
        from vllm.v1.worker import gpu_model_runner
    except Exception:  # a process without the worker's stack (or another vLLM layout): nothing to trace
        return False
    runner = gpu_model_runner.GPUModelRunner
    if getattr(runner.execute_model, "_cute_mla_step_trace", False):
        return True
    Path(directory).mkdir(parents=True, exist_ok=True)
    trace = StepTrace(Path(directory) / f"steps-{os.getpid()}.jsonl")
    original = runner.execute_model

    import torch  # the worker's: vLLM has it loaded already

    def execute_model(self, scheduler_output, *args, **kwargs):
        if not scheduler_output.total_num_scheduled_tokens:
            return original(self, scheduler_output, *args, **kwargs)
        entry, t_host, wall = trace.begin(torch)
        out = original(self, scheduler_output, *args, **kwargs)
        trace.end(torch, scheduler_output, entry, t_host, wall)
        return out

    execute_model._cute_mla_step_trace = True
    runner.execute_model = execute_model
    decide = getattr(runner, "_determine_batch_execution_and_padding", None)
    if decide is not None:
        def _determine_batch_execution_and_padding(self, *args, **kwargs):
            result = decide(self, *args, **kwargs)
            mode = result[0] if isinstance(result, tuple) else None
            if trace.graph_mode is None and mode is not None:
                trace.graph_mode = getattr(mode, "name", str(mode))
            return result

        runner._determine_batch_execution_and_padding = _determine_batch_execution_and_padding
    _trace = trace
    return True


# ---------------------------------------------------------------- reading a trace

def read_steps(directory: Path) -> list[dict]:
    """Every step of every process's file in ``directory``, in time order (steps without a period dropped)."""
    steps = []
    for path in sorted(Path(directory).glob("steps-*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                step = json.loads(line)
                if step.get("period_ms") is not None:
                    steps.append(step)
    return sorted(steps, key=lambda s: s["t"])


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarise(steps: list[dict], start: float | None = None, end: float | None = None) -> dict:
    """Per step kind (and the graph mode it ran in) within [start, end] (wall seconds; a period is cut at ``end``):
    steps, the share of the window's GPU time, median period / forward / host milliseconds, mean decode requests
    and tokens, and the median period by the requests a step schedules (``REQUEST_BUCKETS``: bucket -> (steps,
    ms))."""
    chosen = [s for s in steps if (start is None or s["t"] >= start) and (end is None or s["t"] <= end)]
    if end is not None:  # the window's last step runs on into the idle time after it: count what is inside
        chosen = [{**s, "period_ms": min(s["period_ms"], (end - s["t"]) * 1e3)} for s in chosen]
    total = sum(s["period_ms"] for s in chosen)
    groups: dict[tuple[str, str], list[dict]] = {}
    for s in chosen:
        groups.setdefault((s["step_kind"], s.get("graph") or "?"), []).append(s)
    kinds = {}
    for (kind, graph), group in sorted(groups.items(), key=lambda kv: -sum(s["period_ms"] for s in kv[1])):
        period = sum(s["period_ms"] for s in group)
        forwards = [s["forward_ms"] for s in group if s.get("forward_ms") is not None]
        kinds[f"{kind}/{graph}"] = {
            "steps": len(group), "time_ms": round(period, 2), "share": round(period / total, 4) if total else None,
            "period_ms_p50": _median([s["period_ms"] for s in group]),
            "forward_ms_p50": _median(forwards), "host_ms_p50": _median([s["host_ms"] for s in group]),
            "decodes_mean": round(sum(s["decodes"] for s in group) / len(group), 2),
            "period_ms_p50_by_requests": {
                f"{lo}-{hi}": (len(b), _median([s["period_ms"] for s in b])) for lo, hi in REQUEST_BUCKETS
                if (b := [s for s in group if lo <= s["decodes"] + s["prefills"] <= hi])},
            "tokens_mean": round(sum(s["tokens"] for s in group) / len(group), 1)}
    return {"steps": len(chosen), "time_ms": round(total, 2), "kinds": kinds}
