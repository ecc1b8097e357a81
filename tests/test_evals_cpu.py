"""The eval package on CPU (issue 12): the tasks, the model's MLA against the absorbed decode form our kernels
compute, its checkpoint layout, the statistics, the float32 reference's batched greedy decoding, the runner of
condition processes (jobs, timeouts, budget), the eval end to end with its torch condition, the plans, and the
shipped weights solving problems."""

from __future__ import annotations

import math
import os
import pathlib
import signal
import subprocess
import sys

import pytest
import torch

from mla_backend_plugin.evals import MODEL_DIR, plan, reference, report, runner, stats, tasks, worker
from mla_backend_plugin.evals import __main__ as evals_main
from mla_backend_plugin.evals.model import (
    EvalModel,
    EvalModelConfig,
    apply_rope,
    greedy_answer,
    hf_config,
    rope_cos_sin,
)
from mla_backend_plugin.kernels.reference import mla_decode_reference


def _facts(prompt: list[int]) -> dict[int, int]:
    return {prompt[i + 1]: prompt[i + 2] for i in range(len(prompt) - 2) if prompt[i] == tasks.PAIR}


@pytest.mark.parametrize("length", [64, 1000, 8192])
def test_problems_are_well_formed_and_reproducible(length):
    for seed in range(5):
        r = tasks.make_problem("retrieve", length, seed)
        assert len(r.prompt) == length and r == tasks.make_problem("retrieve", length, seed)
        facts = _facts(r.prompt)
        assert len(facts) == tasks.pairs_for(length)
        keys = r.prompt[-tasks.RETRIEVE_KEYS - 1:-1]
        assert r.prompt[-tasks.RETRIEVE_KEYS - 2] == tasks.QUERY and r.prompt[-1] == tasks.ANSWER
        assert r.answer == [facts[k] for k in keys]
        h = tasks.make_problem("hop2", length, seed)
        facts = _facts(h.prompt)
        assert h.prompt[-3] == tasks.HOP and h.answer == [facts[h.prompt[-2]], facts[facts[h.prompt[-2]]]]
    assert max(tasks.make_problem("retrieve", 8192, 0).prompt) < tasks.VOCAB_SIZE
    assert tasks.eval_problems("hop2", 256, 3)[0].seed >= tasks.EVAL_SEED_BASE


def test_training_sequences_supervise_only_answers():
    seq, mask = tasks.training_sequence(2048, 7)
    assert len(seq) == len(mask) == 2048 and sum(mask) > 100
    facts = _facts(seq)
    for i, m in enumerate(mask):
        if m:  # every supervised token follows a key it answers for, or is the next link of a chain
            assert seq[i] in facts.values()


