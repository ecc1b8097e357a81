"""Metrics, floors and report files of the MLA decode benchmark (``bench_decode.py``).

Torch-free on purpose: the report can be rendered again from ``results.json`` on any machine with matplotlib
(the offline GPU hosts have none), and the self-test runs on a CPU box:

    python benchmarks/report.py --selftest          # fake results -> CSV/JSON/markdown/PNG in a temp dir
    python benchmarks/report.py --render DIR        # results.md + plots/ from DIR/results.json
    python benchmarks/report.py --merge OUT DIR...  # one report from several runs (e.g. a grid run in parts)

A result row is a flat dict with the keys of ``COLUMNS``: one row per (cell, kernel), where a cell is
(batch, seq_len, q_len, kv_dtype, num_heads, block_size).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import re
import sys
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

KV_LORA_RANK = 512  # latent width: the "nope" part of q/k and all of v
QK_HEAD_DIM = 576  # latent + rope: one KV-cache entry per token
BLOCK_TABLE_ENTRY_BYTES = 4  # int32 page ids
OUT_ELEM_BYTES = 2  # every kernel writes a bf16 output
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp8": 1}

# Row statuses: only "ok" rows carry timings.
OK, WRONG, NOT_APPLICABLE, ERROR, SKIPPED = "ok", "wrong", "n/a", "error", "skipped"

# Kinds of kernel: ours are compared against the best peer of the same cell.
OURS, PEER = "ours", "peer"

COLUMNS = (
    "kernel", "kind", "batch", "seq_len", "q_len", "kv_dtype", "q_dtype", "mma_dtype", "num_heads", "block_size",
    "status", "time_us", "time_us_p10", "time_us_p90", "tflops", "gbps", "floor_us", "frac_of_floor",
    "floor_bf16_us", "speedup_vs_best_peer", "best_peer", "max_abs_err", "lse_max_abs_err", "kv_copies",
    "calls_per_graph", "replays", "note",
)
CELL_KEYS = ("batch", "seq_len", "q_len", "kv_dtype", "num_heads", "block_size")

COLUMN_HELP = {
    "kernel": "kernel name: ours (registered in mla_backend_plugin.ops.registry) or a peer (benchmarks/peers.py)",
    "kind": "'ours' or 'peer'",
    "batch": "requests in the decode batch (B)",
    "seq_len": "KV length of every request, including this step's q_len new tokens (S)",
    "q_len": "query tokens per request (1 = plain decode, 2 = one speculative token)",
    "kv_dtype": "KV-cache dtype (fp8 = float8_e4m3fn with a per-tensor scale)",
    "q_dtype": "query dtype this kernel was given (vLLM quantises q to fp8 for backends that take it)",
    "mma_dtype": "operand dtype of the kernel's tensor-core products: one dtype for both, or QK/PV when they "
                 "differ (bf16 = an fp8 cache widened before its MMAs; see MMA_DTYPE_HELP)",
    "status": "ok | wrong (output differs from the float32 reference: not timed) | n/a (unsupported, see note) "
              "| error (raised, see note) | skipped (does not fit in GPU memory)",
    "time_us": "median time of one decode call in microseconds (CUDA-graph replays, KV rotated past L2)",
    "time_us_p10": "10th percentile of the per-replay times",
    "time_us_p90": "90th percentile of the per-replay times",
    "tflops": "useful TFLOP/s: 2 * H * (576 + 512) per visible (query row, key) pair",
    "gbps": "GB/s over the minimal bytes: KV read + q read + out written + block table read",
    "floor_us": "roofline floor of the kernel's MMA dtype: max(bytes / measured HBM bandwidth, Q K^T flops / "
                "measured peak of its dtype + P V flops / peak of its dtype); fp8 MMAs use the measured fp8 "
                "matmul peak, bf16 / fp16 the bf16 one; empty for an fp8 MMA when no fp8 peak was measured",
    "frac_of_floor": "floor_us / time_us (1.0 = at the roofline of the measured copy bandwidth / the matmul peak "
                     "of the kernel's MMA dtype)",
    "floor_bf16_us": "max(bytes / measured HBM bandwidth, flops / measured bf16 matmul peak): the floor of a "
                     "kernel whose MMAs run in bf16 (floor_us of every bf16 kernel; the floor printed before fp8 "
                     "MMA floors existed)",
    "speedup_vs_best_peer": "ours only: time of the fastest correct peer in the cell / our time (>1 = we win)",
    "best_peer": "ours only: the fastest correct peer in the cell",
    "max_abs_err": "max |out - reference| over the whole output (float32 reference, same inputs)",
    "lse_max_abs_err": "max |lse - reference| (natural log), when the kernel returns an LSE",
    "kv_copies": "KV-cache copies rotated through so that L2 cannot serve the KV reads",
    "calls_per_graph": "decode calls captured in one CUDA graph (cycling through the copies)",
    "replays": "timed graph replays",
    "note": "why a kernel is n/a / wrong / errored / skipped, or a remark on a timed row",
}


# ----------------------------------------------------------------------------------------------------------
# Work and floors
# ----------------------------------------------------------------------------------------------------------

def visible_keys_per_request(seq_len: int, q_len: int) -> int:
    """Keys summed over one request's query rows: row t sees seq_len - q_len + t + 1 keys (causal q block)."""
    return q_len * seq_len - q_len * (q_len - 1) // 2


