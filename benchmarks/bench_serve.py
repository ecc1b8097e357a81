"""Serving benchmark: ``vllm serve`` per MLA backend on loopback, driven by vLLM's own client ``vllm bench serve``.

    python benchmarks/bench_serve.py --dry-run                  # the servers, shapes and rates; commands; no GPU
    python benchmarks/bench_serve.py --smoke --out-dir DIR      # CUTE_MLA, one shape, 2 rates (~4 min on an H100)
    python benchmarks/bench_serve.py --out-dir DIR --budget-s 500 [--backends ...] [--shapes ...]   # rows append
    python benchmarks/bench_serve.py --report-only --out-dir DIR   # results.md / results.csv / plots from rows.csv

The model: bench_e2e.py's DeepSeek-V3-width config (128 heads, q_lora 1536, kv_lora 512, rope 64, hidden 7168) with
``--layers`` dense layers and dummy weights, and a word-level tokenizer over its vocabulary written next to it (every
id one whitespace-separated word, so vLLM's random prompts decode and re-encode to exactly their length; nothing is
downloaded). One server per configuration (backend x KV-cache dtype x n-gram speculative tokens, where vLLM's
backend class supports the dtype and query lengths above 1), CUDA graphs on, prefix caching off (the random prompts
repeat across rates with the same seed), on 127.0.0.1 at a free port. Each (shape, request rate) row is one
``vllm bench serve`` run: random dataset, fixed input/output lengths, ``--ignore-eos``, a fixed seed; a Poisson
arrival process at each ``--rates`` value, ``inf`` sending every prompt at once.

Per row: request throughput, output tokens/s, TTFT / TPOT / ITL median and p99 (vLLM's definitions: TPOT excludes
the first token; ITL is the gap between streamed chunks, so with speculation a chunk may carry several tokens).
Before its first row each server takes a warm-up burst (``--warmup-burst`` prompts of the first row's shape sent at
once, short outputs, not recorded): chunked prefill with context, decode steps of mixed query lengths and the
speculative sampler run once, so vLLM's first-use JIT compiles of its own Triton kernels (0.1-0.5 s stalls that
lengthen every request in flight) land before the measured rows; one that still lands inside a row's measured window
is named in the row (``jit_in_window``, from the server log's JIT-monitor warnings) and in the report.
Rows append to ``DIR/rows.csv`` as each finishes; a re-run skips the rows already there (same backend, KV dtype,
n-gram, layers, shape, rate, prompts and max_num_seqs) and starts no server whose rows are all done. ``--budget-s``
ends a call before a device limit cuts it: no row starts that its estimate says would not finish, the client is
stopped at the budget, and the server is always stopped (its process group, also on errors and SIGTERM). Exit
status: 0 every row ran, 1 some row or server failed (the report lists it; a re-run tries it again), 75 the budget
ended the call first (run the same command again).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from bench_e2e import INCOMPLETE, Budget, model_config, parse_backend  # siblings: benchmarks/ is the script directory
from report import _grid_shape, _pyplot

ROOT = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"  # loopback only: the servers bind here and the client talks to nothing else
DEFAULT_BACKENDS = ("CUTE_MLA", "FLASH_ATTN_MLA", "FLASHMLA")
KV_CACHE_DTYPES = ("auto", "fp8")
OFFLINE_ENV = {"VLLM_USE_FLASHINFER_SAMPLER": "0", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}
SPECIAL_TOKENS = ("<s>", "</s>", "<unk>")  # ids 0, 1, 2: the model config's bos (0) and eos (1)
LONGEST_WORD = 32  # characters of the last id's word: vLLM's characters-per-token bound (write_tokenizer)
NGRAM = {"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 8}  # bench_e2e.py's n-gram settings

# rows.csv columns: the key of a row first (what a re-run compares), then the metrics
KEY_FIELDS = ("backend", "kv_cache_dtype", "spec_tokens", "layers", "input_len", "output_len", "request_rate",
              "num_prompts", "max_num_seqs")
METRIC_FIELDS = ("completed", "failed", "duration_s", "request_throughput", "output_throughput",
                 "total_token_throughput", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "itl_p50_ms",
                 "itl_p99_ms", "e2el_p50_ms", "e2el_p99_ms", "max_concurrent_requests", "spec_acceptance_rate",
                 "spec_acceptance_length")
INFO_FIELDS = ("server_start_s", "gpu", "date", "jit_in_window", "error")
FIELDS = KEY_FIELDS + METRIC_FIELDS + INFO_FIELDS
# vllm bench serve's result JSON -> our column (the percentiles asked for with --metric-percentiles 50,99)
RESULT_KEYS = {"completed": "completed", "failed": "failed", "duration": "duration_s",
               "request_throughput": "request_throughput", "output_throughput": "output_throughput",
               "total_token_throughput": "total_token_throughput", "median_ttft_ms": "ttft_p50_ms",
               "p99_ttft_ms": "ttft_p99_ms", "median_tpot_ms": "tpot_p50_ms", "p99_tpot_ms": "tpot_p99_ms",
               "median_itl_ms": "itl_p50_ms", "p99_itl_ms": "itl_p99_ms", "median_e2el_ms": "e2el_p50_ms",
               "p99_e2el_ms": "e2el_p99_ms", "max_concurrent_requests": "max_concurrent_requests",
               "spec_decode_acceptance_rate": "spec_acceptance_rate",
               "spec_decode_acceptance_length": "spec_acceptance_length"}


# ---------------------------------------------------------------- the model directory: config + tokenizer

def write_tokenizer(model_dir: Path, vocab_size: int, model_max_length: int) -> None:
    """A word-level tokenizer over ``vocab_size`` ids: ``<s>``, ``</s>``, ``<unk>`` (ids 0-2, special), then one
    word ``t<id>`` per id, split on whitespace and joined with spaces, so any id sequence without special ids
    decodes and re-encodes to itself. Saved as tokenizer.json + tokenizer_config.json (transformers'
    AutoTokenizer and vLLM's get_tokenizer load it as a fast tokenizer).

    The last id's word is padded to ``LONGEST_WORD`` characters: before tokenising, vLLM's server refuses (400) a
    prompt of more characters than its input-token limit times the vocabulary's longest entry. With words of at
    most 6 characters a 2048-token prompt of 5-digit words (7 characters with its space) failed that bound at a
    2560-token model length: 47 of 128 random prompts were refused in the first GPU run."""
    from tokenizers import AddedToken, Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    if vocab_size <= len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size {vocab_size}: the tokenizer needs more than {len(SPECIAL_TOKENS)} ids")
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update((f"t{i}", i) for i in range(len(SPECIAL_TOKENS), vocab_size - 1))
    vocab[f"t{vocab_size - 1}".ljust(LONGEST_WORD, "x")] = vocab_size - 1
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = WhitespaceSplit()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    model_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(model_dir / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
              "unk_token": "<unk>", "model_max_length": model_max_length, "clean_up_tokenization_spaces": False,
              "add_bos_token": False, "add_eos_token": False}
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (model_dir / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}, indent=2) + "\n")


def write_model_dir(model_dir: Path, layers: int) -> Path:
    """bench_e2e.py's DeepSeek-V3-width config with ``layers`` layers, and the tokenizer over its vocabulary."""
    config = model_config(layers)
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer(model_dir, config["vocab_size"], config["max_position_embeddings"])
    return model_dir


# ---------------------------------------------------------------- what to run

def parse_shapes(text: str, rates: list[str]) -> dict[tuple[int, int], list[str]]:
    """``2048x256,8192x512@1/2/4/inf`` -> {(2048, 256): rates, (8192, 512): ['1', '2', '4', 'inf']}: input x output
    tokens, each with ``rates`` unless it names its own after ``@`` (``/``-separated)."""
    shapes = {}
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        dims, at, own = item.partition("@")
        a, sep, b = dims.partition("x")
        if not sep or not a.isdigit() or not b.isdigit() or int(a) < 1 or int(b) < 1:
            raise ValueError(f"--shapes {text!r}: {item!r} is not INPUTxOUTPUT[@RATE/RATE/...] (positive integers, "
                             "e.g. 2048x256 or 8192x512@1/2/4/inf)")
        shapes[(int(a), int(b))] = parse_rates(own.replace("/", ","), f"--shapes {item!r}") if at else rates
    if not shapes:
        raise ValueError("--shapes: no shape given")
    return shapes


def parse_rates(text: str, name: str = "--rates") -> list[str]:
    """``2,8,inf`` -> ['2', '8', 'inf']: request rates in requests/s as vllm bench serve takes them (``inf``: every
    prompt at once), ascending, ``inf`` last."""
    rates = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        try:
            value = float(item)
        except ValueError:
            raise ValueError(f"{name} {text!r}: {item!r} is neither a number of requests/s nor 'inf'") from None
        if not value > 0 or math.isnan(value):
            raise ValueError(f"{name} {text!r}: {item!r} must be > 0 (or 'inf')")
        rates.append("inf" if math.isinf(value) else f"{value:g}")
    if not rates:
        raise ValueError(f"{name}: no rate given")
    return sorted(set(rates), key=float)


def parse_list(text: str, name: str, allowed: tuple[str, ...] | None = None) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        raise ValueError(f"{name}: nothing given")
    for x in items:
        if allowed is not None and x not in allowed:
            raise ValueError(f"{name} {text!r}: {x!r} is not one of {', '.join(allowed)}")
    return items


def parse_spec(text: str) -> list[int]:
    out = []
    for x in parse_list(text, "--spec"):
        if not x.isdigit():
            raise ValueError(f"--spec {text!r}: {x!r} is not a number of n-gram speculative tokens (0, 1, ...)")
        out.append(int(x))
    return out


def backend_support(name: str) -> tuple[str, list[str] | None, str | None]:
    """(class name, ``supported_kv_cache_dtypes``, the name of its builder's ``query_len_support``) of a backend as
    vLLM names it (CUTE_MLA: this package's). Read from the class; where its module cannot be imported here (vLLM's
    FA3-MLA needs its CUDA extensions), from the same class attributes in the module's source."""
    if name == "CUTE_MLA":
        from mla_backend_plugin.vllm.backend import CuteMLABackend as cls
    else:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        try:
            member = AttentionBackendEnum[name]
        except KeyError:
            raise ValueError(f"--backends: {name!r} is not a vLLM attention backend") from None
        try:
            cls = member.get_class()
        except ImportError:
            return _support_from_source(member.get_path())
    support = getattr(cls.get_builder_cls(), "query_len_support", None)
    dtypes = getattr(cls, "supported_kv_cache_dtypes", None)
    return cls.__name__, None if dtypes is None else list(dtypes), getattr(support, "name", None)


def _support_from_source(qualname: str) -> tuple[str, list[str] | None, str | None]:
    """backend_support's attributes from the source of the module that defines ``qualname`` (module.Class),
    without importing it: the class's literal ``supported_kv_cache_dtypes``, and the ``QueryLenSupport.X`` of the
    builder class its ``get_builder_cls`` returns (both defined in that module)."""
    import ast
    import importlib.util

    module, _, class_name = qualname.rpartition(".")
    tree = ast.parse(Path(importlib.util.find_spec(module).origin).read_text())
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}

    def assigned(cls: ast.ClassDef | None, name: str) -> ast.expr | None:
        for stmt in cls.body if cls else ():
            target = stmt.target if isinstance(stmt, ast.AnnAssign) else (
                stmt.targets[0] if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 else None)
            if isinstance(target, ast.Name) and target.id == name and stmt.value is not None:
                return stmt.value
        return None

    backend = classes.get(class_name)
    dtypes = assigned(backend, "supported_kv_cache_dtypes")
    builder = None
    for stmt in backend.body if backend else ():
        if isinstance(stmt, ast.FunctionDef) and stmt.name == "get_builder_cls":
            returns = [n.value for n in ast.walk(stmt) if isinstance(n, ast.Return)]
            if returns and isinstance(returns[0], ast.Name):
                builder = classes.get(returns[0].id)
    support = assigned(builder, "query_len_support")
    return (class_name, None if dtypes is None else list(ast.literal_eval(dtypes)),
            support.attr if isinstance(support, ast.Attribute) else None)


