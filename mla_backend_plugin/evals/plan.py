"""The eval's plan: the conditions (backend x kernel x KV dtype x mode x speculation x parallelism), the named
plans (``PLANS``), the checks a parallel layout must pass before any engine starts, and the problem sets."""

from __future__ import annotations

import dataclasses

from mla_backend_plugin.evals import tasks

OUR_KERNELS = ("auto", "cute_sm90", "triton", "xqa_sm120")
PEER_BACKENDS = ("TRITON_MLA", "FLASHMLA", "FLASH_ATTN_MLA")
BACKENDS = ("CUTE_MLA",) + PEER_BACKENDS
# backends vLLM 0.26 runs with q_len > 1 in decode (n-gram speculation); TRITON_MLA decodes one token per step
SPEC_BACKENDS = ("CUTE_MLA", "FLASHMLA", "FLASH_ATTN_MLA")
NO_FP8 = ("FLASH_ATTN_MLA",)  # vLLM 0.26 refuses an fp8 cache there
TORCH = "torch"  # the eval model in plain torch, bf16 arithmetic, no cache: not a vLLM backend
REFERENCE = "reference"  # the float32 torch model, computed by the runner itself
NGRAM_TOKENS = 3
# decode context parallelism needs the impl to return the decode LSE (vLLM 0.26: can_return_lse_for_decode; its
# CUTLASS_MLA and FLASHINFER_MLA have it too, on SM100); n-gram speculation under DCP with
# cp_kv_cache_interleave_size > 1 also needs supports_mtp_with_cp_non_trivial_interleave_size, which of these
# only CUTE_MLA declares
DCP_BACKENDS = ("CUTE_MLA", "TRITON_MLA", "FLASHMLA", "FLASH_ATTN_MLA")
MTP_INTERLEAVE_BACKENDS = ("CUTE_MLA",)


@dataclasses.dataclass(frozen=True)
class Condition:
    backend: str  # vLLM attention backend name, or TORCH
    kernel: str  # our kernel for CUTE_MLA (CUTE_MLA_KERNEL), "-" for the others
    kv_dtype: str  # "auto" (bf16) | "fp8"
    mode: str  # "eager" | "graphs"
    spec: int  # n-gram draft tokens (0: none)
    tp: int = 1  # tensor-parallel size (GPUs of the engine)
    dcp: int = 1  # decode-context-parallel size (divides tp)
    interleave: int = 1  # cp_kv_cache_interleave_size under DCP (and the engine's block size when > 1)

    @property
    def label(self) -> str:
        if self.backend == TORCH:
            return "torch bf16"
        name = self.backend if self.backend != "CUTE_MLA" else f"CUTE_MLA[{self.kernel}]"
        return f"{name} kv={'bf16' if self.kv_dtype == 'auto' else self.kv_dtype} {self.mode}" + (
            f" spec{self.spec}" if self.spec else "") + parallel_label(self.tp, self.dcp, self.interleave)

    @property
    def ours(self) -> bool:
        return self.backend == "CUTE_MLA"

    @property
    def row_fields(self) -> dict:
        """What each of the condition's result rows says about it."""
        return {"condition": self.label, "backend": self.backend, "kernel": self.kernel, "ours": self.ours,
                "kv_dtype": self.kv_dtype, "mode": self.mode, "spec": self.spec, "tp": self.tp, "dcp": self.dcp,
                "interleave": self.interleave}


TORCH_CONDITION = Condition(TORCH, "-", "-", "-", 0)  # no cache, no engine: only --backends selects it


def parallel_label(tp: int, dcp: int, interleave: int) -> str:
    """`` tp2``, `` tp2 dcp2 i64``; empty on one GPU (the labels of a one-GPU run are those it always had)."""
    if tp == 1 and dcp == 1:
        return ""
    return f" tp{tp}" + (f" dcp{dcp} i{interleave}" if dcp > 1 else "")


SINGLE_GPU = ((1, 1, 1),)