def decode_flops(batch: int, seq_len: int, q_len: int, num_heads: int) -> int:
    """Useful flops: q.k over 576 dims plus p.v over 512 dims, 2 flops per multiply-add, per visible key."""
    return 2 * batch * num_heads * visible_keys_per_request(seq_len, q_len) * (QK_HEAD_DIM + KV_LORA_RANK)


def decode_bytes(batch: int, seq_len: int, q_len: int, num_heads: int, block_size: int,
                 kv_dtype: str, q_dtype: str) -> int:
    """Minimal HBM traffic of one decode call: every KV entry, q, out and the used block-table entries once."""
    tokens = batch * q_len
    kv = batch * seq_len * QK_HEAD_DIM * DTYPE_BYTES[kv_dtype]
    q = tokens * num_heads * QK_HEAD_DIM * DTYPE_BYTES[q_dtype]
    out = tokens * num_heads * KV_LORA_RANK * OUT_ELEM_BYTES
    block_table = batch * math.ceil(seq_len / block_size) * BLOCK_TABLE_ENTRY_BYTES
    return kv + q + out + block_table


# Tensor-core operand dtypes a row's ``mma_dtype`` may name (per product: "fp8" or "QK/PV", e.g. "fp8/bf16").
MMA_DTYPES = ("bf16", "fp16", "fp8")
MMA_UNKNOWN = "?"  # a runner that picks its kernel per cell (bench_decode's tuned `auto`): no floor of its own
MMA_DTYPE_HELP = ("`mma_dtype` = operand dtype of Q K^T and P V on the tensor cores (QK/PV when they differ); an "
                  "fp8 cache widened to 16 bits before its MMAs counts as bf16/fp16. A kernel that splits a 16-bit "
                  "q into e4m3 hi + lo runs Q K^T twice in fp8; its floor still counts the useful flops once")


def mma_dtype_pair(mma_dtype: str) -> tuple[str, str]:
    """("QK dtype", "PV dtype") of an ``mma_dtype`` ("fp8" or "fp8/bf16"); ValueError names the allowed values."""
    qk, _, pv = mma_dtype.partition("/")
    pair = (qk, pv or qk)
    for d in pair:
        if d not in MMA_DTYPES:
            raise ValueError(f"mma_dtype {mma_dtype!r}: each product's dtype must be one of {', '.join(MMA_DTYPES)}")
    return pair


def mma_time_s(batch: int, seq_len: int, q_len: int, num_heads: int, mma_dtype: str,
               peaks: dict[str, float | None]) -> float | None:
    """Tensor-core time of the useful flops: Q K^T (576 dims) at its dtype's peak plus P V (512) at its own; None
    when a dtype it needs has no measured peak."""
    keys = num_heads * visible_keys_per_request(seq_len, q_len) * batch
    total = 0.0
    for dtype, dims in zip(mma_dtype_pair(mma_dtype), (QK_HEAD_DIM, KV_LORA_RANK)):
        peak = peaks.get(dtype)
        if not peak:
            return None
        total += 2 * keys * dims / peak
    return total


def fill_metrics(row: dict, hbm_bytes_per_s: float, peak_flops_per_s: float,
                 fp8_peak_flops_per_s: float | None = None) -> dict:
    """Add floor_us (the floor of the row's MMA dtype; a row without one counts as bf16) and floor_bf16_us to a
    row, and tflops / gbps / frac_of_floor when it has a time. ``peak_flops_per_s`` is the measured bf16 matmul
    peak (fp16 MMAs run at the same rate on the GPUs measured), ``fp8_peak_flops_per_s`` the fp8 one."""
    flops = decode_flops(row["batch"], row["seq_len"], row["q_len"], row["num_heads"])
    nbytes = decode_bytes(row["batch"], row["seq_len"], row["q_len"], row["num_heads"], row["block_size"],
                          row["kv_dtype"], row["q_dtype"])
    mma_dtype = row.get("mma_dtype") or "bf16"
    peaks = {"bf16": peak_flops_per_s, "fp16": peak_flops_per_s, "fp8": fp8_peak_flops_per_s}
    memory_s = nbytes / hbm_bytes_per_s
    row["floor_bf16_us"] = max(memory_s, flops / peak_flops_per_s) * 1e6
    mma_s = (None if mma_dtype == MMA_UNKNOWN else
             mma_time_s(row["batch"], row["seq_len"], row["q_len"], row["num_heads"], mma_dtype, peaks))
    row["floor_us"] = None if mma_s is None else max(memory_s, mma_s) * 1e6
    time_us = row.get("time_us")
    if time_us:
        row["tflops"] = flops / (time_us * 1e-6) / 1e12
        row["gbps"] = nbytes / (time_us * 1e-6) / 1e9
        row["frac_of_floor"] = None if row["floor_us"] is None else row["floor_us"] / time_us
    return row


def cell_key(row: dict) -> tuple:
    return tuple(row[k] for k in CELL_KEYS)