def unsupported(backend: str, kv_cache_dtype: str, spec: int) -> str | None:
    """Why vLLM rules a server configuration out, or None: the KV-cache dtype must be in the backend class's
    ``supported_kv_cache_dtypes``, and speculation needs query lengths above 1 (its builder's
    ``query_len_support`` other than SINGLE_ONLY)."""
    class_name, dtypes, support = backend_support(parse_backend(backend)[0])
    if dtypes is not None and kv_cache_dtype not in dtypes:
        return f"KV cache {kv_cache_dtype} not in {class_name}.supported_kv_cache_dtypes {dtypes}"
    if spec and support == "SINGLE_ONLY":
        return f"{class_name}'s builder takes single-token queries only (query_len_support SINGLE_ONLY)"
    return None


def configurations(args) -> tuple[list[tuple[str, str, int]], list[str]]:
    """(backend, kv_cache_dtype, spec) per server, and a line per combination ruled out."""
    runs, skipped = [], []
    for kv in args.kv_cache_dtypes:
        for spec in args.spec:
            for backend in args.backends:
                why = unsupported(backend, kv, spec)
                if why:
                    skipped.append(f"{backend} kv={kv} n-gram={spec}: {why}")
                else:
                    runs.append((backend, kv, spec))
    return runs, skipped


