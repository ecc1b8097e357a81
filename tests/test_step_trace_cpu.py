"""mla_backend_plugin/vllm/step_trace.py without a GPU: how a step is classified, the event bookkeeping (fake
events), the summary, the wrap of vLLM's real GPU model runner, and bench_serve.py's steps.md."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from mla_backend_plugin.vllm import step_trace

ROOT = Path(__file__).resolve().parent.parent


def _sched(tokens: dict[str, int], drafts: dict[str, int] | None = None, new: tuple[str, ...] = ()):
    drafts = drafts or {}
    return types.SimpleNamespace(
        num_scheduled_tokens=tokens, total_num_scheduled_tokens=sum(tokens.values()),
        scheduled_spec_decode_tokens={r: [7] * n for r, n in drafts.items()},
        scheduled_new_reqs=[types.SimpleNamespace(req_id=r) for r in new])


@pytest.mark.parametrize("tokens,drafts,new,kind,prefills,q_lens", [
    ({"a": 2, "b": 2}, {"a": 1, "b": 1}, (), "decode", 0, {"2": 2}),
    ({"a": 1, "b": 1}, {}, (), "decode", 0, {"1": 2}),
    ({"a": 2, "b": 1}, {"a": 1}, (), "decode_mixed_q", 0, {"1": 1, "2": 1}),
    ({"a": 2, "c": 2048}, {"a": 1}, ("c",), "mixed", 1, {"2": 1}),
    ({"a": 1, "c": 512}, {}, (), "mixed", 1, {"1": 1}),  # a chunked prefill's later chunk: not a new request
    ({"c": 3}, {}, ("c",), "prefill", 1, {}),  # a new request of 3 tokens prefills, however short
])
def test_step_composition(tokens, drafts, new, kind, prefills, q_lens):
    c = step_trace.step_composition(_sched(tokens, drafts, new))
    assert (c["step_kind"], c["prefills"], c["decode_q_lens"]) == (kind, prefills, q_lens)
    assert c["reqs"] == len(tokens) and c["tokens"] == sum(tokens.values())
    assert kind in step_trace.STEP_KINDS


class _Clock:
    """A fake GPU: events complete when the test says so; elapsed_time subtracts the times they were given."""

    def __init__(self):
        self.now = 0.0
        self.events = []

    def module(self):
        clock = self

        class Event:
            def __init__(self, enable_timing=False):
                assert enable_timing
                self.t = None

            def record(self):
                clock.events.append(self)

            def query(self):
                return self.t is not None

            def elapsed_time(self, other):
                assert self.t is not None and other.t is not None
                return other.t - self.t

        return types.SimpleNamespace(cuda=types.SimpleNamespace(Event=Event))

    def run_to(self, t):
        """The GPU reaches every recorded event, the last one at time t (1 ms apart before it)."""
        pending = [e for e in self.events if e.t is None]
        for i, e in enumerate(pending):
            e.t = t - (len(pending) - 1 - i)


def test_events_resolve_without_sync(tmp_path):
    clock = _Clock()
    torch_mod = clock.module()
    trace = step_trace.StepTrace(tmp_path / "steps-1.jsonl", flush_every=1, background_s=None)
    trace.graph_mode = None
    entry, t_host, wall = trace.begin(torch_mod)
    trace.graph_mode = "FULL"
    trace.end(torch_mod, _sched({"a": 2}, {"a": 1}), entry, t_host, wall)
    assert not (tmp_path / "steps-1.jsonl").exists()  # its successor's entry not reached: nothing written
    clock.run_to(10.0)  # entry 9, forward end 10
    entry2, t2, w2 = trace.begin(torch_mod)  # the next entry is not reached yet either
    assert not (tmp_path / "steps-1.jsonl").exists()
    trace.end(torch_mod, _sched({"a": 1, "c": 100}, new=("c",)), entry2, t2, w2)
    clock.run_to(15.0)  # entry2 at 14, its forward end at 15
    entry3, t3, w3 = trace.begin(torch_mod)  # entry3 not reached; step 1 resolves (its successor entry2 is at 14)
    lines = [json.loads(x) for x in (tmp_path / "steps-1.jsonl").read_text().splitlines()]
    assert len(lines) == 1
    assert lines[0]["period_ms"] == pytest.approx(5.0) and lines[0]["forward_ms"] == pytest.approx(1.0)
    assert lines[0]["graph"] == "FULL" and lines[0]["step_kind"] == "decode"
    trace.end(torch_mod, _sched({"a": 2}, {"a": 1}), entry3, t3, w3)
    clock.run_to(21.0)  # entry3 at 20
    trace._resolve(None)  # the background thread's call: step 2 resolves against entry3, step 3 has no successor
    trace.close()
    steps = step_trace.read_steps(tmp_path)
    assert [s["step_kind"] for s in steps] == ["decode", "mixed"]
    assert steps[1]["period_ms"] == pytest.approx(6.0) and steps[1]["graph"] is None


def test_summarise_shares_and_window():
    cases = [(1.0, 4.0, 3.0, "decode", "FULL", 10), (2.0, 6.0, 5.0, "decode", "FULL", 10),
             (3.0, 30.0, 29.0, "mixed", "PIECEWISE", 9), (9.0, 99.0, 1.0, "decode", "FULL", 1)]
    steps = [{"t": t, "period_ms": p, "forward_ms": f, "host_ms": 0.1, "step_kind": k, "graph": g, "decodes": d,
              "prefills": int(k == "mixed"), "tokens": 2 * d} for t, p, f, k, g, d in cases]
    s = step_trace.summarise(steps, start=0.5, end=5.0)
    assert s["steps"] == 3 and s["time_ms"] == 40.0
    assert list(s["kinds"]) == ["mixed/PIECEWISE", "decode/FULL"]  # by time
    assert s["kinds"]["decode/FULL"]["share"] == 0.25 and s["kinds"]["decode/FULL"]["period_ms_p50"] == 5.0
    assert s["kinds"]["mixed/PIECEWISE"]["forward_ms_p50"] == 29.0
    assert s["kinds"]["decode/FULL"]["period_ms_p50_by_requests"] == {"9-16": (2, 5.0)}
    s = step_trace.summarise(steps, start=2.0, end=2.003)  # the step at 2.0 s runs 6 ms: 3 of them in the window
    assert s["time_ms"] == pytest.approx(3.0)


def test_install_wraps_vllms_runner(tmp_path, monkeypatch):
    """Against the installed vLLM's real class: both methods wrapped once, the graph mode taken from the batch
    decision, steps without tokens not recorded."""
    runner_mod = pytest.importorskip("vllm.v1.worker.gpu_model_runner")
    cls = runner_mod.GPUModelRunner
    assert hasattr(cls, "_determine_batch_execution_and_padding")  # where the graph mode comes from
    clock = _Clock()
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=clock.module().cuda))
    calls = []

    def fake_execute(self, scheduler_output, intermediate_tensors=None):
        if scheduler_output.total_num_scheduled_tokens:
            self._determine_batch_execution_and_padding(num_tokens=2)
        calls.append(scheduler_output)
        return "out"

    def fake_decide(self, **kwargs):
        return (types.SimpleNamespace(name="FULL"), None, False, None, None)

    monkeypatch.setattr(cls, "execute_model", fake_execute)
    monkeypatch.setattr(cls, "_determine_batch_execution_and_padding", fake_decide)
    assert step_trace.install(str(tmp_path))
    assert step_trace.install(str(tmp_path))  # idempotent
    runner = object.__new__(cls)
    assert cls.execute_model(runner, _sched({})) == "out"  # nothing scheduled: passed through
    assert cls.execute_model(runner, _sched({"a": 2}, {"a": 1})) == "out"
    clock.run_to(3.0)
    assert cls.execute_model(runner, _sched({"a": 2}, {"a": 1})) == "out"
    clock.run_to(5.0)
    step_trace._trace._resolve(None)
    step_trace._trace.close()
    steps = step_trace.read_steps(tmp_path)
    assert len(calls) == 3 and len(steps) == 1 and steps[0]["graph"] == "FULL"


def test_bench_serve_steps_report(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_serve
    finally:
        sys.path.pop(0)
    row = {"backend": "CUTE_MLA", "kv_cache_dtype": "auto", "spec_tokens": 1, "layers": 16, "input_len": 2048,
           "output_len": 256, "request_rate": "8", "num_prompts": 128, "max_num_seqs": 128, "duration_s": 10.0,
           "completed": 128, "output_throughput": 1900.0, "tpot_p50_ms": 3.8}
    bench_serve.record_window(tmp_path, row, end=1000.0)
    d = bench_serve.steps_dir(tmp_path, "CUTE_MLA", "auto", 1, 16)
    lines = [{"t": t, "period_ms": 5.0, "forward_ms": 4.0, "host_ms": 0.2, "step_kind": "decode", "graph": "FULL",
              "decodes": 20, "prefills": 0, "tokens": 40} for t in (985.0, 991.0, 995.0, 999.0)]
    (d / "steps-1.jsonl").write_text("\n".join(map(json.dumps, lines)) + "\n")
    csv_row = {k: str(v) for k, v in row.items()}  # as read back from rows.csv
    summary = bench_serve.row_steps(tmp_path, csv_row)
    assert summary["steps"] == 3  # 985.0 is before the window (the warm-up)
    path = bench_serve.render_steps(tmp_path, [csv_row])
    assert "decode/FULL" in path.read_text()
    args = bench_serve.parse_args(["--step-trace", "--out-dir", str(tmp_path)])
    _, env = bench_serve.server_command(args, "CUTE_MLA", "auto", 1, 8000)
    assert env["CUTE_MLA_STEP_TRACE"] == str(d)
