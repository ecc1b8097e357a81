"""Every environment variable the package reads, declared once, parsed one way.

A variable is read when it is asked for (``envs.CUTE_MLA_PDL`` or ``envs.get("CUTE_MLA_PDL")``), not at
import, so a test or a launcher may set it late. A value outside the allowed ones raises ``ValueError``
naming the variable and what it allows. Explicit arguments (``mla_decode(..., enable_pdl=...)``, a
``LaunchConfig``) always win over the environment; the environment only supplies defaults.

docs/environment.md's table of variables is ``python -m mla_backend_plugin.envs``; a CPU test checks they agree.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

_TRUE = ("1", "true", "on", "yes")
_FALSE = ("0", "false", "off", "no")


def parse_bool(name: str, value: str) -> bool:
    v = value.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ValueError(f"{name}={value!r}: allowed values are {', '.join(_TRUE + _FALSE)}")


@dataclasses.dataclass(frozen=True)
class EnvVar:
    name: str
    default: Any  # returned when the variable is unset or empty
    doc: str
    kind: str = "str"  # "bool" | "choice" | "str" | "path" | "float" | "int" | "list"
    choices: tuple[str, ...] = ()
    # lower-cases and checks a "choice"; None keeps the raw (stripped) string
    parse: Callable[[str, str], Any] | None = None

    def read(self) -> Any:
        raw = os.environ.get(self.name)
        if raw is None or not raw.strip():
            return self.default
        if self.kind == "bool":
            return parse_bool(self.name, raw)
        if self.kind == "choice":
            v = raw.strip().lower()
            if v not in self.choices:
                raise ValueError(f"{self.name}={raw!r}: allowed values are {', '.join(self.choices)}")
            return v
        if self.parse is not None:
            return self.parse(self.name, raw)
        return raw.strip()

    @property
    def allowed(self) -> str:
        if self.kind == "bool":
            return "0 / 1 (also false/true, off/on, no/yes)"
        if self.kind == "choice":
            return " / ".join(self.choices)
        if self.kind == "path":
            return "a path"
        if self.kind == "float":
            return "a number >= 0"
        if self.kind == "int":
            return "an integer >= 1"
        if self.kind == "list":
            return "comma-separated list"
        return "see description"


def _cache_dir(name: str, raw: str) -> str | None:
    """``0``/``off`` -> None (no cache), ``1``/``on`` -> the default directory, else that directory."""
    v = raw.strip()
    if v.lower() in _FALSE + ("none",):
        return None
    if v.lower() in _TRUE:
        return ""  # the family's default directory
    return os.path.abspath(os.path.expanduser(v))


def _number(cast: Callable[[str], Any], minimum, allowed: str) -> Callable[[str, str], Any]:
    """A parser of one number of type ``cast``, at least ``minimum``; ``allowed`` says what it takes."""

    def parse(name: str, raw: str):
        try:
            value = cast(raw.strip())
        except ValueError:
            raise ValueError(f"{name}={raw!r}: allowed values are {allowed}") from None
        if value < minimum:
            raise ValueError(f"{name}={raw!r}: allowed values are {allowed}")
        return value

    return parse


_float = _number(float, 0, "numbers of seconds >= 0, e.g. 120")
_positive_int = _number(int, 1, "integers >= 1")


def _directory(name: str, raw: str) -> str:
    return os.path.abspath(os.path.expanduser(raw.strip()))


def _int_list(name: str, raw: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in raw.replace(" ", "").split(",") if x)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: allowed values are comma-separated positive integers") from None
    if not values or min(values) < 1:
        raise ValueError(f"{name}={raw!r}: allowed values are comma-separated positive integers")
    return values


def _name_list(name: str, raw: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in raw.split(",") if x.strip())


VARIABLES: dict[str, EnvVar] = {v.name: v for v in (
    EnvVar("CUTE_MLA_KERNEL", "auto",
           "Decode kernel for `kernel=\"auto\"` calls and the vLLM/SGLang backends: `auto`, or a kernel name "
           "(`cute_sm90`, `cute_sm100`, `triton`, `xqa_sm120`, `reference`). An explicit "
           "`mla_decode(kernel=...)` wins."),
    EnvVar("CUTE_MLA_PDL", True,
           "Programmatic dependent launch (SM90+): `0` launches every kernel without it. Default of "
           "`mla_decode(enable_pdl=None)`.", kind="bool"),
    EnvVar("CUTE_MLA_FP8_DESIGN", "auto",
           "cute_sm90 with an fp8 KV cache: `fp8mma` (fp8 wgmma; a 16-bit q as e4m3 hi + lo, an fp8 q as it "
           "is), `dequant` (widen the cache to 16 bits; more accurate, and with a 16-bit q faster at batch 1-2 "
           "where each CTA has few tiles), `fp8seesaw` (design C, fp8 wgmma on the seesaw schedule, for an fp8 q; "
           "a 16-bit q runs `fp8mma` under it) or `auto` (an fp8 q: `fp8seesaw` from batch 6, `fp8mma` below; "
           "a 16-bit q: `dequant` up to batch 2, `fp8mma` above). Default of `mla_decode(fp8_design=None)`.",
           kind="choice", choices=("auto", "fp8mma", "dequant", "fp8seesaw")),
    EnvVar("CUTE_MLA_SM90_SCHEDULE", "seesaw",
           "cute_sm90 with a 16-bit KV cache, the schedule of its default config (`LaunchConfig.schedule`): "
           "`seesaw` (the two consumer warp groups work on alternate tiles, one's softmax under the other's wgmma; "
           "the producer prefetches the next tile pair into L2) or `lockstep` (both on every tile; the v3 kernel, "
           "the code fp8 design A runs: 4-33% slower than the seesaw on the H200 grid, docs/perf/cute_sm90_bf16.md).",
           kind="choice", choices=("seesaw", "lockstep")),
    EnvVar("CUTE_MLA_SM90_KV_MULTICAST", "auto",
           "cute_sm90 with a 16-bit KV cache, the default of `LaunchConfig.kv_multicast`: where a request's m-block "
           "CTAs pair up (128 heads; 64 at q_len 2 and 4; 32 at q_len 3-4) and the split grid does not fit on the "
           "GPU at once, run them as 2-CTA clusters that share each KV tile by TMA multicast. `auto`: at 64-token "
           "pages from batch 32 (0.90-0.97x the time at B >= 64, S >= 4k on the H200; slower at 16-token pages), "
           "`1`: wherever it can run, `0`: never.", kind="choice", choices=("auto", "1", "0")),
    EnvVar("CUTE_MLA_SM90_PLAN", "auto",
           "cute_sm90's split plan, decided per step on the device: `balanced` (a long request split into equal "
           "chunks, at most 32 of them unless that leaves it the step's critical path, then up to the "
           "workspace's split capacity, 64 in the serving backends), `shares` (requests split where the "
           "boundaries of equal shares of the step's KV tiles cross them; more, shorter pieces), or `auto` "
           "(`shares` when the balanced plan's work items would leave a wave of SMs half idle, e.g. one long "
           "request among many short ones; else `balanced`). Work items run longest first in every plan.",
           kind="choice", choices=("auto", "balanced", "shares")),
    EnvVar("CUTE_MLA_FUSED_COMBINE", True,
           "cute_sm90, the default of `LaunchConfig.fused_combine`: when a split-KV grid fits on the GPU at once "
           "(small batches), merge the splits inside the split kernel (one launch) instead of a second combine "
           "kernel; `0` always launches the combine kernel.", kind="bool"),
    EnvVar("CUTE_MLA_LAST_CTA_COMBINE", "eager",
           "cute_sm90, split-KV grids too large to fit on the GPU at once: each request's last CTA to finish "
           "merges its partials inside the split kernel (nobody waits), so the call is one launch. `eager`: in "
           "calls outside CUDA-graph capture (a mixed step's eager attention: the combine kernel's launch is "
           "host time), the combine kernel in graphs; `always`; `never`: the combine kernel. The default of "
           "`LaunchConfig.last_cta_combine`; off under `CUTE_MLA_FUSED_COMBINE=0`.", kind="choice",
           choices=("eager", "always", "never")),
    EnvVar("CUTE_MLA_PREPARED_COMBINE", True,
           "Launch a repeated split-KV combine (same shapes, strides, alignment and constants as an earlier launch) "
           "straight through the compiled Triton kernel's launcher, skipping Triton's per-launch Python (Triton "
           "3.4-3.6; other versions take the ordinary launch); `0` always launches through Triton.", kind="bool"),
    EnvVar("CUTE_MLA_TRITON_SPLITS", "balanced",
           "Split-KV plan of the Triton kernel: `balanced` (long requests get more splits; the default) or "
           "`uniform` (for comparisons).", kind="choice", choices=("balanced", "uniform")),
    EnvVar("CUTE_MLA_FP8_QUERY", "auto",
           "vLLM with an fp8 KV cache: `1` lets vLLM quantise q to fp8 (as for FlashMLA; the kernels take it "
           "as it is), `0` keeps q in the model dtype (cute_sm90 then splits it into two e4m3 parts: more "
           "accurate logits, ~1.3x slower at large batch), `auto` = `1` on Hopper (SM90), where that was "
           "measured, else `0`.", kind="choice", choices=("auto", "1", "0")),
    EnvVar("CUTE_MLA_DECODE_MAX_QUERY_LEN", 128,
           "vLLM: requests of up to this many new tokens that already have KV context (the uncached tail of a "
           "prefix-cache hit, a short chunk, drafts of mixed counts) run on the decode path, as token requests "
           "(64 / heads consecutive query tokens each, every row over the keys its token sees), instead of vLLM's "
           "prefill path (which up-projects the whole context). At least 1 + the speculative tokens; under "
           "decode context parallelism that is all.",
           kind="int", parse=_positive_int),
    EnvVar("CUTE_MLA_SELF_CHECK", "auto",
           "First-use self-check against the float32 reference: `auto` (only on GPUs where a kernel was never "
           "verified), `always`, `never`.", kind="choice", choices=("auto", "always", "never")),
    EnvVar("CUTE_MLA_CUTE_CACHE", "",
           "On-disk cache of compiled CuTe-DSL kernels (TVM-FFI libraries): unset/`1` = "
           "`~/.cache/mla_backend_plugin/cute`, `0` = off, else that directory (e.g. one made by "
           "`python -m mla_backend_plugin.compile --export-dir DIR`).", kind="path", parse=_cache_dir),
    EnvVar("CUTE_MLA_PACKAGED_KERNELS", True,
           "Load CuTe-DSL variants shipped prebuilt inside the package (`mla_backend_plugin/kernels/prebuilt/`, "
           "filled by `python -m mla_backend_plugin.compile --into-package` before a wheel is built) when "
           "`CUTE_MLA_CUTE_CACHE` lacks them: an engine's first start then compiles nothing. `0` ignores them.",
           kind="bool"),
    EnvVar("CUTE_MLA_DECODE_WARMUP", True,
           "vLLM and SGLang: at the engine's warm-up (its first metadata build outside CUDA-graph capture), one eager "
           "decode of every batch size and q_len its eager steps can bring, on stand-in inputs, so that what they "
           "launch (the split plans, the Triton combine's specialisations) is ready before the first request; `0` "
           "leaves that to the first calls (ops/serving.py `warm_up_decode`).", kind="bool"),
    EnvVar("CUTE_MLA_PREBUILD", False,
           "vLLM: `1` starts compiling the CuTe-DSL variants the engine's decode will launch in background "
           "processes at model construction (into `CUTE_MLA_CUTE_CACHE`) instead of on their first call. Off by "
           "default: on an H100 host it hid the ~9-12 s compile but did not shorten a cold start (the build "
           "competes with torch.compile; docs/perf/e2e_and_host.md).", kind="bool"),
    EnvVar("CUTE_MLA_XQA_CACHE", "",
           "Directory of the xqa_sm120 cubins built by nvcc (default `~/.cache/mla_backend_plugin/xqa`).",
           kind="path"),
    EnvVar("CUTE_MLA_XQA_SRC", "",
           "Directory of the xqa_sm120 CUDA sources (default: the copy in the wheel, or the repository's "
           "`csrc/xqa_mla`).", kind="path"),
    EnvVar("CUTE_MLA_NVCC", "",
           "nvcc to build xqa_sm120 with (default: `$CUDA_HOME/bin/nvcc`, `nvcc` on PATH, "
           "`/usr/local/cuda/bin/nvcc`).", kind="path"),
    EnvVar("CUTE_MLA_AUTOTUNE", False,
           "vLLM: time the decode candidates of the deployment's shapes (CUDA-graph batch sizes x context "
           "profile) during warm-up, before graph capture, within `CUTE_MLA_AUTOTUNE_BUDGET_S`, and keep the "
           "results in the tuning cache. `0`: use what the cache holds, else the static arch table.", kind="bool"),
    EnvVar("CUTE_MLA_AUTOTUNE_BUDGET_S", 120.0,
           "Seconds the warm-up tuning may spend (shapes not reached keep the cache's or the static choice).",
           kind="float", parse=_float),
    EnvVar("CUTE_MLA_TUNE_SEQ_LENS", (),
           "The deployment's context profile: comma-separated KV lengths the CUDA-graph choice is tuned for "
           "(rounded up to powers of two), e.g. `2048,8192`. Default: the engine's max_model_len.",
           kind="list", parse=_int_list),
    EnvVar("CUTE_MLA_CANDIDATES", (),
           "Kernels the tuner times: unset = the arch's default set (`AUTO_ORDER`, plus FlashInfer's trtllm-gen "
           "on SM100 when its cubins are installed, FlashInfer's XQA on SM120/121); a list (`cute_sm90,triton`) "
           "replaces it, `+name` entries add to it (e.g. `+xqa_sm120`).", kind="list", parse=_name_list),
    EnvVar("CUTE_MLA_TUNE_CACHE", "",
           "The tuning cache (JSON): unset/`1` = `~/.cache/mla_backend_plugin/autotune.json`, `0` = none (tuning "
           "results live only in the process), else that file.", kind="path", parse=_cache_dir),
    EnvVar("CUTE_MLA_CHECK_DIR", "",
           "Debugging and end-to-end tests: a directory. Every decode call an engine (vLLM, SGLang) makes outside "
           "CUDA-graph capture is recomputed with the float32 reference and its errors appended as one JSON line "
           "to `DIR/<pid>.jsonl` (slow; engines' worker processes inherit it).", kind="path"),
    EnvVar("CUTE_MLA_STEP_TRACE", "",
           "Diagnostics (vLLM, any attention backend): a directory. Every model step of the engine appends one JSON "
           "line to `DIR/steps-<pid>.jsonl`: its requests, prefills, decode query lengths, CUDA-graph mode, host "
           "time and GPU times from CUDA events (`benchmarks/bench_serve.py --step-trace` summarises them).",
           kind="path"),
    EnvVar("FLASHINFER_CUBIN_DIR", "",
           "FlashInfer's own variable, read (never set) here: a directory of trtllm-gen cubins. FlashInfer's "
           "trtllm-gen MLA kernel is a tuner candidate only when its cubins are local (this directory, or the "
           "`flashinfer-cubin` package); otherwise it would download them.", kind="path"),
    EnvVar("CUTE_MLA_EVAL_MODEL_DIR", "",
           "The model-level eval (`python -m mla_backend_plugin.evals`): the directory of its model (config.json + "
           "model.safetensors). Default: the package's `evals/model/`, which only a source or editable install "
           "holds (the serving wheel ships no eval weights).", kind="path", parse=_directory),
    EnvVar("MLA_TEST_KERNELS", "",
           "Tests only: comma-separated kernel names the per-kernel GPU tests run (default: every kernel "
           "that can run here)."),
)}


def raw_values() -> tuple:
    """Every declared variable's raw value: a cheap key for what was decided under this environment (mla_decode
    keys its per-workspace decisions by it, once per call). ``os.environ.get`` encodes each name on every call
    (~1.5 us a name on the H100 hosts, 28 us for all); CPython's mapping behind ``os.environ`` is read with the
    names encoded once instead. It is the mapping that ``os.environ[...] = ...`` and ``monkeypatch.setenv`` update."""
    data = getattr(os.environ, "_data", None)
    if data is None:  # not CPython's os._Environ
        return tuple(os.environ.get(name) for name in VARIABLES)
    return tuple(map(data.get, _ENCODED_NAMES))


_ENCODED_NAMES = tuple(os.environ.encodekey(name) for name in VARIABLES) if hasattr(os.environ, "encodekey") else ()


def get(name: str) -> Any:
    """The parsed value of a declared variable (its default when unset or empty)."""
    try:
        var = VARIABLES[name]
    except KeyError:
        raise KeyError(f"{name} is not a declared variable; declared: {', '.join(VARIABLES)}") from None
    return var.read()


def __getattr__(name: str) -> Any:
    if name in VARIABLES:
        return VARIABLES[name].read()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def markdown_table() -> str:
    lines = ["| variable | default | allowed | what it does |", "|---|---|---|---|"]
    for v in VARIABLES.values():
        default = {True: "1", False: "0"}.get(v.default, v.default) if isinstance(v.default, bool) else v.default
        default = "" if default == () else default
        lines.append(f"| `{v.name}` | {f'`{default}`' if default != '' else '(unset)'} | {v.allowed} | {v.doc} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown_table())