def annotate_speedups(rows: list[dict]) -> list[dict]:
    """For every timed row of ours: the fastest correct peer of its cell and our speedup over it."""
    best_peer: dict[tuple, dict] = {}
    for row in rows:
        if row["kind"] == PEER and row["status"] == OK:
            key = cell_key(row)
            if key not in best_peer or row["time_us"] < best_peer[key]["time_us"]:
                best_peer[key] = row
    for row in rows:
        if row["kind"] != OURS:
            continue
        peer = best_peer.get(cell_key(row))
        row["best_peer"] = peer["kernel"] if peer else None
        row["speedup_vs_best_peer"] = (peer["time_us"] / row["time_us"]
                                       if peer and row["status"] == OK else None)
    return rows


# The tuned runner of bench_decode.py --candidates, and how close to the best fixed candidate it must be.
AUTO = "auto"
AUTO_TOLERANCE = 0.03


def autotune_summary(rows: Sequence[dict], tolerance: float = AUTO_TOLERANCE) -> list[dict]:
    """Per cell with a timed ``auto`` row: its time, the fastest timed fixed candidate of ours (runners named
    ``kernel:config``) and auto / best; ``within`` = auto is at most ``tolerance`` slower."""
    cells: dict[tuple, dict] = {}
    for row in rows:
        if row["kind"] != OURS or row["status"] != OK:
            continue
        entry = cells.setdefault(cell_key(row), {"auto": None, "best": None})
        if row["kernel"] == AUTO:
            entry["auto"] = row
        elif ":" in row["kernel"] and (entry["best"] is None or row["time_us"] < entry["best"]["time_us"]):
            entry["best"] = row
    out = []
    for key, entry in sorted(cells.items(), key=lambda kv: kv[0]):
        auto, best = entry["auto"], entry["best"]
        if auto is None or best is None:
            continue
        ratio = auto["time_us"] / best["time_us"]
        out.append({**dict(zip(CELL_KEYS, key)), "auto_us": auto["time_us"], "best": best["kernel"],
                    "best_us": best["time_us"], "ratio": ratio, "within": ratio <= 1.0 + tolerance,
                    "auto_note": auto.get("note") or ""})
    return out


def render_autotune(summary: Sequence[dict], tolerance: float = AUTO_TOLERANCE) -> list[str]:
    if not summary:
        return []
    within = sum(e["within"] for e in summary)
    lines = ["## Tuned `auto` vs the best fixed candidate", "",
             f"{within} of {len(summary)} cells within {100 * tolerance:.0f}% (auto / best <= "
             f"{1 + tolerance:.2f}); geomean auto / best "
             f"{math.exp(sum(math.log(e['ratio']) for e in summary) / len(summary)):.3f}.", "",
             "| KV | q_len | B | S | auto us | best fixed | best us | auto / best | tuning |",
             "|---|---:|---:|---:|---:|---|---:|---:|---|"]
    for e in sorted(summary, key=lambda e: (e["kv_dtype"], e["q_len"], e["batch"], e["seq_len"])):
        mark = "" if e["within"] else " **!**"
        lines.append(f"| {e['kv_dtype']} | {e['q_len']} | {e['batch']} | {e['seq_len']} | {e['auto_us']:.1f} | "
                     f"{e['best']} | {e['best_us']:.1f} | {e['ratio']:.3f}{mark} | {e['auto_note']} |")
    return lines + [""]


def new_row(kernel: str, kind: str, cell: dict, q_dtype: str, status: str, note: str = "") -> dict:
    """A row with every column present (None where not measured)."""
    row = dict.fromkeys(COLUMNS)
    row.update(cell)
    row.update(kernel=kernel, kind=kind, q_dtype=q_dtype, status=status, note=note)
    return row


# ----------------------------------------------------------------------------------------------------------
# Files
# ----------------------------------------------------------------------------------------------------------

def write_csv(rows: Sequence[dict], path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: ("" if row.get(k) is None else row[k]) for k in COLUMNS})


def write_json(rows: Sequence[dict], meta: dict, path: Path) -> None:
    with open(path, "w") as f:
        json.dump({"meta": meta, "columns": list(COLUMNS), "rows": list(rows)}, f, indent=1)


def read_json(path: Path) -> tuple[list[dict], dict]:
    with open(path) as f:
        data = json.load(f)
    return data["rows"], data["meta"]


def _kernel_order(rows: Iterable[dict]) -> list[str]:
    """Ours first, then peers, each in first-seen order."""
    seen: dict[str, str] = {}
    for row in rows:
        seen.setdefault(row["kernel"], row["kind"])
    return [k for k, kind in seen.items() if kind == OURS] + [k for k, kind in seen.items() if kind != OURS]


def _sections(rows: Sequence[dict]) -> list[tuple[str, int]]:
    """(kv_dtype, q_len) pairs present, bf16 first."""
    keys = {(r["kv_dtype"], r["q_len"]) for r in rows}
    return sorted(keys, key=lambda k: (k[0] != "bf16", k[0], k[1]))


def _page_sections(rows: Sequence[dict]) -> list[tuple[str, int, int]]:
    """(kv_dtype, q_len, block_size) triples present: the markdown's sections (one page size per table)."""
    keys = {(r["kv_dtype"], r["q_len"], r["block_size"]) for r in rows}
    return sorted(keys, key=lambda k: (k[0] != "bf16", k[0], k[1], k[2]))