def max_model_len(shapes) -> int:
    """The longest prompt plus its output, rounded up to 256 tokens, plus 256 (speculative lookahead slack)."""
    return -(-max(i + o for i, o in shapes) // 256) * 256 + 256


def server_command(args, backend: str, kv_cache_dtype: str, spec: int, port: int) -> tuple[list[str], dict]:
    """``vllm serve`` (through the interpreter running this script) and its environment for one configuration."""
    name, env = parse_backend(backend)
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(args.model_dir),
           "--load-format", "dummy", "--host", HOST, "--port", str(port), "--attention-backend", name,
           "--kv-cache-dtype", kv_cache_dtype, "--max-model-len", str(max_model_len(args.shapes)),
           "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_batched_tokens),
           "--gpu-memory-utilization", str(args.gpu_memory_utilization), "--seed", "0",
           "--no-enable-prefix-caching", "--disable-uvicorn-access-log"]
    if args.eager:
        cmd.append("--enforce-eager")
    if spec:
        cmd += ["--speculative-config", json.dumps({**NGRAM, "num_speculative_tokens": spec})]
    env = {**OFFLINE_ENV, **env}
    if args.step_trace:  # the plugin's step timeline, whichever backend serves (mla_backend_plugin/vllm/step_trace.py)
        env["CUTE_MLA_STEP_TRACE"] = str(steps_dir(args.out_dir, backend, kv_cache_dtype, spec, args.layers))
    return cmd, env


def steps_dir(out_dir: Path, backend: str, kv_cache_dtype: str, spec: int, layers: int) -> Path:
    """Where a configuration's server writes its step timeline (``--step-trace``)."""
    return out_dir / "steps" / _tag(backend, kv_cache_dtype, f"ngram{spec}", f"L{layers}")


def client_command(args, port: int, shape: tuple[int, int], rate: str, result_dir: Path,
                   result_name: str, num_prompts: int | None = None, num_warmups: int | None = None,
                   seed: int | None = None) -> list[str]:
    """``vllm bench serve`` for one row: random prompts of exactly ``shape`` tokens, JSON result saved (the
    row's ``--num-prompts``, ``--num-warmups`` and ``--seed`` unless given)."""
    input_len, output_len = shape
    num_prompts = args.num_prompts if num_prompts is None else num_prompts
    num_warmups = args.num_warmups if num_warmups is None else num_warmups
    seed = args.seed if seed is None else seed
    return [sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve", "--backend", "vllm",
            "--base-url", f"http://{HOST}:{port}", "--endpoint", "/v1/completions", "--model", str(args.model_dir),
            "--tokenizer", str(args.model_dir), "--dataset-name", "random", "--random-input-len", str(input_len),
            "--random-output-len", str(output_len), "--random-range-ratio", "0", "--ignore-eos",
            "--temperature", "0", "--seed", str(seed), "--num-prompts", str(num_prompts),
            "--request-rate", rate, "--num-warmups", str(num_warmups), "--percentile-metrics",
            "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99", "--disable-tqdm", "--save-result", "--result-dir",
            str(result_dir), "--result-filename", result_name]


WARMUP_BURST_OUTPUT = 32  # output tokens of each warm-up burst prompt: enough decode steps for drafts to mix
WARMUP_BURST_ESTIMATE_S = 30.0  # its wall time, for --budget-s


def warmup_burst_command(args, port: int, shape: tuple[int, int], result_dir: Path, name: str) -> list[str]:
    """The warm-up burst before a server's first row: ``--warmup-burst`` prompts of ``shape``'s input length at
    once (a seed no row uses), short outputs, no warm-up of its own."""
    return client_command(args, port, (shape[0], min(shape[1], WARMUP_BURST_OUTPUT)), "inf", result_dir, name,
                          num_prompts=args.warmup_burst, num_warmups=0, seed=args.seed + 1)


JIT_WARNING = re.compile(r"(\d\d)-(\d\d) (\d\d):(\d\d):(\d\d)\s+\[jit_monitor\.py:\d+\][^\n]*"
                         r"JIT compilation during inference: ([A-Za-z0-9_]+)")


def jit_compiles(log_text: str, start: float, end: float, year: int | None = None) -> list[str]:
    """Kernels vLLM's JIT monitor reports compiled during inference between wall times ``start`` and ``end``
    (epoch seconds; the log's local-time stamps have whole seconds and no year: the window is widened by one
    second each side)."""
    year = year or time.localtime(end).tm_year
    names = []
    for m in JIT_WARNING.finditer(log_text):
        month, day, hh, mm, ss = (int(g) for g in m.groups()[:5])
        t = time.mktime((year, month, day, hh, mm, ss, 0, 0, -1))
        if start - 1.0 <= t <= end + 1.0:
            names.append(m.group(6))
    return names