def parallel_layouts(tps, dcps, interleaves) -> tuple[tuple[int, int, int], ...]:
    """(tp, dcp, interleave) of every combination of the options' values where the DCP size divides the TP size
    (vLLM's rule: DCP reuses the TP ranks); the interleave only matters under DCP (1 without)."""
    out = []
    for tp in tps:
        for dcp in dcps:
            if tp % dcp:
                continue
            for interleave in (interleaves if dcp > 1 else (1,)):
                out.append((tp, dcp, interleave))
    layouts = tuple(dict.fromkeys(out))
    if not layouts:
        raise ValueError(f"--tensor-parallel-size {','.join(map(str, tps))} x --decode-context-parallel-size "
                         f"{','.join(map(str, dcps))}: no combination where the DCP size divides the TP size")
    return layouts


def conditions(backends, kernels, kv_dtypes, modes, specs, layouts=SINGLE_GPU) -> list[Condition]:
    out = []
    for backend in backends:
        for kernel in (kernels if backend == "CUTE_MLA" else ("-",)):
            for kv in kv_dtypes:
                if kv == "fp8" and backend in NO_FP8:
                    continue
                for mode in modes:
                    for spec in specs:
                        if spec and backend not in SPEC_BACKENDS:
                            continue
                        for tp, dcp, interleave in layouts:
                            if dcp > 1 and (backend not in DCP_BACKENDS or (
                                    spec and interleave > 1 and backend not in MTP_INTERLEAVE_BACKENDS)):
                                continue
                            out.append(Condition(backend, kernel, kv, mode, spec, tp, dcp, interleave))
    return out


def with_layouts(conds, layouts) -> list[Condition]:
    """Each vLLM condition of ``conds`` under every parallel layout (the torch condition once, as it is), in the
    order of ``conds``, a condition's layouts side by side."""
    out = []
    for c in conds:
        if c.backend == TORCH:
            out.append(c)
            continue
        out += conditions((c.backend,), (c.kernel,), (c.kv_dtype,), (c.mode,), (c.spec,), layouts)
    return list(dict.fromkeys(out))