def _fmt(value, digits: int = 1) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def _cell_text(row: dict | None) -> str:
    if row is None:
        return ""
    if row["status"] == OK:
        return _fmt(row["time_us"])
    return row["status"]


def _section_mma_dtypes(section: Sequence[dict], kernels: Sequence[str]) -> dict[str, str]:
    """kernel -> its MMA dtype in a section (the dtypes of its rows joined by ' or ' if they differ by cell; rows
    of cells the kernel does not support are left out)."""
    out = {}
    for k in kernels:
        dtypes = list(dict.fromkeys(r.get("mma_dtype") or "bf16" for r in section
                                    if r["kernel"] == k and r["status"] != NOT_APPLICABLE))
        if dtypes:
            out[k] = " or ".join(dtypes)
    return out


def _floor_dtypes(section: Sequence[dict]) -> list[str]:
    """The MMA dtypes whose floors a section shows: bf16 always, then every other dtype a row runs."""
    return list(dict.fromkeys(["bf16"] + [r.get("mma_dtype") or "bf16" for r in section
                                          if r["status"] != NOT_APPLICABLE and r.get("mma_dtype") != MMA_UNKNOWN]))


def _floor_of(present: Sequence[dict | None], mma_dtype: str) -> float | None:
    """The cell's floor for MMAs in ``mma_dtype``: the first row's bf16 floor, or the floor_us of the first row
    whose kernel runs that dtype."""
    for r in present:
        if r is None:
            continue
        if mma_dtype == "bf16" and r.get("floor_bf16_us"):
            return r["floor_bf16_us"]
        if (r.get("mma_dtype") or "bf16") == mma_dtype and r.get("floor_us"):
            return r["floor_us"]
    return None


def render_markdown(rows: Sequence[dict], meta: dict) -> str:
    kernels = _kernel_order(rows)
    ours = [k for k in kernels if any(r["kernel"] == k and r["kind"] == OURS for r in rows)]
    by_key = {(cell_key(r), r["kernel"]): r for r in rows}
    lines = [f"# MLA decode benchmark: {meta.get('device_name', '?')}", ""]
    for label, key in (("date", "date"), ("command", "command"), ("grid", "grid"),
                       ("HBM bandwidth (measured, device-to-device copy, read + write bytes)", "hbm_gbps"),
                       ("bf16 matmul peak (measured, 8192^3)", "peak_tflops"),
                       ("fp8 matmul peak (measured, 8192^3 e4m3, fast accumulation)", "fp8_peak_tflops"),
                       ("L2 cache", "l2_mib"), ("versions", "versions")):
        if key in meta:
            value = meta[key]
            if key == "hbm_gbps":
                value = f"{value:.0f} GB/s"
            elif key in ("peak_tflops", "fp8_peak_tflops"):
                value = "not measured (no fp8 matmul on this device)" if value is None else f"{value:.0f} TFLOP/s"
            elif key == "l2_mib":
                value = f"{value:.0f} MiB"
            elif key == "command":
                value = f"`{value}`"
            lines.append(f"- {label}: {value}")
    lines += ["", "Times are microseconds per decode call (median of CUDA-graph replays, KV rotated past L2); "
              "`wrong` = output differs from the float32 reference (not timed); `n/a` / `error` / `skipped`: "
              "see the notes below. `floor <dtype>` = max(bytes / HBM, flops / the matmul peak of an MMA in that "
              "dtype) (q_dtype changes the bytes a little: the column shows the first kernel's); `%floor` = the "
              "kernel's own floor (its MMA dtype) / time; `x best peer` = fastest correct peer's time / ours. "
              + MMA_DTYPE_HELP + ".", ""]
    several_pages = len({r["block_size"] for r in rows}) > 1
    for kv_dtype, q_len, block_size in _page_sections(rows):
        section = [r for r in rows if (r["kv_dtype"], r["q_len"], r["block_size"]) == (kv_dtype, q_len, block_size)]
        cells = sorted({cell_key(r) for r in section})
        mma = _section_mma_dtypes(section, kernels)
        floor_dtypes = _floor_dtypes(section)
        header = ["B", "S"] + [f"floor {d}" for d in floor_dtypes] + [f"{k}" for k in kernels]
        for k in ours:
            header += [f"%floor {k}", f"x best peer {k}"]
        lines += [f"## KV {kv_dtype}, q_len {q_len}" + (f", block {block_size}" if several_pages else ""), ""]
        if any(r.get("mma_dtype") for r in section):  # results of runs before mma_dtype existed have none
            lines += ["MMA dtype: " + ", ".join(f"{k} {d}" for k, d in mma.items()) + ".", ""]
        lines += ["| " + " | ".join(header) + " |", "|" + "---:|" * len(header)]
        for key in cells:
            present = [by_key.get((key, k)) for k in kernels]
            floors = [_floor_of(present, d) for d in floor_dtypes]
            cols = [str(key[0]), str(key[1])] + [_fmt(f) for f in floors] + [_cell_text(r) for r in present]
            for k in ours:
                r = by_key.get((key, k))
                frac = r.get("frac_of_floor") if r else None
                speedup = r.get("speedup_vs_best_peer") if r else None
                cols += ["" if frac is None else f"{100 * frac:.0f}%",
                         "" if speedup is None else f"{speedup:.2f}x ({r['best_peer']})"]
            lines.append("| " + " | ".join(cols) + " |")
        lines.append("")
    lines += render_autotune(autotune_summary(rows))
    notes: dict[tuple[str, str, str], int] = {}
    for r in rows:
        if r["status"] != OK and r.get("note"):
            key = (r["kernel"], r["status"], r["note"])
            notes[key] = notes.get(key, 0) + 1
    if notes:
        lines += ["## Notes", ""]
        for (kernel, status, note), count in sorted(notes.items()):
            lines.append(f"- `{kernel}` {status} in {count} cell(s): {note}")
        lines.append("")
    lines += ["## Columns of results.csv / results.json", ""]
    lines += [f"- `{k}`: {COLUMN_HELP[k]}" for k in COLUMNS if k in COLUMN_HELP]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------------------