# ---------------------------------------------------------------- rows.csv: append, resume, skip

def row_key(row: dict) -> tuple[str, ...]:
    """A row's identity as text (a row read back from the CSV and a fresh one compare equal)."""
    return tuple(_text(row.get(k)) for k in KEY_FIELDS)


def _text(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def read_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def done_keys(rows: list[dict]) -> set[tuple[str, ...]]:
    """Keys of the rows measured without error (an errored row is run again)."""
    return {row_key(r) for r in rows if not r.get("error")}


def append_row(path: Path, row: dict) -> None:
    """One row, written and flushed at once (header first in a new file): a run cut off keeps every row it
    finished."""
    unknown = set(row) - set(FIELDS)
    if unknown:
        raise ValueError(f"row has fields rows.csv does not keep: {sorted(unknown)}")
    new = not path.exists() or path.stat().st_size == 0
    if not new:
        with open(path, newline="") as f:
            header = next(csv.reader(f), [])
        if tuple(header) != FIELDS:  # written before a column was added: rewritten once with today's columns
            old = read_rows(path)
            with open(path, "w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=FIELDS)
                writer.writeheader()
                writer.writerows({k: r.get(k) or "" for k in FIELDS} for r in old)
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        if new:
            writer.writeheader()
        writer.writerow({k: _text(row.get(k)) for k in FIELDS})
        f.flush()
        os.fsync(f.fileno())


def row_from_result(result: dict, key: dict) -> dict:
    """A rows.csv row from vllm bench serve's saved result JSON."""
    row = dict(key)
    for src, dst in RESULT_KEYS.items():
        value = result.get(src)
        if isinstance(value, float):
            value = round(value, 4)
        row[dst] = value
    if not row.get("completed"):
        errors = [e for e in result.get("errors") or [] if e]
        row["error"] = f"no request completed: {errors[0][:300] if errors else 'no error reported'}"
    return row


def pending_rows(args, config: tuple[str, str, int], done: set) -> list[tuple[tuple[int, int], str, dict]]:
    """(shape, rate, key) of a configuration's rows not yet in rows.csv, in run order."""
    backend, kv, spec = config
    out = []
    for shape, rates in args.shapes.items():
        for rate in rates:
            key = {"backend": backend, "kv_cache_dtype": kv, "spec_tokens": spec, "layers": args.layers,
                   "input_len": shape[0], "output_len": shape[1], "request_rate": rate,
                   "num_prompts": args.num_prompts, "max_num_seqs": args.max_num_seqs}
            if row_key(key) not in done:
                out.append((shape, rate, key))
    return out


def row_estimate_s(args, shape: tuple[int, int], rate: str) -> float:
    """A generous guess at one row's wall time: the arrivals (num_prompts / rate) plus ``--row-margin-s`` for
    the client's start, the prefills and the last request's decode."""
    arrivals = 0.0 if rate == "inf" else args.num_prompts / float(rate)
    return arrivals + args.row_margin_s


# ---------------------------------------------------------------- the server

def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the server's process (before exec): SIGTERM it when this script dies, even by SIGKILL (Linux)."""
    import ctypes

    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


class Server:
    """``vllm serve`` in its own process group, its output in ``log_path``; ``wait_healthy`` polls /health.
    ``stop`` (also on leaving the ``with`` block) terminates the whole group, then kills what is left."""

    GRACE_S = 30.0  # from SIGTERM to SIGKILL

    def __init__(self, cmd: list[str], env: dict, log_path: Path, port: int):
        self.cmd, self.env, self.log_path, self.port = cmd, env, log_path, port
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Server:
        with open(self.log_path, "w") as log:
            log.write(" ".join(self.cmd) + "\n")
            log.flush()
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, **self.env}, start_new_session=True,
                                         preexec_fn=_die_with_parent)
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def wait_healthy(self, timeout_s: float) -> float:
        """Seconds until GET /health answered 200; RuntimeError if the server exits or the timeout passes."""
        t0 = time.monotonic()
        url = f"http://{HOST}:{self.port}/health"
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}:\n{tail(self.log_path)}")
            try:
                with urllib.request.urlopen(url, timeout=5) as resp:
                    if resp.status == 200:
                        return time.monotonic() - t0
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(2)
        raise RuntimeError(f"vllm serve not healthy after {timeout_s:.0f} s (--server-timeout):\n"
                           f"{tail(self.log_path)}")

    def stop(self) -> None:
        """SIGTERM to the process group (vLLM shuts its engine down; SIGINT would be ignored by a server started
        under a shell's background job), SIGKILL to what is left after GRACE_S."""
        if self.proc is None:
            return
        pgid = self.proc.pid  # start_new_session: the group's id is the server's pid
        for sig, wait_s in ((signal.SIGTERM, self.GRACE_S), (signal.SIGKILL, 30.0)):
            if not _group_alive(self.proc, pgid):
                break
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, sig)
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline and _group_alive(self.proc, pgid):
                time.sleep(0.5)
        self.proc = None


def _group_alive(proc: subprocess.Popen, pgid: int) -> bool:
    """Whether any process of the group is left (the engine core processes too, not only the API server; the
    server itself is reaped here so that it does not linger as a zombie)."""
    proc.poll()
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


# ---------------------------------------------------------------- the run

def gpu_name() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""
    except (OSError, subprocess.TimeoutExpired):
        return ""


def run_client(cmd: list[str], env: dict, log_path: Path, timeout_s: float) -> int | None:
    """The client's exit status, or None if it was stopped at ``timeout_s``."""
    with open(log_path, "w") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env},
                                start_new_session=True, preexec_fn=_die_with_parent)
        try:
            return proc.wait(timeout=None if math.isinf(timeout_s) else max(1.0, timeout_s))
        except subprocess.TimeoutExpired:
            return None
        finally:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _tag(*parts) -> str:
    return "_".join(str(p) for p in parts).replace(":", "-").replace("/", "-").replace("=", "-").replace(".", "p")


