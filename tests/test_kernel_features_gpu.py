"""GPU tests of the kernel features beyond the shared correctness grid (tests/test_ops_gpu.py), for every kernel
that launches with PDL (cute_sm90, xqa_sm120); each skips where its kernel cannot run:

* PDL on and off give bit-identical results (split and unsplit paths, bf16 and fp8 KV);
* CUDA-graph capture with PDL on and off, replayed with new lengths;
* compute-sanitizer memcheck and racecheck on a small case (skipped without compute-sanitizer);
* xqa_sm120: NaN in KV slots no request may read (the tail of a last page, past a split's end) never reaches
  the output, for every page size (the kernel zeroes the rows past the end after TMA lands them);
* on SM120/SM121 only: the native sm_120a/sm_121a cubin is the one loaded;
* cute_sm90: the combine fused into the split kernel at small batches (COOPERATIVE) and, by each request's last
  CTA, at any batch (LAST_CTA), eager and under graph replay.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from mla_backend_plugin.kernels.reference import mla_decode_reference
from mla_backend_plugin.ops import KERNELS, LaunchConfig, MLAWorkspace, mla_decode
from mla_backend_plugin.ops.constants import FP8_DTYPE, KV_LORA_RANK
from mla_backend_plugin.ops.plan import SPLIT_CAPACITY
from mla_backend_plugin.testing import (
    assert_close_decode,
    capture_graph,
    draw_seq_lens,
    make_decode_inputs,
    replay_with,
    select_kernel_for_test,
)

pytestmark = pytest.mark.gpu

PDL_KERNELS = ("cute_sm90", "xqa_sm120")
# compute-sanitizer --kernel-name filter: a substring of each kernel's mangled name
SANITIZER_KERNEL_FILTER = {"cute_sm90": "kns=Sm90MlaDecode", "xqa_sm120": "kns=xqa_mla"}
KERNEL = "xqa_sm120"  # set per test by the kernel fixture
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(autouse=True, params=PDL_KERNELS)
def kernel(request, monkeypatch):
    monkeypatch.delenv("CUTE_MLA_KERNEL", raising=False)
    monkeypatch.setenv("CUTE_MLA_SELF_CHECK", "never")
    return select_kernel_for_test(request.param, globals(), monkeypatch)


def _run(inp, ws, as_tensor=False):
    out, lse = inp.poisoned_outputs()
    mla_decode(*inp.call_args(), softmax_scale=inp.softmax_scale, out=out, lse=lse, workspace=ws, kernel=KERNEL,
               **inp.scale_kwargs(as_tensor))
    torch.cuda.synchronize()
    return out, lse


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, FP8_DTYPE], ids=["bf16", "fp8"])
@pytest.mark.parametrize("num_sms", [1, 132], ids=["nosplit", "split"])
def test_pdl_on_off_identical(monkeypatch, kv_dtype, num_sms):
    lens = draw_seq_lens(4, 2000, block_size=32, seed=5)
    lens[2] = 1
    inp = make_decode_inputs(4, lens, 3, 32, 32, kv_dtype, "pair", "cuda", 11,
                             kv_scale=3.0 if kv_dtype == FP8_DTYPE else None)
    ws = MLAWorkspace("cuda", max_batch=4, max_q_len=3, num_heads=32, num_sms=num_sms)
    tile = KERNELS[KERNEL].plan_tile(32, None, None)
    plan = ws.plan(4, 3, balanced=KERNEL == "cute_sm90", rows_per_cta=tile.rows_per_cta)
    assert plan.has_combine == (num_sms > 1)
    results = {}
    for pdl in ("1", "0"):
        monkeypatch.setenv("CUTE_MLA_PDL", pdl)
        results[pdl] = _run(inp, ws, as_tensor=True)
    assert torch.equal(results["1"][0], results["0"][0]) and torch.equal(results["1"][1], results["0"][1])
    ref_out, ref_lse = inp.reference()
    assert_close_decode(*results["1"], ref_out, ref_lse, kv_dtype)


@pytest.mark.parametrize("one_step", [False, True], ids=["calls", "step"])
@pytest.mark.parametrize("pdl", ["1", "0"], ids=["pdl", "nopdl"])
def test_graph_replay_back_to_back(monkeypatch, pdl, one_step):
    """Two decode calls per graph (the second reads the first's output as q), captured with PDL on/off and
    replayed with new lengths: PDL edges inside a graph must still order the dependent kernels. ``step``: both
    calls are layers of one decode step (``StepPlans``): cute_sm90 plans once, before the first, eagerly and in
    the graph (whose eager warm-up ran with the same step), and the second reads that plan."""
    from mla_backend_plugin.ops.workspace import StepPlans

    monkeypatch.setenv("CUTE_MLA_PDL", pdl)
    batch, q_len, heads, bs, width = 6, 2, 64, 64, 40
    ws = MLAWorkspace("cuda", max_batch=batch, max_q_len=q_len, num_heads=heads)
    num_blocks = batch * width + 5

    def fresh(lens, seed):
        return make_decode_inputs(batch, lens, q_len, heads, bs, torch.bfloat16, "pair", "cuda", seed,
                                  num_blocks=num_blocks, max_blocks=width)

    static = fresh(draw_seq_lens(batch, 700, block_size=bs, seed=1), 3)
    q_nope, q_pe = static.q
    kv, bt, seq = static.kv_cache, static.block_table, static.seq_lens
    out1 = torch.empty(batch * q_len, heads, KV_LORA_RANK, dtype=torch.bfloat16, device="cuda")
    out2 = torch.empty_like(out1)
    lse1 = torch.empty(batch * q_len, heads, dtype=torch.float32, device="cuda")
    lse2 = torch.empty_like(lse1)

    step = StepPlans() if one_step else None

    def run():
        mla_decode((q_nope, q_pe), kv, bt, seq, softmax_scale=static.softmax_scale, out=out1, lse=lse1,
                   workspace=ws, kernel=KERNEL, step=step)
        mla_decode((out1, q_pe), kv, bt, seq, softmax_scale=static.softmax_scale, out=out2, lse=lse2,
                   workspace=ws, kernel=KERNEL, step=step)

    rounds = [draw_seq_lens(batch, 2500, block_size=bs, seed=9, max_len=width * bs), [1, 0, 64, 65, width * bs, 3]]
    graph = capture_graph(lambda _: run(), warmup=1)
    for i, lens in enumerate([None] + rounds):  # round 0: eager, a new step
        if lens is not None:
            static.load_(fresh(lens, 20 + i))
        for t in (out1, out2, lse1, lse2):
            t.fill_(math.nan)
        if lens is None:
            step = StepPlans() if one_step else None
            run()
        else:
            graph.replay()
        torch.cuda.synchronize()
        r1, l1 = mla_decode_reference(q_nope, q_pe, kv, bt, seq, q_len, static.softmax_scale)
        assert_close_decode(out1, lse1, r1, l1, torch.bfloat16, msg=f"first call, round {i}")
        # the second call's reference uses the kernel's own first output (bf16) as q
        r2, l2 = mla_decode_reference(out1, q_pe, kv, bt, seq, q_len, static.softmax_scale)
        assert_close_decode(out2, lse2, r2, l2, torch.bfloat16, msg=f"second call, round {i}")


def _sanitizer() -> str | None:
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if root and os.access(os.path.join(root, "bin", "compute-sanitizer"), os.X_OK):
            return os.path.join(root, "bin", "compute-sanitizer")
    return None


@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_compute_sanitizer(tool, kernel):
    sanitizer = _sanitizer()
    if sanitizer is None:
        pytest.skip("compute-sanitizer not found")
    env = dict(os.environ, CUTE_MLA_SELF_CHECK="never", PYTHONPATH=os.pathsep.join(
        [os.path.dirname(HERE)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    # --report-api-errors no: CuTe-DSL's import probes the driver with calls that may return an error code
    # (host side, handled); only device-side errors of our kernel count here
    cmd = [sanitizer, "--tool", tool, "--report-api-errors", "no", "--kernel-name", SANITIZER_KERNEL_FILTER[kernel],
           "--error-exitcode", "3", sys.executable, os.path.join(HERE, "sanitizer_case.py"), kernel]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, check=False)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "SANITIZER_OK" in text, f"{' '.join(cmd)} -> {proc.returncode}\n{text[-4000:]}"
    summary = {"memcheck": r"ERROR SUMMARY: 0 errors", "racecheck": r"RACECHECK SUMMARY: 0 hazards"}[tool]
    assert re.search(summary, text), text[-4000:]


@pytest.mark.parametrize("schedule", ["seesaw", "lockstep"])
@pytest.mark.parametrize("bs", [16, 64])
def test_cute_sm90_schedules(kernel, monkeypatch, schedule, bs):
    """Every 16-bit schedule of cute_sm90 against the reference: odd and even tile counts per split (the seesaw
    pairs tiles; an odd count ends with an empty tile B), splits ending inside a page, NaN in every unread slot
    (make_decode_inputs) and in the outputs before the call."""
    if kernel != "cute_sm90":
        pytest.skip("cute_sm90 only")
    monkeypatch.setenv("CUTE_MLA_SM90_SCHEDULE", schedule)
    lens = [1, 64 + 5, 3 * 64, 5 * 64 - 1, 2000]
    inp = make_decode_inputs(5, lens, 2, 128, bs, torch.bfloat16, "pair", "cuda", 21)
    ref_out, ref_lse = inp.reference()
    for num_sms in (1, 132):
        ws = MLAWorkspace("cuda", max_batch=5, max_q_len=2, num_heads=128, num_sms=num_sms)
        out, lse = _run(inp, ws)
        assert_close_decode(out, lse, ref_out, ref_lse, torch.bfloat16, msg=f"{schedule} num_sms={num_sms}")


@pytest.mark.parametrize("l2_prefetch", [1, 2])
@pytest.mark.parametrize("bs", [16, 64, 128])
def test_cute_sm90_seesaw_l2_prefetch(kernel, l2_prefetch, bs):
    """The seesaw with its producer prefetching tile pairs into L2 (LaunchConfig.l2_prefetch) against the
    reference and bit for bit against the same launch without it: splits of 1 to many pairs (prefetches past a
    split's end are skipped), lengths ending inside a page, NaN in every unread slot and in the outputs."""
    if kernel != "cute_sm90":
        pytest.skip("cute_sm90 only")
    lens = [1, 64 + 5, 3 * 64, 5 * 64 - 1, 2000, 9000]
    inp = make_decode_inputs(6, lens, 1, 128, bs, torch.bfloat16, "pair", "cuda", 23)
    ref_out, ref_lse = inp.reference()
    for num_sms in (1, 132):
        ws = MLAWorkspace("cuda", max_batch=6, max_q_len=1, num_heads=128, num_sms=num_sms)
        outs = []
        for n in (0, l2_prefetch):
            out, lse = inp.poisoned_outputs()
            mla_decode(*inp.call_args(), softmax_scale=inp.softmax_scale, out=out, lse=lse, workspace=ws,
                       kernel=KERNEL, config=LaunchConfig(schedule="seesaw", l2_prefetch=n))
            torch.cuda.synchronize()
            assert_close_decode(out, lse, ref_out, ref_lse, torch.bfloat16, msg=f"l2_prefetch={n} num_sms={num_sms}")
            outs.append((out, lse))
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@pytest.mark.parametrize("q_len", [1, 2])
@pytest.mark.parametrize("bs", [16, 64, 128])
def test_cute_sm90_seesaw_kv_multicast(kernel, monkeypatch, bs, q_len):
    """The seesaw's KV tiles shared by TMA multicast over clusters of two m-block CTAs (LaunchConfig.kv_multicast;
    128 heads: one cluster per work item at q_len 1, two at q_len 2) against the reference and bit for bit against
    the same launch without it: split grids merged by the combine kernel and by each request's last CTA, splits
    of one to many tile pairs and ending inside a page, NaN in every unread slot and in the outputs. Checks that
    the multicast variant is the one launched (and never for a grid whose CTAs merge together)."""
    if kernel != "cute_sm90":
        pytest.skip("cute_sm90 only")
    from mla_backend_plugin.kernels.cute_sm90 import launch as sm90_launch

    launched = []
    compiled = sm90_launch._compiled
    monkeypatch.setattr(sm90_launch, "_compiled",
                        lambda variant, pdl: launched.append(getattr(variant, "kv_multicast", None))
                        or compiled(variant, pdl))
    cases = [(6, [1, 64 + 5, 3 * 64, 5 * 64 - 1, 2000, 9000], 132, False),  # the combine kernel
             (6, [1, 64 + 5, 3 * 64, 5 * 64 - 1, 2000, 9000], 1, False),
             (80, [37 * i % 3000 + 1 for i in range(80)], 132, True)]  # >= 160 CTAs: the last CTA merges
    for batch, lens, num_sms, fused in cases:
        inp = make_decode_inputs(batch, lens, q_len, 128, bs, torch.bfloat16, "pair", "cuda", 29 + batch)
        ref_out, ref_lse = inp.reference()
        ws = MLAWorkspace("cuda", max_batch=batch, max_q_len=q_len, num_heads=128, num_sms=num_sms)
        outs = []
        for mc in (False, True):
            launched.clear()
            out, lse = inp.poisoned_outputs()
            mla_decode(*inp.call_args(), softmax_scale=inp.softmax_scale, out=out, lse=lse, workspace=ws,
                       kernel=KERNEL, config=LaunchConfig(schedule="seesaw", kv_multicast=mc, fused_combine=fused))
            torch.cuda.synchronize()
            msg = f"kv_multicast={mc} B={batch} num_sms={num_sms} fused_combine={fused}"
            assert mc in launched and not (not mc and True in launched), (msg, launched)
            assert_close_decode(out, lse, ref_out, ref_lse, torch.bfloat16, msg=msg)
            outs.append((out, lse))
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    # a grid that fits at once merges cooperatively: the plain kernel runs there, whatever the config asks (at q_len
    # 1 two requests fill one wave of 132 CTAs; at q_len 2 the plan's grid bound, 4 m-blocks x (B + 33 - 1) items,
    # is more than a wave: the combine kernel and the multicast)
    inp = make_decode_inputs(2, [700, 3000], q_len, 128, bs, torch.bfloat16, "pair", "cuda", 31)
    ws = MLAWorkspace("cuda", max_batch=2, max_q_len=q_len, num_heads=128)
    launched.clear()
    out, lse = inp.poisoned_outputs()
    mla_decode(*inp.call_args(), softmax_scale=inp.softmax_scale, out=out, lse=lse, workspace=ws, kernel=KERNEL,
               config=LaunchConfig(schedule="seesaw", kv_multicast=True))
    torch.cuda.synchronize()
    (fused,) = [d[3] for k, d in ws.decisions.items() if k[0] == "cute_sm90.launch"]
    assert (True in launched) == (not fused) and (fused or q_len > 1), (fused, launched)
    assert_close_decode(out, lse, *inp.reference(), torch.bfloat16, msg=f"fused={fused}")


def _replay_with_new_lengths(inp, ws, fresh, counters, kv_dtype, seed, after_capture=None):
    """Capture ``inp``'s call in a CUDA graph (check ``after_capture()`` then), replay it with new lengths (drawn,
    all at the block table's width, alternately empty and 700, q_len + 1; inputs from ``fresh(lengths, seed)``)
    against the reference, and check the fused combine's counters are back at zero after each replay."""
    batch, q_len, bs = inp.batch, inp.q_len, inp.kv_cache.shape[1]
    width = inp.block_table.shape[1]
    out, lse = inp.poisoned_outputs()
    scales = inp.scale_kwargs(True)  # device tensors made before capture
    graph = capture_graph(lambda _: mla_decode(*inp.call_args(), softmax_scale=inp.softmax_scale, out=out, lse=lse,
                                               workspace=ws, kernel=KERNEL, **scales), warmup=1)
    assert after_capture is None or after_capture()
    rounds = [draw_seq_lens(batch, 8192, block_size=bs, seed=seed, max_len=width * bs), [width * bs] * batch,
              ([0, 700] * batch)[:batch], [q_len + 1] * batch]
    for i, new_lens in enumerate(rounds):
        new = fresh(new_lens, seed + 10 + i)
        replay_with(graph, inp, new, out, lse)
        ref_out, ref_lse = new.reference()
        assert_close_decode(out, lse, ref_out, ref_lse, kv_dtype, msg=f"graph round {i}, lengths {new_lens}")
        assert not counters.any(), counters.nonzero()


# (batch, q_len, heads, block size, lengths of the first round): grids of at most 128 CTAs (H100 and H200 SXM
# have 132 SMs)
FUSED_CASES = [(1, 1, 128, 64, [8000]), (2, 1, 128, 16, [5000, 1]), (2, 2, 16, 32, [3000, 77]),
               (1, 4, 64, 64, [2049])]


@pytest.mark.parametrize("case", FUSED_CASES, ids=lambda c: f"B{c[0]}q{c[1]}h{c[2]}bs{c[3]}")
@pytest.mark.parametrize("kv_dtype,q_form", [(torch.bfloat16, "pair"), (FP8_DTYPE, "pair"), (FP8_DTYPE, "fp8")],
                         ids=["bf16", "fp8kv", "fp8q"])
def test_cute_sm90_fused_combine(kernel, monkeypatch, case, kv_dtype, q_form):
    """cute_sm90 merges a small batch's splits inside the split kernel (one launch): against the reference and
    against the separate combine kernel, eagerly and in a CUDA graph replayed with new lengths (other split
    counts, unsplit requests, an empty one); the kernel leaves its counters at zero after every launch."""
    if kernel != "cute_sm90":
        pytest.skip("cute_sm90 only")
    from types import SimpleNamespace

    from mla_backend_plugin.kernels.cute_sm90 import launch

    batch, q_len, heads, bs, lens = case
    width = 8192 // bs
    # as the serving backends make it: room for the wave-filling split cap (64 splits at B=1)
    ws = MLAWorkspace("cuda", max_batch=batch, max_q_len=q_len, num_heads=heads, split_capacity=SPLIT_CAPACITY)
    counters = ws.scratch_for(launch.COMBINE_SCRATCH).view(torch.int32)
    plan = ws.plan(batch, q_len, balanced=True, rows_per_cta=64)
    probe = SimpleNamespace(q_len=q_len, num_heads=heads, q_nope=SimpleNamespace(device=torch.device("cuda", 0)))
    if not launch.fuses_combine(probe, plan):
        pytest.skip(f"the grid does not fit on this device's {ws.num_sms} SMs at once ({plan})")
    kv_scale = 2.5 if kv_dtype == FP8_DTYPE else None

    def fresh(lens, seed):
        return make_decode_inputs(batch, lens, q_len, heads, bs, kv_dtype, q_form, "cuda", seed, kv_scale=kv_scale,
                                  num_blocks=batch * width + 3, max_blocks=width)

    inp = fresh(lens, 31)
    ref_out, ref_lse = inp.reference()
    fused = _run(inp, ws, as_tensor=True)
    assert_close_decode(*fused, ref_out, ref_lse, kv_dtype, msg="fused")
    assert not counters.any()
    monkeypatch.setenv("CUTE_MLA_FUSED_COMBINE", "0")
    separate = _run(inp, ws, as_tensor=True)
    assert_close_decode(*separate, ref_out, ref_lse, kv_dtype, msg="separate combine")
    monkeypatch.delenv("CUTE_MLA_FUSED_COMBINE")
    torch.testing.assert_close(fused[0].float(), separate[0].float(), atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(fused[1], separate[1], atol=1e-4, rtol=1e-4)

    _replay_with_new_lengths(inp, ws, fresh, counters, kv_dtype, seed=40)


# (lengths, q_len, heads): with 64-token chunks each split is one tile, and the first request's last tile holds
# one key, which the rows before the last query row do not see ((S - 1) mod 64 < q_len - 1): a split with rows
# of no key, which the default 128-token chunks never make
ONE_TILE_CASES = [([1025, 130, 1], 2, 128), ([513, 67, 3], 4, 128), ([1025, 1027, 66, 3], 4, 16)]


@pytest.mark.parametrize("case", ONE_TILE_CASES, ids=lambda c: f"B{len(c[0])}q{c[1]}h{c[2]}")
@pytest.mark.parametrize("kv_dtype,q_form,design", [(torch.bfloat16, "pair", None), (FP8_DTYPE, "pair", None),
                                                    (FP8_DTYPE, "fp8", None), (FP8_DTYPE, "fp8", "fp8seesaw")],
                         ids=["bf16", "fp8kv", "fp8q", "fp8q-C"])
def test_cute_sm90_one_tile_splits(kernel, monkeypatch, case, kv_dtype, q_form, design):
    """``LaunchConfig(min_chunk=64)`` (public; measured 5-14% faster than the default 128 with an fp8 q at B x S
    below ~4k tokens, benchmarks/results/fp8_small_batch_h200/min_chunk/): splits of one tile, some of them with
    query rows that see no key, against the reference with NaN in unread slots and poisoned outputs, merged in
    the split kernel and by the combine kernel."""
    if kernel != "cute_sm90":
        pytest.skip("cute_sm90 only")
    from mla_backend_plugin.ops.manifest import LaunchConfig
    from mla_backend_plugin.ops.plan import balanced_schedule

    lens, q_len, heads = case
    batch = len(lens)
    ws = MLAWorkspace("cuda", max_batch=batch, max_q_len=q_len, num_heads=heads, split_capacity=SPLIT_CAPACITY)
    plan = ws.plan(batch, q_len, balanced=True, rows_per_cta=64, min_chunk=64)
    sched = balanced_schedule(lens, 64, 64, plan.work_target, plan.num_splits)
    assert sched.chunk[0] == 64 and sched.splits[0] == -(-lens[0] // 64), sched  # one tile per split
    assert (lens[0] - 1) % 64 < q_len - 1  # its last split: rows with no key
    kv_scale = 1.5 if kv_dtype == FP8_DTYPE else None
    inp = make_decode_inputs(batch, lens, q_len, heads, 64, kv_dtype, q_form, "cuda", 17, kv_scale=kv_scale)
    ref_out, ref_lse = inp.reference()
    config = LaunchConfig(min_chunk=64)
    for fused in ("1", "0"):
        monkeypatch.setenv("CUTE_MLA_FUSED_COMBINE", fused)
        out, lse = inp.poisoned_outputs()
        mla_decode(*inp.call_args(), softmax_scale=inp.softmax_scale, out=out, lse=lse, workspace=ws, kernel=KERNEL,
                   config=config, fp8_design=design, **inp.scale_kwargs(True))
        torch.cuda.synchronize()
        assert_close_decode(out, lse, ref_out, ref_lse, kv_dtype, msg=f"min_chunk 64, fused combine {fused}")


@pytest.mark.parametrize("bs", [16, 32, 64, 128])
@pytest.mark.parametrize("kv_dtype,q_form", [(torch.bfloat16, "pair"), (FP8_DTYPE, "pair"), (FP8_DTYPE, "fp8")],
                         ids=["bf16", "fp8kv", "fp8q"])
def test_xqa_nan_in_unread_slots(kernel, bs, kv_dtype, q_form):
    if kernel != "xqa_sm120":
        pytest.skip("xqa_sm120 only")
    lens = [1, 2 * bs + 3, 77, 5 * bs - 1]
    fp8 = kv_dtype == FP8_DTYPE
    inp = make_decode_inputs(4, lens, 2, 32, bs, kv_dtype, q_form, "cuda", 13, q_scale=2.0 if q_form == "fp8" else None,
                             kv_scale=3.0 if fp8 else None)
    kv = inp.kv_cache.view(torch.uint8) if fp8 else inp.kv_cache
    nan = 0x7F if fp8 else math.nan  # e4m3 NaN is S.1111.111
    for b, n in enumerate(lens):
        page = int(inp.block_table[b, (n - 1) // bs])
        if n % bs:
            kv[page, n % bs:] = nan
    for num_sms in (1, 132):  # one split, and splits whose ends fall inside a page
        ws = MLAWorkspace("cuda", max_batch=4, max_q_len=2, num_heads=32, num_sms=num_sms)
        out, lse = _run(inp, ws)
        ref_out, ref_lse = inp.reference()
        assert_close_decode(out, lse, ref_out, ref_lse, kv_dtype, msg=f"num_sms={num_sms}")


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 12,
                    reason="needs an SM120/SM121 GPU")
def test_sm120_native_cubin_and_fp8(kernel):
    if kernel != "xqa_sm120":
        pytest.skip("xqa_sm120 only")
    from mla_backend_plugin.kernels.xqa_sm120 import launch

    cc = torch.cuda.get_device_capability()
    loaded = launch.load(torch.device("cuda"))
    assert loaded.build.arch == {(12, 0): "sm_120a", (12, 1): "sm_121a"}[cc]
    lens = draw_seq_lens(8, 3000, block_size=64, seed=3)
    for kv_dtype, q_form in ((FP8_DTYPE, "fp8"), (torch.bfloat16, "pair")):
        inp = make_decode_inputs(8, lens, 2, 128, 64, kv_dtype, q_form, "cuda", 4,
                                 q_scale=2.0 if q_form == "fp8" else None,
                                 kv_scale=3.0 if kv_dtype == FP8_DTYPE else None)
        out, lse = _run(inp, None)
        ref_out, ref_lse = inp.reference()
        assert_close_decode(out, lse, ref_out, ref_lse, kv_dtype)


# (batch, q_len, heads, block size): split grids too large for one wave on 132 SMs (176-194 CTAs) with at most
# launch.LAST_CTA_MAX_MEAN_SPLITS work items per request, and (MANY_SPLITS) grids of 144-146 CTAs with ~9 a request,
# which merge in the kernel only in eager calls (graphs keep the combine kernel there)
MANY_SPLITS = [(8, 1, 128, 64), (4, 2, 128, 64)]
LAST_CTA_CASES = [(24, 1, 128, 64), (32, 1, 128, 16), (16, 2, 128, 32), (12, 4, 64, 64), (48, 1, 16, 64), *MANY_SPLITS]


@pytest.mark.parametrize("case", LAST_CTA_CASES, ids=lambda c: f"B{c[0]}q{c[1]}h{c[2]}bs{c[3]}")
@pytest.mark.parametrize("kv_dtype,q_form", [(torch.bfloat16, "pair"), (FP8_DTYPE, "pair"), (FP8_DTYPE, "fp8")],
                         ids=["bf16", "fp8kv", "fp8q"])
def test_cute_sm90_last_cta_combine(kernel, monkeypatch, case, kv_dtype, q_form):
    """cute_sm90 merges a split grid too large to be resident at once in the split kernel itself, by each
    request's last CTA (LAST_CTA, one launch): eagerly under the default policy and, with
    CUTE_MLA_LAST_CTA_COMBINE=always, in a CUDA graph replayed with new lengths (other split counts, unsplit
    requests, empty ones); against the reference and the combine kernel (CUTE_MLA_LAST_CTA_COMBINE=never);
    the counters are zero after every launch; a spy checks which mode each launch ran."""
    if kernel != "cute_sm90":
        pytest.skip("cute_sm90 only")
    from mla_backend_plugin.kernels.cute_common.host import LAST_CTA
    from mla_backend_plugin.kernels.cute_sm90 import launch

    modes = []
    real_mode = launch.combine_mode
    monkeypatch.setattr(launch, "combine_mode", lambda *a: modes.append(real_mode(*a)) or modes[-1])
    batch, q_len, heads, bs = case
    width = 8192 // bs
    ws = MLAWorkspace("cuda", max_batch=batch, max_q_len=q_len, num_heads=heads, split_capacity=SPLIT_CAPACITY)
    counters = ws.scratch_for(launch.COMBINE_SCRATCH).view(torch.int32)
    kv_scale = 2.5 if kv_dtype == FP8_DTYPE else None

    def fresh(lens, seed):
        return make_decode_inputs(batch, lens, q_len, heads, bs, kv_dtype, q_form, "cuda", seed, kv_scale=kv_scale,
                                  num_blocks=batch * width + 3, max_blocks=width)

    lens = draw_seq_lens(batch, 8192, block_size=bs, seed=60, max_len=width * bs)
    lens[0], lens[-1] = width * bs, 0  # one request at the longest, one empty
    inp = fresh(lens, 61)
    ref_out, ref_lse = inp.reference()
    monkeypatch.delenv("CUTE_MLA_LAST_CTA_COMBINE", raising=False)
    merged = _run(inp, ws, as_tensor=True)
    assert modes == [LAST_CTA], modes
    assert_close_decode(*merged, ref_out, ref_lse, kv_dtype, msg="last CTA")
    assert not counters.any(), counters.nonzero()
    monkeypatch.setenv("CUTE_MLA_LAST_CTA_COMBINE", "never")
    separate = _run(inp, ws, as_tensor=True)
    assert modes[-1] == 0
    assert_close_decode(*separate, ref_out, ref_lse, kv_dtype, msg="separate combine")
    torch.testing.assert_close(merged[0].float(), separate[0].float(), atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(merged[1], separate[1], atol=1e-4, rtol=1e-4)

    monkeypatch.setenv("CUTE_MLA_LAST_CTA_COMBINE", "always")
    in_graph = 0 if case in MANY_SPLITS else LAST_CTA
    _replay_with_new_lengths(inp, ws, fresh, counters, kv_dtype, seed=70,
                             after_capture=lambda: modes[-2:] == [LAST_CTA, in_graph])  # warm-up and capture