def _naive_attention_rows(model: EvalModel, x: torch.Tensor) -> torch.Tensor:
    """Layer 0's attention output of the last position, the absorbed way vLLM decodes: q_nope through W_UK into
    the latent space, softmax over [latent, k_pe] with the package's float32 MLA reference, W_UV, o_proj."""
    c = model.c
    layer = model.layers[0]
    a = layer.self_attn
    h = c.num_attention_heads
    xn = torch.nn.functional.rms_norm(x, (c.hidden_size,), layer.input_layernorm, c.rms_norm_eps)
    t = x.shape[1]
    cos, sin = rope_cos_sin(torch.arange(t), c)
    q = a.q_proj(xn[:, -1]).view(h, c.qk_head_dim)
    q_nope, q_pe = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
    q_pe = apply_rope(q_pe, cos[-1:], sin[-1:])
    latent, k_pe = a.kv_a_proj_with_mqa(xn[0]).split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
    latent = torch.nn.functional.rms_norm(latent, (c.kv_lora_rank,), a.kv_a_layernorm, c.rms_norm_eps)
    k_pe = apply_rope(k_pe, cos, sin)
    w = a.kv_b_proj.weight.view(h, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
    w_uk, w_uv = w[:, :c.qk_nope_head_dim], w[:, c.qk_nope_head_dim:]
    q_lat = torch.einsum("hn,hnl->hl", q_nope, w_uk)
    cache = torch.cat([latent, k_pe], dim=-1).view(t // 16, 16, 576)
    out_lat, _ = mla_decode_reference(q_lat[None], q_pe[None], cache, torch.arange(t // 16, dtype=torch.int32)[None],
                                      torch.tensor([t], dtype=torch.int32), 1, c.softmax_scale)
    o = torch.einsum("hl,hvl->hv", out_lat[0].to(w_uv.dtype), w_uv)
    return a.o_proj(o.reshape(1, -1))


def test_model_attention_is_the_absorbed_mla_our_kernels_compute():
    torch.manual_seed(0)
    c = EvalModelConfig.from_hf(hf_config(tasks.VOCAB_SIZE, hidden_size=64, intermediate_size=64, num_hidden_layers=1))
    model = EvalModel(c).double()
    for p in model.parameters():
        p.data.normal_(0, 0.2)  # not the small init: make the softmax far from uniform
    x = torch.randn(1, 48, c.hidden_size, dtype=torch.float64)
    layer = model.layers[0]
    cos, sin = rope_cos_sin(torch.arange(48), c)
    xn = torch.nn.functional.rms_norm(x, (c.hidden_size,), layer.input_layernorm, c.rms_norm_eps)
    expanded = layer.self_attn(xn, cos, sin)[:, -1]
    absorbed = _naive_attention_rows(model, x)
    # the reference runs in float32: agreement to float32 rounding
    torch.testing.assert_close(expanded, absorbed.to(expanded.dtype), rtol=1e-4, atol=1e-5)
    assert expanded.abs().max() > 1e-2


def test_rope_is_gptj_style():
    """Pairs (x[2i], x[2i+1]) rotate by position / theta^(2i/d): what vLLM applies to DeepSeek (not neox)."""
    x = torch.zeros(1, 64)
    x[0, 2], x[0, 3] = 1.0, 0.0  # pair 1
    c = EvalModelConfig.from_hf(hf_config(tasks.VOCAB_SIZE, rope_scaling=None))
    cos, sin = rope_cos_sin(torch.tensor([5]), c)
    y = apply_rope(x, cos, sin)
    angle = 5 / 10000 ** (2 / 64)
    assert torch.allclose(y[0, 2:4], torch.tensor([math.cos(angle), math.sin(angle)]), atol=1e-6)
    assert y[0, :2].abs().max() == 0 and y[0, 4:].abs().max() == 0


def test_checkpoint_round_trip_in_hf_layout(tmp_path):
    import json

    hf = hf_config(tasks.VOCAB_SIZE, hidden_size=64, intermediate_size=64, num_hidden_layers=2)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    model = EvalModel(EvalModelConfig.from_hf(hf))
    model.save_hf(str(tmp_path), dtype=torch.float32)
    again = EvalModel.load_hf(str(tmp_path))
    names = set(again.hf_state_dict())
    assert "model.layers.1.self_attn.kv_b_proj.weight" in names and "lm_head.weight" in names
    kv_b_rows = hf["num_attention_heads"] * (hf["qk_nope_head_dim"] + hf["v_head_dim"])
    assert again.hf_state_dict()["model.layers.1.self_attn.kv_b_proj.weight"].shape == (kv_b_rows, 512)
    tokens = torch.tensor([tasks.make_problem("retrieve", 64, 0).prompt])
    torch.testing.assert_close(again(tokens), model.eval()(tokens))
    with pytest.raises(ValueError, match="q_lora_rank null"):
        EvalModelConfig.from_hf({**hf, "q_lora_rank": 1536})


def test_statistics():
    lo, hi = stats.wilson(50, 100)
    assert 0.40 < lo < 0.41 and 0.59 < hi < 0.60
    assert stats.wilson(0, 10)[0] == 0.0 and stats.wilson(10, 10)[1] == 1.0
    assert stats.worse_p_value(40, 100, 80, 100) < 1e-6 and stats.worse_p_value(80, 100, 40, 100) > 0.99
    p = torch.log_softmax(torch.tensor([1.0, 2.0, 3.0]), 0)
    q = torch.log_softmax(torch.tensor([1.0, 2.0, 2.5]), 0)
    assert stats.kl_divergence(p, p) == 0 and stats.kl_divergence(p, q) > 0


def test_verdicts_flag_a_worse_kernel_only():
    def row(cond, ours, hits, kl=1e-4):
        backend = "CUTE_MLA" if ours else cond.split()[0]
        return {"condition": cond, "backend": backend, "ours": ours, "kv_dtype": "auto", "task": "retrieve",
                "length": 1024, "hits": hits, "n": 100, "accuracy": hits / 100, "kl_mean": kl}
    rows = [row("reference", False, 90, 0.0), row("FLASHMLA", False, 89), row("CUTE_MLA[cute_sm90]", True, 88),
            row("torch bf16", False, 99, 1e-9)]  # not a vLLM backend: neither the best peer nor the KL yardstick
    assert stats.verdicts(rows) == []
    bad = rows + [row("CUTE_MLA[triton]", True, 60), row("CUTE_MLA[xqa_sm120]", True, 89, kl=0.5)]
    found = stats.verdicts(bad)
    assert len(found) == 3 and all("triton" in f or "xqa" in f for f in found), found


def test_outputs_and_dry_run(tmp_path):
    rows = [{"condition": "reference", "backend": "reference", "ours": False, "kv_dtype": "auto", "mode": "-",
             "spec": 0, "task": t, "length": n, "hits": 9, "n": 10, "accuracy": 0.9, "ci_low": 0.6, "ci_high": 0.98,
             "kl_mean": 0.0, "kl_max": 0.0, "kl_tokens": 0} for t in tasks.TASKS for n in (1024, 4096)]
    paths = report.write_outputs(rows, str(tmp_path))
    assert any(p.endswith(".png") for p in paths)
    with open(paths[1]) as f:
        assert "| reference | retrieve | 1024 | 0.900" in f.read()
    conds = plan.conditions(["CUTE_MLA", "TRITON_MLA", "FLASH_ATTN_MLA"], ["auto", "triton"], ["auto", "fp8"],
                          ["eager", "graphs"], [0, 3])
    labels = {c.label for c in conds}
    assert "CUTE_MLA[triton] kv=fp8 graphs spec3" in labels and "TRITON_MLA kv=bf16 eager" in labels
    assert not any("TRITON_MLA" in lb and "spec" in lb for lb in labels)  # one token per step there
    assert not any("FLASH_ATTN_MLA" in lb and "fp8" in lb for lb in labels)
    out = subprocess.run([sys.executable, "-m", "mla_backend_plugin.evals", "--dry-run", "--problems", "2"],
                         capture_output=True, text=True, check=True).stdout
    assert "conditions x" in out and "CUTE_MLA[cute_sm90] kv=fp8 graphs spec3" in out and "torch bf16" in out


def test_device_plan():
    """Every backend, and each of our kernels built for sm_90a, with CUDA graphs and both KV dtypes (fp8 where
    vLLM allows it); eager and n-gram speculation only for CUTE_MLA auto and FLASHMLA; ours before the peers."""
    from mla_backend_plugin.ops.registry import KERNELS

    device = plan.device_plan()
    labels = [c.label for c in device.conditions]
    assert len(labels) == len(set(labels)) and labels[0] == "torch bf16"
    sm90 = [k for k in plan.OUR_KERNELS if k == "auto" or "sm_90a" in KERNELS[k].archs]
    assert set(sm90) == {"auto", "cute_sm90", "triton", "xqa_sm120"}  # xqa_sm120 has an sm_90a build
    for kernel in sm90:
        for kv in ("bf16", "fp8"):
            assert f"CUTE_MLA[{kernel}] kv={kv} graphs" in labels
    for peer in plan.PEER_BACKENDS:
        assert f"{peer} kv=bf16 graphs" in labels
        assert (f"{peer} kv=fp8 graphs" in labels) == (peer not in plan.NO_FP8)
    extra = {c.label for c in device.conditions if c.mode == "eager" or c.spec}
    assert extra == {f"{name} kv={kv} {mode}" for name in ("CUTE_MLA[auto]", "FLASHMLA") for kv in ("bf16", "fp8")
                     for mode in ("eager", "graphs spec3")}
    assert max(i for i, c in enumerate(device.conditions) if c.ours and c.mode == "graphs" and not c.spec) < min(
        i for i, c in enumerate(device.conditions) if c.backend in plan.PEER_BACKENDS)
    assert device.lengths == (1024, 4096, 8192) and device.budget_s < 9 * 60  # one device call, 10 minutes at most
    # the flags filter the plan; the torch condition (no cache, no mode) only by backend
    picked = plan.select(device.conditions, ["CUTE_MLA", "torch"], ["auto"], ["fp8"], ["graphs"], [0])
    assert [c.label for c in picked] == ["torch bf16", "CUTE_MLA[auto] kv=fp8 graphs"]
    out = subprocess.run([sys.executable, "-m", "mla_backend_plugin.evals", "--dry-run", "--plan", "device",
                          "--jobs", "8"], capture_output=True, text=True, check=True).stdout
    assert f"plan device: {len(labels)} conditions" in out and "8 at once" in out
    assert out.splitlines()[1:] == [f"  {label}" for label in labels]


def test_worker_env_and_engine_args():
    """Each engine: its own kernel (an inherited CUTE_MLA_KERNEL does not leak into auto), its own vLLM cache,
    the engine in-process; the same fixed KV cache and engine arguments whatever --jobs is."""
    auto = plan.Condition("CUTE_MLA", "auto", "fp8", "graphs", 0)
    triton = plan.Condition("CUTE_MLA", "triton", "auto", "eager", 3)
    os.environ["CUTE_MLA_KERNEL"] = "reference"
    try:
        assert "CUTE_MLA_KERNEL" not in worker.worker_env(auto, 1, "/c0")
        env = worker.worker_env(triton, 8, "/c1")
    finally:
        del os.environ["CUTE_MLA_KERNEL"]
    assert env["CUTE_MLA_KERNEL"] == "triton" and env["VLLM_CACHE_ROOT"] == "/c1"
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and int(env["OMP_NUM_THREADS"]) >= 1
    hf = hf_config(tasks.VOCAB_SIZE)
    kwargs = worker.engine_kwargs(triton, hf, 8192)
    assert kwargs["enforce_eager"] and kwargs["speculative_config"]["num_speculative_tokens"] == 3
    # 32 sequences of 8208 tokens x the layers x 576 values x 2 bytes fit, with room for lookahead slots
    need = 32 * 8208 * hf["num_hidden_layers"] * 576 * 2
    assert need < kwargs["kv_cache_memory_bytes"] < 2 * need
    assert worker.engine_kwargs(auto, hf, 8192)["kv_cache_memory_bytes"] == kwargs["kv_cache_memory_bytes"]


def _tiny_model(seed: int = 0) -> EvalModel:
    torch.manual_seed(seed)
    model = EvalModel(EvalModelConfig.from_hf(hf_config(tasks.VOCAB_SIZE, hidden_size=64, intermediate_size=64,
                                                         num_hidden_layers=1)))
    for p in model.parameters():
        p.data.normal_(0, 0.3)  # far from uniform: greedy answers differ between problems
    return model.eval()


def test_torch_reference_is_greedy_decoding_and_teacher_forcing():
    """TorchReference's greedy answers (start from the right answer, repair the first wrong token) equal
    token-by-token greedy decoding, for answers the model gets wrong and ones it gets right; its log-probabilities
    along any answer equal the model's on the prompt plus that answer, however the passes are batched."""
    import dataclasses

    model = _tiny_model()
    problems = tasks.eval_problems("retrieve", 64, 3) + tasks.eval_problems("hop2", 96, 3)
    greedy = [greedy_answer(model, p.prompt, len(p.answer)) for p in problems]
    assert any(g != p.answer for g, p in zip(greedy, problems))
    solved = [dataclasses.replace(p, answer=g) for p, g in zip(problems, greedy)]  # the model "solves" these
    for probs in (problems, solved, problems[:2] + solved[2:]):
        for batch_tokens in (1, 4096):
            ref = reference.TorchReference(model, probs, torch.device("cpu"), batch_tokens=batch_tokens)
            assert ref.greedy() == greedy
    ref = reference.TorchReference(model, problems, torch.device("cpu"))
    answers = [p.answer for p in problems[:3]] + [greedy[3][:1], [], greedy[5]]
    for p, gen, lp in zip(problems, answers, ref.logprobs(answers)):
        assert lp.shape == (len(gen), tasks.VOCAB_SIZE)
        if gen:
            with torch.no_grad():
                direct = torch.log_softmax(model(torch.tensor([p.prompt + gen[:-1]]))[0, len(p.prompt) - 1:], -1)
            torch.testing.assert_close(lp, direct, rtol=1e-5, atol=1e-5)


def test_score_kl_over_finite_vectors():
    ref = torch.log_softmax(torch.randn(3, 8, generator=torch.Generator().manual_seed(0)), -1)
    test = ref.clone()
    test[1] += 0.1 * torch.arange(8)
    test[1] = torch.log_softmax(test[1], -1)
    test[2, 0] = -math.inf  # a vector vLLM did not return whole: not compared
    p = tasks.Problem("retrieve", [0], [1, 2, 3], 0)
    s = stats.score([p], [{"tokens": [1, 2, 4], "logprobs": test}], [ref])
    assert s["hits"] == 0 and s["kl_tokens"] == 2 and s["kl_max"] == pytest.approx(stats.kl_divergence(ref[1], test[1]))
    assert s["kl_mean"] == pytest.approx(s["kl_max"] / 2)


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_runner_jobs_timeouts_budget(tmp_path):
    """At most --jobs processes at once, started in order; a failure's last error line; an overdue process group
    killed; one the budget ends is "cut"; nothing started when too little of the budget is left."""
    import time

    runs = [runner.Run("sleep", _python("import time; time.sleep(1)"), None, str(tmp_path / "0.log")),
            runner.Run("fail", _python("import sys; print('RuntimeError: boom'); print('exiting'); sys.exit(3)"),
                       None, str(tmp_path / "1.log")),
            runner.Run("hang", _python("import subprocess, time; print(subprocess.Popen(['sleep', '60']).pid, "
                                       "flush=True); time.sleep(60)"), None, str(tmp_path / "2.log")),
            runner.Run("quick", _python("print('done')"), None, str(tmp_path / "3.log"))]
    procs = runner.Runner(runs, jobs=2, timeout_s=3)
    start, most = time.monotonic(), 0
    while not procs.done():
        procs.poll()
        most = max(most, sum(r.status == "running" for r in runs))
        time.sleep(0.05)
    assert most == 2 and time.monotonic() - start < 15
    assert [r.status for r in runs] == ["ok", "failed", "timeout", "ok"]
    assert runs[1].detail == "exit 3: RuntimeError: boom" and runs[2].proc.returncode == -signal.SIGTERM
    assert (tmp_path / "3.log").read_text() == "done\n"
    child = int((tmp_path / "2.log").read_text().split()[0])  # the hung process's own child died with its group
    stat = pathlib.Path(f"/proc/{child}/stat")
    assert not stat.exists() or stat.read_text().split(")")[-1].split()[0] == "Z"  # gone, or a zombie of init
    late = [runner.Run(name, _python("import time; time.sleep(1.5)"), None, str(tmp_path / f"{name}.log"))
            for name in ("first", "second")]
    procs = runner.Runner(late, jobs=1, timeout_s=60, deadline=time.monotonic() + 2.5, min_start_s=2)
    while not procs.done():
        procs.poll()
        time.sleep(0.05)
    assert [r.status for r in late] == ["ok", "skipped"]
    # the budget ending a condition before its own timeout is "cut", not "timeout": no verdict on it
    slow = [runner.Run("slow", _python("import time; time.sleep(30)"), None, str(tmp_path / "slow.log"))]
    procs = runner.Runner(slow, jobs=1, timeout_s=60, deadline=time.monotonic() + 1.0, min_start_s=0.5)
    while not procs.done():
        procs.poll()
        time.sleep(0.05)
    assert slow[0].status == "cut" and slow[0].detail.startswith("the run's time budget ended it")


def test_eval_end_to_end_with_the_torch_condition(tmp_path):
    """The whole eval on the CPU with the one condition that needs no vLLM (the model in torch bf16, in its
    worker process): the reference's rows, the condition's rows, its log and the outputs."""
    import json

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    hf = hf_config(tasks.VOCAB_SIZE, hidden_size=64, intermediate_size=64, num_hidden_layers=1)
    (model_dir / "config.json").write_text(json.dumps(hf))
    _tiny_model().save_hf(str(model_dir))
    out = tmp_path / "out"
    code = evals_main.main(["--model", str(model_dir), "--backends", "torch", "--lengths", "64,128", "--problems", "3",
                    "--jobs", "2", "--out", str(out)])
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    assert results["runs"] == [{"condition": "torch bf16", "status": "ok", "seconds": results["runs"][0]["seconds"],
                                "log": "logs/00_torch_bf16.log", "detail": ""}]
    rows = results["rows"]
    assert [(r["condition"], r["task"], r["length"]) for r in rows] == [
        (name, t, n) for name in ("reference", "torch bf16") for t in tasks.TASKS for n in (64, 128)]
    for r in rows:
        assert r["n"] == 3 and r["kl_tokens"] == 3 * (3 if r["task"] == "retrieve" else 2)
        # bf16 arithmetic moves the distributions a little, never nothing, never much
        assert (r["kl_mean"] == 0) if r["condition"] == "reference" else (0 < r["kl_mean"] < 1e-2)
    assert (out / "logs" / "00_torch_bf16.log").exists() and (out / "results.md").exists()


SHIPPED_WEIGHTS = os.path.join(MODEL_DIR, "model.safetensors")


@pytest.mark.skipif(not os.path.exists(SHIPPED_WEIGHTS),
                    reason=f"the trained eval model is not in the package yet: no {SHIPPED_WEIGHTS} "
                           "(python -m mla_backend_plugin.evals.train --out mla_backend_plugin/evals/model)")
def test_shipped_model_solves_problems_with_the_reference_attention():
    """The shipped weights in plain torch (float32, the expanded attention of model.py) solve held-out problems
    at short context by greedy decoding: the model really works (chance is 1 in 512 per answer token). Its config
    is the one vLLM loads: DeepSeek's MLA dims, a head count our kernels take, the eval vocabulary."""
    import json

    with open(os.path.join(MODEL_DIR, "config.json")) as f:
        hf = json.load(f)
    assert hf["architectures"] == ["DeepseekV3ForCausalLM"] and hf["vocab_size"] == tasks.VOCAB_SIZE
    assert hf["kv_lora_rank"] == 512 and hf["qk_rope_head_dim"] == 64 and hf["num_attention_heads"] in (16, 32, 64, 128)
    assert os.path.getsize(SHIPPED_WEIGHTS) <= 25 * 2**20
    model = EvalModel.load_hf(MODEL_DIR)
    for task in tasks.TASKS:
        problems = tasks.eval_problems(task, 256, 8)
        solved = sum(greedy_answer(model, p.prompt, len(p.answer)) == p.answer for p in problems)
        assert solved >= 6, f"{task} at 256 tokens: {solved} of 8 solved"


@pytest.mark.parametrize("rope_scaling", [None, "deepseek_v3"])
def test_rope_and_softmax_scale_are_vllms(rope_scaling):
    """The model's rope (YaRN as DeepSeek-V3 configures it, or none) equals vLLM's own rotary embedding for
    DeepSeek (get_rope with rope_type deepseek_yarn, not neox), at positions across and past the original 4096,
    and the softmax scale equals the one vLLM's DeepSeek attention computes."""
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.rotary_embedding import get_rope

    from mla_backend_plugin.evals.model import DEEPSEEK_V3_YARN, yarn_mscale

    scaling = DEEPSEEK_V3_YARN if rope_scaling else None
    hf = hf_config(tasks.VOCAB_SIZE, rope_scaling=scaling)
    c = EvalModelConfig.from_hf(hf)
    params = ({**{k: v for k, v in scaling.items() if k != "type"}, "rope_type": "deepseek_yarn"} if scaling
              else {"rope_type": "default", "rope_theta": c.rope_theta})
    if scaling:
        params["rope_theta"] = c.rope_theta
    positions = torch.tensor([0, 1, 17, 1000, 4095, 4096, 8191, 16000])
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(len(positions), 4, c.qk_rope_head_dim, generator=gen)  # as DeepSeek calls it: [T, H, 64]
    k = torch.randn(len(positions), 1, c.qk_rope_head_dim, generator=gen)
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config

    # vLLM's custom ops read the current config when built
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        rope = get_rope(c.qk_rope_head_dim, max_position=hf["max_position_embeddings"], rope_parameters=params,
                        is_neox_style=False, dtype=torch.float32)
        q_vllm, k_vllm = rope.forward_native(positions, q.clone(), k.clone())
    cos, sin = rope_cos_sin(positions, c)
    q_ours = apply_rope(q.transpose(0, 1), cos, sin).transpose(0, 1)  # ours: [..., T, 64]
    torch.testing.assert_close(q_ours, q_vllm, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(apply_rope(k[:, 0], cos, sin), k_vllm[:, 0], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(q_ours, q, atol=1e-2)  # it rotated
    # vLLM's DeepseekV2(MLA)Attention: scaling = qk_head_dim ** -0.5, times yarn_mscale(factor, mscale_all_dim) ** 2
    m = yarn_mscale(scaling["factor"], scaling["mscale_all_dim"]) if scaling else 1.0
    assert c.softmax_scale == pytest.approx(c.qk_head_dim ** -0.5 * m * m)
    if scaling:
        assert m > 1.3 and hf["max_position_embeddings"] == 163840


def test_training_plan_is_a_function_of_the_step_and_a_cut_run_repeats(tmp_path):
    """train.py: a step's (length, sequences) depend on the step index and seed alone; the curriculum holds 256
    tokens, then reaches --max-len by --grow-until; --stop-after ends a plan where a time cap once did."""
    import argparse
    import json

    from mla_backend_plugin.evals import train

    args = argparse.Namespace(max_len=8192, short_share=0.2, grow_until=0.7, seed=0, tokens_per_step=65536)
    plans = [train.step_plan(s, 1000, args) for s in range(1000)]
    assert plans == [train.step_plan(s, 1000, args) for s in reversed(range(1000))][::-1]
    assert max(p[0] for p in plans[:200]) <= 256 and max(p[0] for p in plans[700:]) > 4096
    assert all(length * count <= 65536 or count == 1 for length, count, _ in plans)
    assert len({seed for _, _, seed in plans}) == 1000
    assert train.step_plan(5, 1000, argparse.Namespace(**{**vars(args), "seed": 1})) != plans[5]
    out = tmp_path / "run"
    assert train.main(["--small", "--out", str(out), "--max-len", "256", "--tokens-per-step", "512", "--steps", "8",
                       "--stop-after", "3", "--workers", "0", "--eval-problems", "2", "--device", "cpu"]) == 0
    log = json.loads((out / "train_log.json").read_text())
    assert log["steps_total"] == 8 and log["final"]["step"] == 3
    assert EvalModel.load_hf(str(out)).c.num_hidden_layers == 2


def test_the_model_directory_and_the_message_when_its_weights_are_missing(tmp_path, monkeypatch):
    """The eval model comes from CUTE_MLA_EVAL_MODEL_DIR when set, else the package's model/ (a source install);
    a directory without the weights (the serving wheel ships none) is refused with how to get them, by the
    library call and by the CLI (exit 2) before anything starts."""
    from mla_backend_plugin import evals

    monkeypatch.delenv("CUTE_MLA_EVAL_MODEL_DIR", raising=False)
    assert evals.model_dir() == MODEL_DIR
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("CUTE_MLA_EVAL_MODEL_DIR", str(empty))
    assert evals.model_dir() == str(empty)
    why = evals.missing_model(str(empty))
    for part in (f"no eval model in {empty}", "config.json and model.safetensors", "serving wheel does not ship",
                 "pip install -e .", "CUTE_MLA_EVAL_MODEL_DIR", "python -m mla_backend_plugin.evals.train"):
        assert part in why, (part, why)
    with pytest.raises(FileNotFoundError, match="set CUTE_MLA_EVAL_MODEL_DIR"):
        evals.require_model()
    (empty / "config.json").write_text("{}")
    assert "missing model.safetensors" in evals.missing_model(str(empty))
    proc = subprocess.run([sys.executable, "-m", "mla_backend_plugin.evals", "--backends", "torch", "--lengths", "64",
                           "--problems", "1", "--out", str(tmp_path / "out")], capture_output=True, text=True,
                          env={**os.environ, "CUTE_MLA_EVAL_MODEL_DIR": str(empty)})
    assert proc.returncode == 2 and "The serving wheel does not ship the eval weights" in proc.stderr, proc.stderr
    assert f"model {empty}" in proc.stdout
    assert evals.require_model(MODEL_DIR) == MODEL_DIR or not os.path.exists(SHIPPED_WEIGHTS)


def test_widened_heads_are_the_same_function(tmp_path):
    """widen_heads repeats each attention head (q_proj and kv_b_proj rows, o_proj columns / factor): the checkpoint
    has factor x the heads and computes the same logits (float64), so TP can split it where the original cannot."""
    import json

    hf = hf_config(tasks.VOCAB_SIZE, hidden_size=64, intermediate_size=64, num_hidden_layers=2)
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(hf))
    torch.manual_seed(3)
    model = EvalModel(EvalModelConfig.from_hf(hf))
    for p in model.parameters():
        p.data.normal_(0, 0.3)
    model.save_hf(str(src), dtype=torch.float32)
    from mla_backend_plugin.evals.model import widen_heads

    assert widen_heads(str(src), str(dst), 2) == str(dst)
    wide_hf = json.loads((dst / "config.json").read_text())
    assert wide_hf["num_attention_heads"] == wide_hf["num_key_value_heads"] == 32
    narrow = EvalModel.load_hf(str(src), dtype=torch.float64)
    wide = EvalModel.load_hf(str(dst), dtype=torch.float64)
    assert wide.c.num_attention_heads == 32 and wide.c.softmax_scale == narrow.c.softmax_scale
    tokens = torch.tensor([tasks.make_problem("hop2", 96, 1).prompt])
    with torch.no_grad():
        torch.testing.assert_close(wide(tokens), narrow(tokens), rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="allowed: an integer >= 1"):
        widen_heads(str(src), str(tmp_path / "x"), 0)


def test_parallel_layouts_conditions_and_refusals():
    """Every vLLM condition under each (TP, DCP, interleave) where DCP divides TP, labelled by its layout (one GPU
    keeps today's labels); speculation with an interleave > 1 only for CUTE_MLA (vLLM 0.26 refuses the peers);
    layouts CUTE_MLA cannot run are refused naming the options and the allowed values; the engine arguments."""
    layouts = plan.parallel_layouts([1, 2], [1, 2], [1, 64])
    assert layouts == ((1, 1, 1), (2, 1, 1), (2, 2, 1), (2, 2, 64))
    with pytest.raises(ValueError, match="no combination where the DCP size divides the TP size"):
        plan.parallel_layouts([1], [2], [1])
    base = plan.conditions(["CUTE_MLA", "FLASHMLA"], ["auto"], ["auto"], ["graphs"], [0, 3])
    conds = plan.with_layouts([plan.TORCH_CONDITION] + base, layouts)
    labels = [c.label for c in conds]
    assert labels[:5] == ["torch bf16", "CUTE_MLA[auto] kv=bf16 graphs", "CUTE_MLA[auto] kv=bf16 graphs tp2",
                          "CUTE_MLA[auto] kv=bf16 graphs tp2 dcp2 i1", "CUTE_MLA[auto] kv=bf16 graphs tp2 dcp2 i64"]
    assert "CUTE_MLA[auto] kv=bf16 graphs spec3 tp2 dcp2 i64" in labels
    assert "FLASHMLA kv=bf16 graphs spec3 tp2 dcp2 i1" in labels
    assert "FLASHMLA kv=bf16 graphs spec3 tp2 dcp2 i64" not in labels
    assert plan.with_layouts(base, plan.SINGLE_GPU) == base
    plan.check_layouts(conds, 32)  # the 16-head model widened x2: 16 per rank at TP 2, 32 per call under DCP 2
    assert plan.layout_problem("FLASHMLA", 16, 2, 1) is None  # vLLM's backends take 8 heads per rank
    assert "query heads per call" in plan.layout_problem("CUTE_MLA", 16, 2, 1)
    assert "allowed backends under DCP" in plan.layout_problem("CUTLASS_MLA", 128, 2, 2)
    assert plan.conditions(["CUTLASS_MLA"], [], ["auto"], ["graphs"], [0], ((2, 2, 1),)) == []
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 2 --decode-context-parallel-size 1: CUTE_MLA would "
                                         r"decode 16 heads / 2 x 1 = 8 query heads per call; allowed: 16, 32, 64, "
                                         r"128\. With 16 heads, \(TP, DCP\) in \[\(1, 1\), \(2, 2\).*; "
                                         r"--widen-heads multiplies the heads"):
        plan.check_layouts(conds, 16)
    plan.check_layouts([c for c in conds if not c.ours or c.dcp == c.tp], 16)  # the peers take 8 heads per rank
    with pytest.raises(ValueError, match="--decode-context-parallel-size 1: the model's 6 attention heads do not"):
        plan.check_layouts([plan.Condition("FLASHMLA", "-", "auto", "graphs", 0, 4, 1, 1)], 6)
    with pytest.raises(ValueError, match="--cp-kv-cache-interleave-size 8: .* allowed: 1, 16, 32, 64, 128"):
        plan.check_layouts([plan.Condition("CUTE_MLA", "auto", "auto", "graphs", 0, 2, 2, 8)], 32)
    hf = hf_config(tasks.VOCAB_SIZE)
    dcp = worker.engine_kwargs(plan.Condition("CUTE_MLA", "auto", "fp8", "graphs", 3, 2, 2, 64), hf, 4096)
    assert (dcp["tensor_parallel_size"], dcp["decode_context_parallel_size"], dcp["cp_kv_cache_interleave_size"],
            dcp["block_size"]) == (2, 2, 64, 64)
    tp = worker.engine_kwargs(plan.Condition("CUTE_MLA", "auto", "fp8", "graphs", 0, 2), hf, 4096)
    assert tp["tensor_parallel_size"] == 2 and "decode_context_parallel_size" not in tp and "block_size" not in tp
    one = worker.engine_kwargs(plan.Condition("CUTE_MLA", "auto", "fp8", "graphs", 0), hf, 4096)
    assert not {"tensor_parallel_size", "decode_context_parallel_size", "block_size"} & set(one)
    out = subprocess.run([sys.executable, "-m", "mla_backend_plugin.evals", "--dry-run", "--backends", "CUTE_MLA",
                          "--kernels", "auto", "--modes", "graphs", "--spec", "0", "--kv-dtypes", "auto",
                          "--tensor-parallel-size", "1,2", "--decode-context-parallel-size", "1,2"],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "8 query heads per call" in out.stderr, out.stderr
    out = subprocess.run([sys.executable, "-m", "mla_backend_plugin.evals", "--dry-run", "--backends", "CUTE_MLA",
                          "--kernels", "auto", "--modes", "graphs", "--spec", "0", "--kv-dtypes", "auto",
                          "--tensor-parallel-size", "1,2", "--decode-context-parallel-size", "1,2",
                          "--widen-heads", "2"], capture_output=True, text=True, check=True).stdout
    assert "with each head x2" in out and out.splitlines()[1:] == [
        "  CUTE_MLA[auto] kv=bf16 graphs", "  CUTE_MLA[auto] kv=bf16 graphs tp2",
        "  CUTE_MLA[auto] kv=bf16 graphs tp2 dcp2 i1"]


def test_verdicts_judge_a_dcp_condition_against_the_same_without_dcp():
    def row(cond, hits, kl, tp=1, dcp=1, interleave=1, backend="CUTE_MLA"):
        return {"condition": cond, "backend": backend, "kernel": "auto" if backend == "CUTE_MLA" else "-",
                "ours": backend == "CUTE_MLA", "kv_dtype": "auto", "mode": "graphs", "spec": 0, "tp": tp, "dcp": dcp,
                "interleave": interleave, "task": "retrieve", "length": 1024, "hits": hits, "n": 100,
                "accuracy": hits / 100, "kl_mean": kl}
    one, tp2 = row("one", 90, 1e-3), row("tp2", 90, 2e-3, tp=2)
    good = row("tp2 dcp2", 89, 3e-3, tp=2, dcp=2)
    assert stats.dcp_twin(good, [one, tp2, good]) is tp2 and stats.dcp_twin(good, [one, good]) is one
    assert stats.dcp_twin(good, [good, row("peer", 90, 1e-3, backend="FLASHMLA")]) is None
    assert stats.verdicts([one, tp2, good]) == []
    worse = row("tp2 dcp2 i64", 60, 5e-3, tp=2, dcp=2, interleave=64)
    found = stats.verdicts([one, tp2, worse])
    assert len(found) == 2 and "below tp2 0.900 without DCP" in found[0] and "> 2.0 x tp2's" in found[1], found
    tiny = [row("tp2", 90, 1e-5, tp=2), row("tp2 dcp2", 90, 5e-4, tp=2, dcp=2)]  # both negligible
    assert stats.verdicts(tiny) == []