def run(args) -> int:
    """Every configuration's pending rows; 0 when all ran, 1 when some failed, INCOMPLETE when the budget ended
    the call first."""
    rows_path = args.out_dir / "rows.csv"
    configs, skipped = configurations(args)
    for line in skipped:
        print(f"skip (unsupported): {line}", flush=True)
    budget = Budget(args.budget_s)
    logs = args.out_dir / "logs"
    results = args.out_dir / "results"
    logs.mkdir(exist_ok=True)
    results.mkdir(exist_ok=True)
    gpu = gpu_name()
    failures = 0
    for config in configs:
        todo = pending_rows(args, config, done_keys(read_rows(rows_path)))
        backend, kv, spec = config
        label = f"{backend} kv={kv} n-gram={spec}"
        if not todo:
            print(f"done already: {label}", flush=True)
            continue
        first = row_estimate_s(args, *todo[0][:2]) + (WARMUP_BURST_ESTIMATE_S if args.warmup_burst else 0.0)
        if budget.left() < args.start_estimate_s + first:
            print(f"budget: {budget.left():.0f} s left, not starting {label} (start ~{args.start_estimate_s:.0f} s "
                  f"+ warm-up burst and first row ~{first:.0f} s); re-run to resume", flush=True)
            return INCOMPLETE
        port = free_port()
        cmd, env = server_command(args, backend, kv, spec, port)
        tag = _tag(backend, kv, f"ngram{spec}", f"L{args.layers}")
        print(f"server: {label} on {HOST}:{port} ({len(todo)} rows to run)", flush=True)
        current = todo[0][2]  # the row an error of the server is recorded against
        try:
            with Server(cmd, env, logs / f"server_{tag}.log", port) as server:
                start_s = server.wait_healthy(min(args.server_timeout, max(1.0, budget.left())))
                print(f"  healthy after {start_s:.0f} s", flush=True)
                if args.warmup_burst:
                    t0 = time.monotonic()
                    name = f"{tag}_warmup_burst.json"
                    rc = run_client(warmup_burst_command(args, port, todo[0][0], logs, name), OFFLINE_ENV,
                                    logs / f"client_{tag}_warmup_burst.log", budget.left())
                    if rc is None:
                        print("budget: stopped the warm-up burst at the budget; re-run to resume", flush=True)
                        return INCOMPLETE
                    if rc != 0:
                        raise RuntimeError(f"the warm-up burst's client exited with {rc}:\n"
                                           f"{tail(logs / f'client_{tag}_warmup_burst.log', 600)}")
                    print(f"  warm-up burst: {args.warmup_burst} prompts in {time.monotonic() - t0:.0f} s", flush=True)
                for shape, rate, key in todo:
                    current = key
                    estimate = row_estimate_s(args, shape, rate)
                    if budget.left() < estimate:
                        print(f"budget: {budget.left():.0f} s left, row {shape[0]}x{shape[1]} rate {rate} needs "
                              f"~{estimate:.0f} s; re-run to resume", flush=True)
                        return INCOMPLETE
                    name = f"{tag}_{shape[0]}x{shape[1]}_r{_tag(rate)}_n{args.num_prompts}.json"
                    (results / name).unlink(missing_ok=True)
                    client = client_command(args, port, shape, rate, results, name)
                    t0 = time.monotonic()
                    rc = run_client(client, OFFLINE_ENV, logs / f"client_{name[:-5]}.log", budget.left())
                    meta = {"server_start_s": round(start_s, 1), "gpu": gpu,
                            "date": time.strftime("%Y-%m-%dT%H:%M:%S")}
                    if rc is None:
                        print(f"budget: stopped the client of {shape[0]}x{shape[1]} rate {rate} at the budget "
                              f"(row not kept); re-run to resume", flush=True)
                        return INCOMPLETE
                    if rc != 0 or not (results / name).exists():
                        row = {**key, **meta, "error": f"vllm bench serve exit {rc}: "
                               + tail(logs / f"client_{name[:-5]}.log", 300).replace("\n", " | ")}
                    else:
                        end = time.time()
                        row = {**row_from_result(json.loads((results / name).read_text()), key), **meta}
                        jit = jit_compiles(server.log_path.read_text(errors="replace"), row_window_start(row, end),
                                           end)
                        row["jit_in_window"] = " ".join(jit)
                        if args.step_trace:
                            record_window(args.out_dir, row, end=end)
                    append_row(rows_path, row)
                    failures += bool(row.get("error"))
                    current = None  # recorded
                    print(f"  row {shape[0]}x{shape[1]} rate {rate}: {time.monotonic() - t0:.0f} s, "
                          + (f"ERROR {row['error'][:200]}" if row.get("error") else
                             f"{row['output_throughput']} tok/s, TPOT p50 {row['tpot_p50_ms']} ms")
                          + (f"; JIT compile in its window: {row['jit_in_window']}" if row.get("jit_in_window")
                             else ""), flush=True)
                    if server.proc.poll() is not None:
                        raise RuntimeError(f"vllm serve exited with {server.proc.returncode}:\n"
                                           f"{tail(server.log_path)}")
        except RuntimeError as e:
            failures += 1
            print(f"  server ERROR: {str(e)[-1500:]}", flush=True)
            if current is not None:
                append_row(rows_path, {**current, "gpu": gpu, "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
                                       "error": str(e)[-300:].replace("\n", " | ")})
    return 1 if failures else 0


# ---------------------------------------------------------------- the report

def _num(value) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def latest_rows(rows: list[dict]) -> list[dict]:
    """The last error-free row per key (a row measured again replaces the earlier one)."""
    by_key: dict[tuple, dict] = {}
    for r in rows:
        if not r.get("error"):
            by_key[row_key(r)] = r
    return list(by_key.values())


def _label(r: dict) -> str:
    return r["backend"]


def _group_key(r: dict) -> tuple:
    return (int(r["input_len"]), int(r["output_len"]), r["kv_cache_dtype"], int(r["spec_tokens"]),
            int(r["layers"]))