# Plots
# ----------------------------------------------------------------------------------------------------------

def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display on the hosts
    import matplotlib.pyplot as plt

    return plt


def _grid_shape(n: int) -> tuple[int, int]:
    cols = 2 if n == 4 else min(n, 3)
    return math.ceil(n / cols), cols


def plot_time_vs_seq_len(rows: Sequence[dict], path: Path, kv_dtype: str, q_len: int) -> bool:
    """One subplot per batch size: microseconds vs S, one line per kernel, plus the roofline floor."""
    plt = _pyplot()
    section = [r for r in rows if r["kv_dtype"] == kv_dtype and r["q_len"] == q_len]
    batches = sorted({r["batch"] for r in section})
    if not any(r["status"] == OK for r in section):
        return False
    kernels = _kernel_order(section)
    nrows, ncols = _grid_shape(len(batches))
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 3.8 * nrows + 0.8), squeeze=False,
                             layout="constrained")
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, batch in zip(axes.flat, batches):
        in_batch = [r for r in section if r["batch"] == batch]
        for dtype, shade in zip(_floor_dtypes(in_batch), ("0.6", "0.35", "0.8")):
            floor = {}
            for seq_len in sorted({r["seq_len"] for r in in_batch}):
                value = _floor_of([r for r in in_batch if r["seq_len"] == seq_len], dtype)
                if value:
                    floor[seq_len] = value
            if floor:
                xs = sorted(floor)
                ax.plot(xs, [floor[x] for x in xs], color=shade, linestyle=":", linewidth=1.5,
                        label=f"floor {dtype} MMA")
        for i, kernel in enumerate(kernels):
            pts = sorted((r["seq_len"], r["time_us"]) for r in in_batch
                         if r["kernel"] == kernel and r["status"] == OK)
            if not pts:
                continue
            is_ours = any(r["kind"] == OURS for r in in_batch if r["kernel"] == kernel)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=4,
                    linewidth=2.4 if is_ours else 1.3, linestyle="-" if is_ours else "--",
                    color=colors[i % len(colors)], label=kernel)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"B = {batch}")
        ax.set_xlabel("KV length S")
        ax.set_ylabel("us per call")
        ax.grid(True, which="both", alpha=0.3)
    for ax in list(axes.flat)[len(batches):]:
        ax.axis("off")
    handles, labels = {}, []
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in handles:
                handles[lab] = h
                labels.append(lab)
    fig.suptitle(f"MLA decode time, KV {kv_dtype}, q_len {q_len} (lower is better; solid = ours)")
    fig.legend([handles[lab] for lab in labels], labels, loc="outside lower center", ncol=min(len(labels), 7),
               frameon=False)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return True


