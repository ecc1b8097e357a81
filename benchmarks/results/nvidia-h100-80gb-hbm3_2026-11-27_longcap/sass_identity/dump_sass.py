"""Dump the SASS of cute_sm90 variants, as instruction text (addresses and encodings stripped): DIR/<name>.sass.

    CUTE_DSL_ARCH=sm_90a python dump_sass.py DIR [NAME ...]     # no GPU needed; PYTHONPATH picks the tree
"""
import os
import re
import subprocess
import sys
import tempfile

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
from mla_backend_plugin.kernels.cute_common import sass as sass_tools  # noqa: E402
from mla_backend_plugin.kernels.cute_sm90.config import Variant  # noqa: E402
from mla_backend_plugin.kernels.cute_sm90.launch import compile_variant  # noqa: E402

out = sys.argv[1]
os.makedirs(out, exist_ok=True)
base = dict(kv_dtype="bf16", q_dtype="bf16", out_dtype="bf16", num_heads=128, q_len=1, block_size=64,
            q_scale_is_ptr=False, kv_scale_is_ptr=False, fp8_mma=False, row_kv_lens=False)
cases = {"seesaw": dict(schedule="seesaw"), "seesaw32": dict(schedule="seesaw32"),
         "lockstep": dict(schedule="lockstep"),
         "dequant_fp8": dict(schedule="lockstep", kv_dtype="fp8", kv_scale_is_ptr=True),
         "seesaw_q2": dict(schedule="seesaw", q_len=2),
         "seesaw32_q2_bs16": dict(schedule="seesaw32", q_len=2, block_size=16),
         "fp8mma_fp8q": dict(schedule="lockstep", kv_dtype="fp8", q_dtype="fp8", fp8_mma=True, q_scale_is_ptr=True,
                             kv_scale_is_ptr=True),
         "fp16_seesaw_q4_h16": dict(schedule="seesaw", kv_dtype="fp16", q_dtype="fp16", out_dtype="fp16", num_heads=16,
                                    q_len=4),
         "lockstep_q2_bs128": dict(schedule="lockstep", q_len=2, block_size=128),
         "seesaw_rowkv_q2": dict(schedule="seesaw", q_len=2, row_kv_lens=True),
         "seesaw32_fp16_h16": dict(schedule="seesaw32", kv_dtype="fp16", q_dtype="fp16", out_dtype="fp16",
                                   num_heads=16),
         "fp8mma_rowkv_bs16": dict(schedule="lockstep", kv_dtype="fp8", q_dtype="fp8", fp8_mma=True, row_kv_lens=True,
                                   block_size=16, kv_scale_is_ptr=True, q_scale_is_ptr=True),
         "fp8mma_bf16q_q2": dict(schedule="lockstep", kv_dtype="fp8", fp8_mma=True, kv_scale_is_ptr=True, q_len=2)}
only = sys.argv[2:] or list(cases)
for name in only:
    v = Variant(**{**base, **cases[name]})
    with tempfile.TemporaryDirectory() as tmp:
        compiled = compile_variant(v, use_pdl=True, arch="sm_90a", keep_dir=tmp)
        path = sass_tools.write_cubin(compiled, tmp)
        text = subprocess.run([sass_tools.find_cuobjdump(), "-sass", path], capture_output=True, text=True).stdout
    # keep the instructions only (no addresses / encodings / symbol names)
    lines = [re.sub(r"^\s*/\*[0-9a-f]+\*/\s*", "", line).split(";")[0].strip() for line in text.splitlines()
             if re.match(r"^\s*/\*[0-9a-f]{4,}\*/", line)]
    with open(f"{out}/{name}.sass", "w") as f:
        f.write("\n".join(lines) + "\n")
    print(name, len(lines), "instructions", flush=True)