def _group_title(key: tuple) -> str:
    i, o, kv, spec, layers = key
    return (f"{i} in / {o} out, KV cache {'fp8' if kv == 'fp8' else 'model dtype'}, n-gram {spec}, "
            f"{layers} layers")


def _rate_order(rate: str) -> float:
    return float(rate)


def _f(value, digits: int = 1) -> str:
    v = _num(value)
    return "-" if v is None else f"{v:.{digits}f}"


def best_peer(rows: list[dict], ours: dict, metric: str, lower_is_better: bool) -> dict | None:
    """The in-tree backend row of the same group and rate that is best at ``metric``."""
    peers = [r for r in rows if not r["backend"].startswith("CUTE_MLA") and _group_key(r) == _group_key(ours)
             and r["request_rate"] == ours["request_rate"] and r["num_prompts"] == ours["num_prompts"]
             and _num(r.get(metric)) is not None]
    if not peers:
        return None
    return (min if lower_is_better else max)(peers, key=lambda r: float(r[metric]))


def render_markdown(rows: list[dict], errors: list[dict]) -> str:
    lines = ["# Serving benchmark: `vllm bench serve` against `vllm serve` per MLA backend", "",
             "DeepSeek-V3-width model with dummy weights, random prompts of fixed lengths (`--ignore-eos`), "
             "Poisson arrivals at each request rate (`inf`: all prompts at once), CUDA graphs, prefix caching off. "
             "Latencies in ms (p50 = median); TPOT excludes the first token; ITL is the gap between streamed "
             "chunks.", ""]
    gpus = sorted({r.get("gpu") for r in rows if r.get("gpu")})
    if gpus:
        lines += [f"GPU: {', '.join(gpus)}.", ""]
    for key in sorted({_group_key(r) for r in rows}):
        group = sorted((r for r in rows if _group_key(r) == key),
                       key=lambda r: (not r["backend"].startswith("CUTE_MLA"), r["backend"],
                                      _rate_order(r["request_rate"])))
        spec = key[3] > 0
        lines += [f"## {_group_title(key)}", "",
                  "| backend | rate (req/s) | prompts | req/s | output tok/s | TTFT p50 | TTFT p99 | TPOT p50 | "
                  "TPOT p99 | ITL p50 | ITL p99 |" + (" drafts accepted % |" if spec else ""),
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if spec else "")]
        for r in group:
            lines.append(f"| {_label(r)} | {r['request_rate']} | {r['completed']}/{r['num_prompts']} | "
                         f"{_f(r['request_throughput'], 2)} | {_f(r['output_throughput'])} | {_f(r['ttft_p50_ms'])} | "
                         f"{_f(r['ttft_p99_ms'])} | {_f(r['tpot_p50_ms'], 2)} | {_f(r['tpot_p99_ms'], 2)} | "
                         f"{_f(r['itl_p50_ms'], 2)} | {_f(r['itl_p99_ms'], 2)} |"
                         + (f" {_f(r.get('spec_acceptance_rate'), 1)} |" if spec else ""))
        ours = [r for r in group if r["backend"].startswith("CUTE_MLA")]
        compared = [(r, best_peer(rows, r, "output_throughput", False), best_peer(rows, r, "tpot_p50_ms", True))
                    for r in ours]
        compared = [c for c in compared if c[1] is not None]
        if compared:
            lines += ["", "Against the best in-tree backend at the same rate (output tok/s: ours / best, > 1 is "
                      "better; TPOT p50: best / ours, > 1 is better):", "",
                      "| backend | rate | output tok/s | best in-tree | ratio | TPOT p50 | best in-tree | ratio |",
                      "|---|---:|---:|---|---:|---:|---|---:|"]
            for r, thr, tpot in compared:
                lines.append(f"| {_label(r)} | {r['request_rate']} | {_f(r['output_throughput'])} | "
                             f"{thr['backend']} {_f(thr['output_throughput'])} | "
                             f"{float(r['output_throughput']) / float(thr['output_throughput']):.3f} | "
                             f"{_f(r['tpot_p50_ms'], 2)} | {tpot['backend']} {_f(tpot['tpot_p50_ms'], 2)} | "
                             f"{float(tpot['tpot_p50_ms']) / float(r['tpot_p50_ms']):.3f} |")
        jit = [r for r in group if r.get("jit_in_window")]
        if jit:
            named = "; ".join(f"{_label(r)} rate {r['request_rate']}: {r['jit_in_window']}" for r in jit)
            lines += ["", "vLLM JIT-compiled its own kernels inside these rows' measured windows (first-use stalls "
                      "of up to ~0.5 s that every request in flight waits out; the log's stamps have whole seconds: "
                      f"one within a second of a window's edge counts): {named}."]
        lines.append("")
    if errors:
        lines += ["## Errors (rows not measured; a re-run tries them again)", ""]
        lines += [f"- {r['backend']} kv={r['kv_cache_dtype']} n-gram={r['spec_tokens']} "
                  f"{r['input_len']}x{r['output_len']} rate {r['request_rate']}: `{r['error'][-300:]}`"
                  for r in errors]
        lines.append("")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> bool:
    """TPOT p50 against output tokens/s, one line per backend (points in rate order), a panel per group."""
    keys = sorted({_group_key(r) for r in rows})
    if not keys:
        return False
    plt = _pyplot()
    nrows, ncols = _grid_shape(len(keys))
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.5 * ncols, 4.2 * nrows), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        group = [r for r in rows if _group_key(r) == key]
        for backend in sorted({r["backend"] for r in group}, key=lambda b: (not b.startswith("CUTE_MLA"), b)):
            pts = sorted((r for r in group if r["backend"] == backend), key=lambda r: _rate_order(r["request_rate"]))
            ax.plot([float(r["output_throughput"]) for r in pts], [float(r["tpot_p50_ms"]) for r in pts],
                    marker="o", label=backend, linestyle="-" if backend.startswith("CUTE_MLA") else "--")
            for r in pts:
                ax.annotate(r["request_rate"], (float(r["output_throughput"]), float(r["tpot_p50_ms"])),
                            fontsize=6, textcoords="offset points", xytext=(3, 3))
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel("TPOT p50 (ms)")
        ax.set_title(_group_title(key), fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(keys):]:
        ax.set_visible(False)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def render(out_dir: Path) -> list[Path]:
    """results.md, results.csv (the latest error-free row per key, sorted) and plots/tpot_vs_throughput.png
    from ``out_dir/rows.csv``."""
    all_rows = read_rows(out_dir / "rows.csv")
    if not all_rows:
        raise FileNotFoundError(f"{out_dir / 'rows.csv'}: no rows to report")
    rows = sorted(latest_rows(all_rows), key=lambda r: (_group_key(r), r["backend"], _rate_order(r["request_rate"])))
    measured = {(r["backend"], r["kv_cache_dtype"], r["spec_tokens"], r["input_len"], r["output_len"],
                 r["request_rate"]) for r in rows}
    errors = [r for r in all_rows if r.get("error") and (r["backend"], r["kv_cache_dtype"], r["spec_tokens"],
                                                          r["input_len"], r["output_len"], r["request_rate"])
              not in measured]
    md = out_dir / "results.md"
    md.write_text(render_markdown(rows, errors))
    out_csv = out_dir / "results.csv"
    with open(out_csv, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows({k: r.get(k, "") for k in FIELDS} for r in rows)
    written = [md, out_csv]
    steps_md = render_steps(out_dir, rows)
    if steps_md is not None:
        written.append(steps_md)
    png = out_dir / "plots" / "tpot_vs_throughput.png"
    if plot(rows, png):
        written.append(png)
    return written


# ---------------------------------------------------------------- --step-trace: where each row's GPU time went

def row_window_start(row: dict, end: float) -> float:
    """Where the measured part of a row began in wall seconds: the client's benchmark (its ``duration_s``, after
    the warm-up requests) ended at ``end``, when the client exited."""
    return end - float(row["duration_s"]) - WINDOW_SLACK_S


def record_window(out_dir: Path, row: dict, end: float) -> None:
    """The measured part of a row (``row_window_start`` .. ``end``) beside the server's step trace."""
    path = steps_dir(out_dir, row["backend"], row["kv_cache_dtype"], int(row["spec_tokens"]), int(row["layers"]))
    path.mkdir(parents=True, exist_ok=True)
    with open(path / "windows.jsonl", "a") as f:
        f.write(json.dumps({"key": list(row_key(row)), "start": row_window_start(row, end), "end": end}) + "\n")


WINDOW_SLACK_S = 0.2  # the client's clock starts just after the first request is sent


def row_steps(out_dir: Path, row: dict) -> dict | None:
    """``step_trace.summarise`` over a row's window (its latest), or None without a trace."""
    from mla_backend_plugin.vllm import step_trace

    path = steps_dir(out_dir, row["backend"], row["kv_cache_dtype"], int(row["spec_tokens"]), int(row["layers"]))
    windows = path / "windows.jsonl"
    if not windows.exists():
        return None
    key = list(row_key(row))
    mine = [w for w in map(json.loads, windows.read_text().splitlines()) if w["key"] == key]
    if not mine:
        return None
    steps = step_trace.read_steps(path)
    return step_trace.summarise(steps, mine[-1]["start"], mine[-1]["end"]) if steps else None


def render_steps(out_dir: Path, rows: list[dict]) -> Path | None:
    """steps.md: per row with a step trace, the window's GPU time by step kind and CUDA-graph mode."""
    lines = ["# Where each serving row's GPU time went (`--step-trace`)", "",
             "Per row, the model steps of the measured window by kind (`decode`: one query length for every "
             "request; `decode_mixed_q`: decodes of several query lengths; `mixed`: prefill chunks beside decodes; "
             "`prefill`) and the CUDA-graph mode vLLM ran them in. share: of the window's GPU time (sum of step "
             "periods, entry to next entry: idle gaps included); period / forward / host: medians in ms (forward: the "
             "GPU from the step's entry to the end of its model forward; host: wall time in `execute_model`); "
             "decodes: mean decode requests a step; by requests: the median period of the kind's steps that schedule "
             "that many requests (steps in brackets): compare servers at like batch sizes.", ""]
    found = False
    for key in sorted({_group_key(r) for r in rows}):
        group = sorted((r for r in rows if _group_key(r) == key),
                       key=lambda r: (_rate_order(r["request_rate"]), not r["backend"].startswith("CUTE_MLA"),
                                      r["backend"]))
        table = []
        for r in group:
            summary = row_steps(out_dir, r)
            if summary is None:
                continue
            for i, (kind, k) in enumerate(summary["kinds"].items()):
                head = (f"| {_label(r)} | {r['request_rate']} | {summary['steps']} | {summary['time_ms']:.0f} "
                        if i == 0 else "| | | | ")  # a row's first kind carries its totals
                table.append(head + f"| {kind} | {k['steps']} | {100 * (k['share'] or 0):.1f} | "
                             f"{_f(k['period_ms_p50'], 3)} | {_f(k['forward_ms_p50'], 3)} | "
                             f"{_f(k['host_ms_p50'], 3)} | {k['decodes_mean']:.1f} | "
                             + ", ".join(f"{b}: {_f(ms, 2)} ({n})" for b, (n, ms) in
                                         k["period_ms_p50_by_requests"].items()) + " |")
        if table:
            found = True
            lines += [f"## {_group_title(key)}", "",
                      "| backend | rate | steps | GPU ms | kind / graphs | steps | share % | period | forward | host | "
                      "decodes | period by requests |", "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---|",
                      *table, ""]
    if not found:
        return None
    path = out_dir / "steps.md"
    path.write_text("\n".join(lines))
    return path


# ---------------------------------------------------------------- command line

SMOKE = {"backends": "CUTE_MLA", "shapes": "2048x256", "rates": "4,inf", "spec": "0", "kv_cache_dtypes": "auto",
         "num_prompts": 32, "layers": 16}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", default=",".join(DEFAULT_BACKENDS),
                   help="comma-separated vLLM backend names (bench_e2e.py's NAME[:kernel][/VAR=VALUE] form)")
    p.add_argument("--kv-cache-dtypes", default="auto,fp8",
                   help="KV-cache dtypes, each run with the backends that support it (auto: the model dtype)")
    p.add_argument("--spec", default="0,1", help="n-gram speculative tokens per step (0: none), comma-separated")
    p.add_argument("--shapes", default="2048x256,8192x512@1/2/4/inf",
                   help="INPUTxOUTPUT token lengths, comma-separated; a shape may name its own rates after @ "
                        "(/-separated; the default's 8k shape saturates at lower rates)")
    p.add_argument("--rates", default="4,8,16,inf", help="request rates in requests/s, comma-separated, for the "
                   "shapes that name none; inf: all prompts at once")
    p.add_argument("--num-prompts", type=int, default=64,
                   help="requests per row (inf sends them all at once: 128 with --max-num-seqs 128 fills the batch)")
    p.add_argument("--num-warmups", type=int, default=8,
                   help="requests (the row's first prompt, sent at once) each client sends before its timed ones: "
                        "first-use costs (JIT compiles of shapes the start did not see) stay out of the rows")
    p.add_argument("--warmup-burst", type=int, default=32,
                   help="prompts sent at once (short outputs, not recorded) when a server is up, before its first "
                        "row: vLLM's first-use JIT compiles (chunked prefill with context, mixed query lengths) "
                        "land before the measured rows; 0: none")
    p.add_argument("--layers", type=int, default=16, help="model layers (DeepSeek-V3 has 61)")
    p.add_argument("--max-num-seqs", type=int, default=128, help="the server's --max-num-seqs")
    p.add_argument("--max-batched-tokens", type=int, default=8192, help="the server's --max-num-batched-tokens")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.8)
    p.add_argument("--eager", action="store_true", help="--enforce-eager (no CUDA graphs)")
    p.add_argument("--seed", type=int, default=0, help="the client's seed (the random prompts)")
    p.add_argument("--out-dir", type=Path, default=None,
                   help="rows.csv, logs/, results/ and the report (default benchmarks/results/serve_<date>)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="wall seconds this call may take: no server or row starts that would not fit, the client "
                        "is stopped at the end (keep it ~60 s under the device call's limit)")
    p.add_argument("--server-timeout", type=float, default=600, help="seconds to wait for the server's /health")
    p.add_argument("--start-estimate-s", type=float, default=150, help="a server start, for --budget-s")
    p.add_argument("--row-margin-s", type=float, default=45,
                   help="a row's time past its arrivals (num_prompts / rate), for --budget-s")
    p.add_argument("--smoke", action="store_true",
                   help="CUTE_MLA, 2048x256, rates 4 and inf, 32 prompts, 16 layers, bf16, no speculation "
                        "(explicit options still win)")
    p.add_argument("--step-trace", action="store_true",
                   help="the servers record every model step (CUTE_MLA_STEP_TRACE); the report adds steps.md: each "
                        "row's GPU time by step kind and CUDA-graph mode")
    p.add_argument("--dry-run", action="store_true", help="print the server and client commands; run nothing")
    p.add_argument("--report-only", action="store_true", help="render the report from DIR/rows.csv")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.smoke:  # the smoke settings, except where the command line set a value itself
        defaults = parser.parse_args([])
        for name, value in SMOKE.items():
            if getattr(args, name) == getattr(defaults, name):
                setattr(args, name, value)
    try:
        args.backends = parse_list(args.backends, "--backends")
        args.kv_cache_dtypes = parse_list(args.kv_cache_dtypes, "--kv-cache-dtypes", KV_CACHE_DTYPES)
        args.spec = parse_spec(args.spec)
        args.rates = parse_rates(args.rates)
        args.shapes = parse_shapes(args.shapes, args.rates)
        for name in ("num_prompts", "layers", "max_num_seqs", "max_batched_tokens"):
            if getattr(args, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
        for name in ("num_warmups", "warmup_burst"):
            if getattr(args, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 0")
        if not 0 < args.gpu_memory_utilization <= 1:
            raise ValueError(f"--gpu-memory-utilization {args.gpu_memory_utilization}: must be in (0, 1]")
    except ValueError as e:
        parser.error(str(e))
    args.out_dir = Path(args.out_dir or ROOT / "benchmarks" / "results" / f"serve_{time.strftime('%Y-%m-%d')}")
    args.model_dir = args.out_dir / f"model_L{args.layers}"
    return args


def _stop_on_sigterm(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")  # unwinds through Server.__exit__: the server is stopped


def main(argv=None) -> int:
    args = parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    if args.report_only:
        if not read_rows(args.out_dir / "rows.csv"):
            print(f"--report-only: {args.out_dir / 'rows.csv'} holds no rows", file=sys.stderr)
            return 2
        for path in render(args.out_dir):
            print(path)
        return 0
    write_model_dir(args.model_dir, args.layers)
    if args.dry_run:
        configs, skipped = configurations(args)
        for backend, kv, spec in configs:
            print("server: " + " ".join(server_command(args, backend, kv, spec, 8000)[0]))
        for line in skipped:
            print(f"skip (unsupported): {line}")
        for shape, rates in args.shapes.items():
            for rate in rates:
                print("client: " + " ".join(client_command(args, 8000, shape, rate, args.out_dir / "results",
                                                           "ROW.json")))
        if args.warmup_burst:
            first = next(iter(args.shapes))
            print("warm-up burst: " + " ".join(warmup_burst_command(args, 8000, first, args.out_dir / "logs",
                                                                    "BURST.json")))
        rows = len(configs) * sum(len(rates) for rates in args.shapes.values())
        print(f"model: {args.model_dir} ({args.layers} layers); servers: {len(configs)}; rows: {rows}")
        return 0
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    try:
        rc = run(args)
    except KeyboardInterrupt as e:
        print(f"interrupted ({e}): the server was stopped; re-run to resume", flush=True)
        rc = 130
    if read_rows(args.out_dir / "rows.csv"):
        for path in render(args.out_dir):
            print(path)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