def plot_cell_heatmaps(rows: Sequence[dict], path: Path, kernel: str, value_key: str, title: str,
                       centre_at_one: bool, missing_label: str = "-") -> bool:
    """One heatmap per (kv_dtype, q_len): batch x seq_len, coloured and annotated by ``value_key``.

    centre_at_one: a ratio (speedup) on a log scale, red below 1 and green above; else a fraction in [0, 1].
    missing_label: the text of an ok cell that has no value (e.g. no correct peer to compare with).
    """
    plt = _pyplot()
    from matplotlib.colors import LogNorm, Normalize
    from matplotlib.ticker import FixedLocator, FuncFormatter

    mine = [r for r in rows if r["kernel"] == kernel]
    values = [r[value_key] for r in mine if r.get(value_key) is not None]
    if not values:
        return False
    sections = _sections(mine)
    nrows, ncols = _grid_shape(len(sections))
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.0 * ncols, 3.9 * nrows), squeeze=False,
                             layout="constrained")
    if centre_at_one:  # symmetric in log space so that 0.5x and 2x are equally far from white
        span = max(max(values), 1 / min(values), 1.1)
        norm, cmap = LogNorm(vmin=1 / span, vmax=span), "RdYlGn"
    else:
        norm, cmap = Normalize(vmin=0.0, vmax=max(1.0, max(values))), "viridis"
    image = None
    for ax, (kv_dtype, q_len) in zip(axes.flat, sections):
        section = [r for r in mine if r["kv_dtype"] == kv_dtype and r["q_len"] == q_len]
        batches = sorted({r["batch"] for r in section})
        seq_lens = sorted({r["seq_len"] for r in section})
        grid = [[math.nan] * len(seq_lens) for _ in batches]
        labels = [[""] * len(seq_lens) for _ in batches]
        for r in section:
            i, j = batches.index(r["batch"]), seq_lens.index(r["seq_len"])
            if r.get(value_key) is not None:
                grid[i][j] = r[value_key]
                labels[i][j] = f"{r[value_key]:.2f}" if centre_at_one else f"{100 * r[value_key]:.0f}%"
            else:
                labels[i][j] = r["status"] if r["status"] != OK else missing_label
        image = ax.imshow(grid, norm=norm, cmap=cmap, aspect="auto", origin="lower")
        for i in range(len(batches)):
            for j in range(len(seq_lens)):
                ax.text(j, i, labels[i][j], ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(seq_lens)), [str(s) for s in seq_lens])
        ax.set_yticks(range(len(batches)), [str(b) for b in batches])
        ax.set_xlabel("KV length S")
        ax.set_ylabel("batch B")
        ax.set_title(f"KV {kv_dtype}, q_len {q_len}")
        ax.set_facecolor("0.9")
    for ax in list(axes.flat)[len(sections):]:
        ax.axis("off")
    if image is not None:
        bar = fig.colorbar(image, ax=list(axes.flat), shrink=0.8)
        if centre_at_one:
            ticks = [t for t in (0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0)
                     if 1 / span <= t <= span]
            bar.ax.yaxis.set_major_locator(FixedLocator(ticks))
            bar.ax.yaxis.set_minor_locator(FixedLocator([]))
            bar.ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
    fig.suptitle(title)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return True


def write_plots(rows: Sequence[dict], plot_dir: Path) -> list[Path]:
    """Every PNG of the report; returns the files written. Runs of several page sizes plot the default one (64) or
    else the smallest (the markdown has them all)."""
    pages = sorted({r["block_size"] for r in rows})
    if len(pages) > 1:
        page = 64 if 64 in pages else pages[0]
        rows = [r for r in rows if r["block_size"] == page]
    plot_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for kv_dtype, q_len in _sections(rows):
        path = plot_dir / f"time_vs_seq_len_kv-{kv_dtype}_q{q_len}.png"
        if plot_time_vs_seq_len(rows, path, kv_dtype, q_len):
            written.append(path)
    for kernel in _kernel_order(rows):
        if not any(r["kernel"] == kernel and r["kind"] == OURS for r in rows):
            continue
        slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", kernel)  # candidates are named "kernel:config"
        path = plot_dir / f"speedup_vs_best_peer_{slug}.png"
        if plot_cell_heatmaps(rows, path, kernel, "speedup_vs_best_peer",
                              f"{kernel}: speedup over the fastest correct peer (>1 = {kernel} faster)",
                              centre_at_one=True, missing_label="no peer"):
            written.append(path)
        path = plot_dir / f"frac_of_floor_{slug}.png"
        if plot_cell_heatmaps(rows, path, kernel, "frac_of_floor",
                              f"{kernel}: fraction of the roofline floor of its MMA dtype reached",
                              centre_at_one=False):
            written.append(path)
    return written


