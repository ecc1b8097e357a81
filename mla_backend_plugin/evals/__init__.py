"""Model-level accuracy evals of the MLA decode backends (issue 12).

Dummy-weight runs prove little: every backend generates the same repeating tokens and attention is nearly
uniform. This package ships a small DeepSeek-V3-architecture model (``model/``: MLA exactly as vLLM loads it,
kv_lora_rank 512, rope 64, 16 heads, dense MLP) trained by ``train.py`` on a synthetic long-context retrieval
task (``tasks.py``) that cannot be solved without attending precisely and far back, and an eval
(``python -m mla_backend_plugin.evals``) that runs it through vLLM on every backend and compares accuracy and
next-token distributions with a float32 reference of the same model (``model.py``, plain torch).

Nothing here is imported by the kernel API or the vLLM plugin.
"""

import os

MODEL_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "model")
