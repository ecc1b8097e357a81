"""benchmarks/bench_e2e.py without a GPU: the conditions, the model config it writes, and the report it renders
from rows (the GPU run itself is not exercised here)."""

from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import bench_e2e
    finally:
        sys.path.pop(0)
    return bench_e2e


def test_dry_run_writes_a_deepseek_v3_width_config(tmp_path, capsys):
    bench = _bench()
    args = ["--dry-run", "--out-dir", str(tmp_path), "--backends", "CUTE_MLA,FLASHMLA", "--spec", "0,1"]
    assert bench.main(args) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert len(lines) == 2 * 2 * 2 * 3  # backends x spec x contexts x batches
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    assert config["hidden_size"] == 7168 and config["num_attention_heads"] == 128
    assert config["kv_lora_rank"] == 512 and config["qk_rope_head_dim"] == 64 and config["q_lora_rank"] == 1536
    assert config["num_hidden_layers"] == config["first_k_dense_replace"] == 4


def test_prompts_have_the_context_length():
    bench = _bench()
    for spec in (0, 1):
        prompts = bench._prompts(3, 1000, spec, 0)
        assert len(prompts) == 3 and all(len(p) == 1000 and min(p) >= 2 for p in prompts)


def test_report_from_rows(tmp_path):
    bench = _bench()
    rows = [{"backend": b, "batch": batch, "context": 1024, "spec": 0, "graphs": True, "step_ms": ms,
             "tokens_per_s": round(batch / ms * 1e3, 1), "start_s": 50.0, "builder_us_per_step": 12.5,
             "forward_mqa_us_per_step": 0.0}
            for b, base in (("CUTE_MLA", 1.0), ("FLASH_ATTN_MLA", 0.9)) for batch, ms in ((1, base), (32, 2 * base))]
    rows.append({"backend": "CUTE_MLA", "start": "cold", "start_s": 86.7})
    rows.append({"backend": "TRITON_MLA", "spec": 0, "error": "boom"})
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    md = bench.render(tmp_path).read_text()
    assert "| CUTE_MLA | 1.000 (1000.0) | 2.000 (16000.0) | 12.5 | 0.0 |" in md
    assert "| CUTE_MLA | cold | 86.7 |" in md and "TRITON_MLA: `boom`" in md
    assert (tmp_path / "results.csv").read_text().count("\n") == len(rows) + 1