def write_report(rows: Sequence[dict], meta: dict, out_dir: Path, plots: bool = True) -> list[Path]:
    """results.csv, results.json, results.md and plots/*.png in out_dir; returns the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    write_csv(rows, out_dir / "results.csv")
    write_json(rows, meta, out_dir / "results.json")
    (out_dir / "results.md").write_text(render_markdown(rows, meta))
    written = [out_dir / "results.csv", out_dir / "results.json", out_dir / "results.md"]
    if plots:
        try:
            written += write_plots(rows, out_dir / "plots")
        except ImportError as e:
            print(f"plots skipped ({e}); render them elsewhere with: "
                  f"python benchmarks/report.py --render {out_dir}", file=sys.stderr)
    return written


# ----------------------------------------------------------------------------------------------------------
# Self-test (CPU): fake results through every writer
# ----------------------------------------------------------------------------------------------------------

def _fake_mma_dtype(kernel: str, kv_dtype: str) -> str:
    """fp8 cells: flashmla runs both products in fp8, the others widen the cache to bf16."""
    return "fp8" if kv_dtype == "fp8" and kernel == "flashmla" else "bf16"


def _fake_rows() -> tuple[list[dict], dict]:
    """A small grid with every status, timed like a memory-bound kernel at 2.5 TB/s (peers slower)."""
    hbm, peak, fp8_peak = 3.0e12, 700e12, 1400e12
    speed = {"triton": 0.85, "flashmla": 0.9, "fa3_mla": 0.7, "triton_mla": 0.4}
    rows = []
    for kv_dtype in ("bf16", "fp8"):
        for q_len in (1, 2):
            for batch in (1, 8, 64):
                for seq_len in (1024, 4096, 32768):
                    cell = dict(batch=batch, seq_len=seq_len, q_len=q_len, kv_dtype=kv_dtype, num_heads=128,
                                block_size=64)
                    for kernel, frac in speed.items():
                        kind = OURS if kernel == "triton" else PEER
                        q_dtype = "fp8" if kv_dtype == "fp8" and kernel in ("triton", "flashmla") else "bf16"
                        if kernel == "triton_mla" and q_len > 1:
                            rows.append(new_row(kernel, kind, cell, q_dtype, NOT_APPLICABLE,
                                                "decodes one token per request"))
                            continue
                        if kernel == "fa3_mla" and kv_dtype == "fp8":
                            rows.append(new_row(kernel, kind, cell, q_dtype, NOT_APPLICABLE, "no fp8 KV"))
                            continue
                        if batch == 64 and seq_len == 32768 and kernel == "flashmla" and q_len == 2:
                            rows.append(new_row(kernel, kind, cell, q_dtype, WRONG, "max |err| 0.9 > tol"))
                            continue
                        row = new_row(kernel, kind, cell, q_dtype, OK)
                        row["mma_dtype"] = _fake_mma_dtype(kernel, kv_dtype)
                        fill_metrics(row, hbm, peak, fp8_peak)
                        row["time_us"] = row["floor_us"] / frac + 3.0  # + launch-ish overhead
                        row.update(time_us_p10=row["time_us"] * 0.98, time_us_p90=row["time_us"] * 1.03,
                                   max_abs_err=1e-3, kv_copies=4, calls_per_graph=8, replays=50)
                        rows.append(fill_metrics(row, hbm, peak, fp8_peak))
    for row in rows:
        row["mma_dtype"] = _fake_mma_dtype(row["kernel"], row["kv_dtype"])  # as bench_decode sets it on every row
    meta = dict(device_name="Fake GPU", date="2026-01-01", command="report.py --selftest", grid="fake",
                hbm_gbps=hbm / 1e9, peak_tflops=peak / 1e12, fp8_peak_tflops=fp8_peak / 1e12, l2_mib=50,
                versions="none")
    return annotate_speedups(rows), meta


def selftest(keep_dir: str | None = None) -> Path:
    rows, meta = _fake_rows()
    out_dir = Path(keep_dir) if keep_dir else Path(tempfile.mkdtemp(prefix="mla_bench_selftest_"))
    written = write_report(rows, meta, out_dir)

    # work and floor arithmetic
    assert visible_keys_per_request(4096, 1) == 4096
    assert visible_keys_per_request(4096, 2) == 4095 + 4096
    assert decode_flops(2, 10, 2, 3) == 2 * 2 * 3 * (9 + 10) * 1088
    assert decode_bytes(1, 64, 1, 1, 64, "fp8", "fp8") == 64 * 576 + 576 + 512 * 2 + 4
    row = next(r for r in rows if r["kernel"] == "triton" and r["status"] == OK)
    assert abs(row["frac_of_floor"] - row["floor_us"] / row["time_us"]) < 1e-12

    # floors per MMA dtype: a bf16 kernel's floor is the bf16 floor; an fp8 kernel's divides each product's
    # flops by the fp8 peak (B=64 S=32k q_len 2 fp8 is compute-bound at bf16 speed, memory-bound at fp8 speed)
    hbm, peak, fp8_peak = meta["hbm_gbps"] * 1e9, meta["peak_tflops"] * 1e12, meta["fp8_peak_tflops"] * 1e12
    for r in (r for r in rows if r["status"] == OK):
        nbytes = decode_bytes(r["batch"], r["seq_len"], r["q_len"], r["num_heads"], r["block_size"], r["kv_dtype"],
                              r["q_dtype"])
        flops = decode_flops(r["batch"], r["seq_len"], r["q_len"], r["num_heads"])
        assert abs(r["floor_bf16_us"] - 1e6 * max(nbytes / hbm, flops / peak)) < 1e-9 * r["floor_bf16_us"]
        expected = 1e6 * max(nbytes / hbm, flops / (fp8_peak if r["mma_dtype"] == "fp8" else peak))
        assert abs(r["floor_us"] - expected) < 1e-9 * expected, (r, expected)
    fp8_row = next(r for r in rows if (r["kernel"], r["kv_dtype"], r["batch"], r["seq_len"], r["q_len"]) ==
                   ("flashmla", "fp8", 64, 32768, 1))
    assert fp8_row["floor_us"] < fp8_row["floor_bf16_us"]
    # mixed products: Q K^T at the fp8 rate, P V at the bf16 rate
    keys = 128 * 4096
    mixed = mma_time_s(1, 4096, 1, 128, "fp8/bf16", {"bf16": peak, "fp8": fp8_peak})
    assert abs(mixed - (2 * keys * 576 / fp8_peak + 2 * keys * 512 / peak)) < 1e-15
    assert mma_time_s(1, 4096, 1, 128, "fp8", {"bf16": peak, "fp8": None}) is None
    no_fp8_peak = fill_metrics(dict(fp8_row, time_us=100.0), hbm, peak)
    assert no_fp8_peak["floor_us"] is None and no_fp8_peak["frac_of_floor"] is None
    unknown = fill_metrics(dict(fp8_row, time_us=100.0, mma_dtype=MMA_UNKNOWN), hbm, peak, fp8_peak)
    assert unknown["floor_us"] is None and unknown["floor_bf16_us"] == fp8_row["floor_bf16_us"]
    try:
        mma_dtype_pair("int8")
    except ValueError as e:
        assert "mma_dtype 'int8'" in str(e) and "bf16, fp16, fp8" in str(e)
    else:
        raise AssertionError("mma_dtype_pair accepted int8")
    assert abs(row["gbps"] * row["time_us"] * 1e3 - decode_bytes(
        row["batch"], row["seq_len"], row["q_len"], row["num_heads"], row["block_size"], row["kv_dtype"],
        row["q_dtype"])) < 1e-3 * row["gbps"] * row["time_us"] * 1e3

    # speedups: against the fastest ok peer of the same cell, never a wrong or n/a one
    for ours in (r for r in rows if r["kind"] == OURS and r["status"] == OK):
        peers = [r for r in rows if r["kind"] == PEER and r["status"] == OK and cell_key(r) == cell_key(ours)]
        if not peers:
            assert ours["best_peer"] is None and ours["speedup_vs_best_peer"] is None
            continue
        best = min(peers, key=lambda r: r["time_us"])
        assert ours["best_peer"] == best["kernel"], (ours, best)
        assert abs(ours["speedup_vs_best_peer"] - best["time_us"] / ours["time_us"]) < 1e-12
    for wrong in (r for r in rows if r["status"] == WRONG):
        ours = next(r for r in rows if r["kind"] == OURS and cell_key(r) == cell_key(wrong))
        # bf16: fa3_mla is the only correct peer left; fp8: none is, so there is no speedup to report
        expected = "fa3_mla" if wrong["kv_dtype"] == "bf16" else None
        assert ours["best_peer"] == expected, (ours, expected)
        assert (ours["speedup_vs_best_peer"] is None) == (expected is None)

    # files: CSV and JSON hold the same rows, markdown has a section per (kv, q_len), PNGs are real
    with open(out_dir / "results.csv") as f:
        csv_rows = list(csv.DictReader(f))
    assert len(csv_rows) == len(rows) and list(csv_rows[0]) == list(COLUMNS)
    json_rows, json_meta = read_json(out_dir / "results.json")
    assert json_rows == rows and json_meta == meta
    markdown = (out_dir / "results.md").read_text()
    for kv_dtype, q_len in _sections(rows):
        assert f"## KV {kv_dtype}, q_len {q_len}" in markdown
    assert "wrong" in markdown and "n/a" in markdown and "x best peer triton" in markdown
    assert "fp8 matmul peak (measured, 8192^3 e4m3, fast accumulation): 1400 TFLOP/s" in markdown
    fp8_section = markdown[markdown.index("## KV fp8, q_len 1"):]
    assert "| B | S | floor bf16 | floor fp8 | triton |" in fp8_section
    assert "MMA dtype: triton bf16, flashmla fp8, triton_mla bf16." in fp8_section
    bf16_section = markdown[markdown.index("## KV bf16, q_len 1"):markdown.index("## KV bf16, q_len 2")]
    assert "| B | S | floor bf16 | triton |" in bf16_section and "floor fp8" not in bf16_section
    # a results.json from before mma_dtype existed renders as before: one bf16 floor, no MMA legend
    old_rows = [{k: v for k, v in r.items() if k not in ("mma_dtype", "floor_bf16_us")} for r in rows]
    old_markdown = render_markdown(old_rows, {k: v for k, v in meta.items() if k != "fp8_peak_tflops"})
    for absent in ("\nMMA dtype: ", "floor fp8", "fp8 matmul peak (measured"):
        assert absent not in old_markdown, absent
    assert "| B | S | floor bf16 | triton |" in old_markdown
    pngs = [p for p in written if p.suffix == ".png"]
    assert len(pngs) == 4 + 2, [p.name for p in pngs]  # 4 time plots + speedup + floor heatmaps of ours
    for p in pngs:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 10_000, p
    return out_dir


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--selftest", action="store_true", help="render fake results into a temp dir and check them")
    group.add_argument("--render", metavar="DIR", help="write DIR/results.md and DIR/plots/ from DIR/results.json")
    group.add_argument("--merge", nargs="+", metavar=("OUT", "DIR"),
                       help="write a report of the rows of every DIR/results.json into OUT (same device)")
    parser.add_argument("--keep", metavar="DIR", help="with --selftest: write into DIR instead of a temp dir")
    args = parser.parse_args(argv)
    if args.merge:
        if len(args.merge) < 2:
            parser.error("--merge needs OUT and at least one DIR")
        out_dir, parts = Path(args.merge[0]), [Path(d) for d in args.merge[1:]]
        rows, meta = [], {}
        for part in parts:
            part_rows, part_meta = read_json(part / "results.json")
            rows += part_rows
            meta = meta or dict(part_meta)
        meta["merged_from"] = [str(p) for p in parts]
        for path in write_report(annotate_speedups(rows), meta, out_dir):
            print(path)
        return 0
    if args.selftest:
        out_dir = selftest(args.keep)
        print(f"report selftest ok: {out_dir}")
        for name in sorted(os.listdir(out_dir)) + sorted(f"plots/{n}" for n in os.listdir(out_dir / "plots")):
            print(f"  {name}")
        return 0
    out_dir = Path(args.render)
    rows, meta = read_json(out_dir / "results.json")
    for path in write_report(rows, meta, out_dir):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
