"""Running the conditions' processes, up to --jobs at once (timeouts, the run's budget), and the eval loop that
scores each condition as its process ends while the float32 reference runs."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import signal
import subprocess
import time

from mla_backend_plugin.evals.plan import Condition
from mla_backend_plugin.evals.reference import reference_rows
from mla_backend_plugin.evals.stats import condition_rows

MIN_START_S = 60.0  # no engine starts, compiles and generates in less: later conditions are skipped instead


@dataclasses.dataclass
class Run:
    """One process and how it ended: status pending | running | ok | failed | timeout | cut | skipped."""
    label: str
    argv: list[str]
    env: dict[str, str] | None
    log_path: str
    status: str = "pending"
    detail: str = ""
    seconds: float = 0.0
    proc: subprocess.Popen | None = None
    started: float = 0.0

    @property
    def ended(self) -> bool:
        return self.status not in ("pending", "running")


def _last_error_line(log_path: str) -> str:
    try:
        with open(log_path, errors="replace") as f:
            lines = [ln.strip() for ln in f.readlines()[-200:] if ln.strip()]
    except OSError:
        return ""
    errors = [ln for ln in lines if re.search(r"(Error|Exception)\b", ln)]
    return (errors or lines or [""])[-1][-300:]


class Runner:
    """Starts ``runs`` in order, at most ``jobs`` at once, each in its own process group (vLLM's and the
    compilers' children die with it); kills one that outlives ``timeout_s`` or the ``deadline``
    (time.monotonic()), and starts none with less than MIN_START_S of the deadline left."""

    def __init__(self, runs: list[Run], jobs: int, timeout_s: float, deadline: float | None = None,
                 min_start_s: float = MIN_START_S):
        self.runs, self.jobs, self.timeout_s, self.deadline = runs, max(1, jobs), timeout_s, deadline
        self.min_start_s = min_start_s

    def done(self) -> bool:
        return all(r.ended for r in self.runs)

    def poll(self) -> None:
        now = time.monotonic()
        overdue = []
        for run in self.runs:
            if run.status != "running":
                continue
            code = run.proc.poll()
            limit = run.started + self.timeout_s
            if self.deadline is not None:
                limit = min(limit, self.deadline)
            if code is None and now >= limit:
                overdue.append(run)
            elif code is not None:
                run.status = "ok" if code == 0 else "failed"
                run.detail = "" if code == 0 else f"exit {code}: {_last_error_line(run.log_path)}"
                run.seconds = now - run.started
        self._kill(overdue)
        for run in overdue:
            # "cut": the whole run's budget ended it before its own timeout (not a verdict on the condition)
            cut = run.started + self.timeout_s > now
            run.status = "cut" if cut else "timeout"
            why = "the run's time budget ended it" if cut else "killed"
            run.detail = f"{why} after {now - run.started:.0f} s; log: {_last_error_line(run.log_path)}"
            run.seconds = now - run.started
        running = sum(r.status == "running" for r in self.runs)
        for run in self.runs:
            if run.status != "pending" or running >= self.jobs:
                continue
            if self.deadline is not None and self.deadline - time.monotonic() < self.min_start_s:
                run.status, run.detail = "skipped", "the run's time budget was spent"
                continue
            os.makedirs(os.path.dirname(run.log_path) or ".", exist_ok=True)
            with open(run.log_path, "w") as log:
                run.proc = subprocess.Popen(run.argv, env=run.env, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
            run.status, run.started = "running", time.monotonic()
            running += 1

    @staticmethod
    def _kill(runs: list[Run], grace_s: float = 10.0) -> None:
        """SIGTERM to every run's process group at once, SIGKILL after ``grace_s`` (also to whatever a group
        leader that exited left behind)."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for run in runs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(run.proc.pid, sig)
            end = time.monotonic() + grace_s
            for run in runs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    run.proc.wait(timeout=max(0.0, end - time.monotonic()))

    def kill_all(self) -> None:
        running = [run for run in self.runs if run.status == "running"]
        self._kill(running)
        for run in running:
            run.status, run.detail = "timeout", "the eval was stopped"
            run.seconds = time.monotonic() - run.started


def slug(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", label).strip("_")


def evaluate(model_dir: str, conds: list[Condition], sets, flat, runner: Runner, result_paths) -> list[dict]:
    """The reference's rows, then each condition's as its process ends, in the plan's order. The reference runs
    in a thread (its GPU kernels release the GIL) so that the runner keeps starting, timing and killing
    processes meanwhile."""
    import concurrent.futures

    import torch

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending_reference = pool.submit(reference_rows, model_dir, conds, sets, flat)
        while not pending_reference.done():
            runner.poll()
            time.sleep(0.5)
        ref, rows = pending_reference.result()
    reported = 0
    while reported < len(conds):
        runner.poll()
        while reported < len(conds) and runner.runs[reported].ended:
            c, run = conds[reported], runner.runs[reported]
            reported += 1
            print(f"{c.label}: {run.status} after {run.seconds:.0f} s {run.detail}".rstrip(), flush=True)
            if run.status != "ok":
                continue
            results = torch.load(result_paths[reported - 1], weights_only=True)
            new = condition_rows(c.row_fields, sets, results, ref.logprobs([r["tokens"] for r in results]))
            for s in new:
                print(f"  {s['task']}@{s['length']}: {s['accuracy']:.3f} ({s['ci_low']:.3f} .. {s['ci_high']:.3f}), "
                      f"KL mean {s['kl_mean']:.3g} max {s['kl_max']:.3g}", flush=True)
            rows += new
        if reported < len(conds):
            time.sleep(0.5)
    return rows