def layout_problem(backend: str, heads: int, tp: int, dcp: int, interleave: int = 1, spec: int = 0) -> str | None:
    """Why an engine of ``backend`` on a model of ``heads`` attention heads would be refused at start under this
    layout (vLLM 0.26's rules and our kernels'), naming the options and the allowed values; None when it would
    start. The DCP size divides the TP size and the heads split evenly over the TP ranks; under DCP the backend
    returns the decode LSE (``DCP_BACKENDS``), and with speculation and an interleave above 1 declares MTP support
    for it (``MTP_INTERLEAVE_BACKENDS``); CUTE_MLA decodes heads per rank x the DCP size (vLLM gathers q over the
    DCP group), which must be a head count our kernels take."""
    from mla_backend_plugin.ops.constants import SUPPORTED_NUM_HEADS

    options = f"--tensor-parallel-size {tp} --decode-context-parallel-size {dcp}"
    if min(tp, dcp, interleave) < 1 or tp % dcp:
        return f"{options}: allowed: sizes >= 1, the DCP size dividing the TP size"
    if heads % tp:
        return f"{options}: the model's {heads} attention heads do not split evenly; allowed TP sizes: divisors " \
               f"of {heads}"
    if dcp > 1 and backend not in DCP_BACKENDS:
        return f"{options}: {backend}'s decode returns no LSE; allowed backends under DCP: {', '.join(DCP_BACKENDS)}"
    if dcp > 1 and interleave > 1 and spec and backend not in MTP_INTERLEAVE_BACKENDS:
        return (f"--cp-kv-cache-interleave-size {interleave} with {spec} speculative tokens: vLLM 0.26 refuses it "
                f"for {backend}; allowed: interleave 1, no speculation, or {', '.join(MTP_INTERLEAVE_BACKENDS)}")
    per_call = heads // tp * dcp
    if backend == "CUTE_MLA" and per_call not in SUPPORTED_NUM_HEADS:
        fits = [(t, d) for t in (1, 2, 4, 8) for d in (1, 2, 4, 8)
                if heads % t == 0 and t % d == 0 and heads // t * d in SUPPORTED_NUM_HEADS]
        return (f"{options}: CUTE_MLA would decode {heads} heads / {tp} x {dcp} = {per_call} query heads per call; "
                f"allowed: {', '.join(map(str, SUPPORTED_NUM_HEADS))}. With {heads} heads, (TP, DCP) in {fits}")
    return None


def check_layouts(conds, heads: int) -> None:
    """Refuse, before any engine starts, a condition whose layout a model of ``heads`` attention heads, vLLM or our
    kernels cannot run (``layout_problem``; the eval's --widen-heads multiplies the heads); an interleave above 1
    becomes the engine's block size here, so it must be one of our block sizes. ValueError naming the option and
    the allowed values."""
    from mla_backend_plugin.ops.constants import SUPPORTED_BLOCK_SIZES

    for c in conds:
        if c.backend == TORCH or (c.tp, c.dcp) == (1, 1):
            continue
        problem = layout_problem(c.backend, heads, c.tp, c.dcp, c.interleave, c.spec)
        if problem:
            raise ValueError(problem + ("; --widen-heads multiplies the heads (the same model, each head repeated)"
                                        if "query heads per call" in problem else ""))
        if c.dcp > 1 and c.interleave > 1 and c.interleave not in SUPPORTED_BLOCK_SIZES:
            raise ValueError(f"--cp-kv-cache-interleave-size {c.interleave}: an interleave above 1 is the engine's "
                             f"block size here; allowed: 1, {', '.join(map(str, SUPPORTED_BLOCK_SIZES))}")


def select(conds, backends=None, kernels=None, kv_dtypes=None, modes=None, specs=None) -> list[Condition]:
    """The conditions of ``conds`` that every given filter admits (None: all); ``kernels`` filters CUTE_MLA's, and
    the torch condition has no KV dtype, mode or speculation to filter."""
    return [c for c in conds
            if (backends is None or c.backend in backends) and (kernels is None or not c.ours or c.kernel in kernels)
            and (c.backend == TORCH or ((kv_dtypes is None or c.kv_dtype in kv_dtypes)
                                        and (modes is None or c.mode in modes) and (specs is None or c.spec in specs)))]


@dataclasses.dataclass(frozen=True)
class Plan:
    conditions: tuple[Condition, ...]  # in the order they start and are reported
    lengths: tuple[int, ...]
    problems: int  # per task and length
    timeout_s: float  # per condition
    budget_s: float | None  # the whole run (None: no limit)


def sm90_kernels() -> tuple[str, ...]:
    """``auto`` and each of our kernels whose family is built for sm_90a (the registry's manifests)."""
    from mla_backend_plugin.ops.registry import KERNELS

    return tuple(k for k in OUR_KERNELS if k == "auto" or "sm_90a" in KERNELS[k].archs)


def device_plan() -> Plan:
    """One GPU call (~9 minutes on one H100; the GPU test in a call of its own): every backend and every kernel
    of ours that runs on SM90, with CUDA graphs, bf16 and fp8 caches (where the backend allows fp8); eager and
    n-gram speculation for CUTE_MLA auto and FLASHMLA (the peer that has both fp8 and q_len > 1). 22 conditions,
    ours first. Measured (nvidia-h100-x1, 2026-11-24, --jobs 8, warm kernel cache, cold Inductor cache): an
    engine condition takes 120-160 s under the contention of 8 engine starts, so three waves need ~8 minutes;
    the float32 reference runs while the first engines start. The 360 s budget of that run cut the last five
    conditions; the budget is now 500 s."""
    kv = ("auto", "fp8")
    ours_graphs = conditions(("CUTE_MLA",), sm90_kernels(), kv, ("graphs",), (0,))
    peers_graphs = conditions(PEER_BACKENDS, (), kv, ("graphs",), (0,))
    extra = [c for backend in ("CUTE_MLA", "FLASHMLA")
             for c in conditions((backend,), ("auto",), kv, ("eager",), (0,))
             + conditions((backend,), ("auto",), kv, ("graphs",), (NGRAM_TOKENS,))]
    return Plan((TORCH_CONDITION, *ours_graphs, *peers_graphs, *extra), (1024, 4096, 8192), 100, timeout_s=240,
                budget_s=500)


def full_plan() -> Plan:
    grid = conditions(BACKENDS, OUR_KERNELS, ("auto", "fp8"), ("eager", "graphs"), (0, NGRAM_TOKENS))
    return Plan((TORCH_CONDITION, *grid), (1024, 4096, 8192), 100, timeout_s=600, budget_s=None)


PLANS = {"full": full_plan, "device": device_plan}


def problem_sets(lengths, count: int) -> dict[tuple[str, int], list[tasks.Problem]]:
    return {(t, n): tasks.eval_problems(t, n, count) for t in tasks.TASKS for n in lengths}

