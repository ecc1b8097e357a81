"""Model-level accuracy evals of the MLA decode backends (issue 12).

Dummy-weight runs prove little: every backend generates the same repeating tokens and attention is nearly
uniform. This package ships a small DeepSeek-V3-architecture model (``model/``: MLA exactly as vLLM loads it,
kv_lora_rank 512, rope 64, 16 heads, dense MLP) trained by ``train.py`` on a synthetic long-context retrieval
task (``tasks.py``) that cannot be solved without attending precisely and far back, and an eval
(``python -m mla_backend_plugin.evals``) that runs it through vLLM on every backend and compares accuracy and
next-token distributions with a float32 reference of the same model (``model.py``, plain torch).

The trained weights (``model/model.safetensors``) are in the source tree, not in the serving wheel: a source or
editable install finds them in the package, anything else at ``CUTE_MLA_EVAL_MODEL_DIR`` (``model_dir``).

Nothing here is imported by the kernel API or the vLLM plugin.
"""

import os

MODEL_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "model")  # the package's (source tree) copy
WEIGHTS = "model.safetensors"


def model_dir() -> str:
    """The eval model's directory: ``CUTE_MLA_EVAL_MODEL_DIR`` when set, else the package's ``model/``."""
    from mla_backend_plugin import envs

    return envs.CUTE_MLA_EVAL_MODEL_DIR or MODEL_DIR


def missing_model(directory: str) -> str | None:
    """Why ``directory`` cannot serve as the eval model (None: it can), and how to get the weights."""
    missing = [name for name in ("config.json", WEIGHTS) if not os.path.isfile(os.path.join(directory, name))]
    if not missing:
        return None
    return (f"no eval model in {directory} (missing {' and '.join(missing)}). The serving wheel does not ship the "
            f"eval weights: install mla_backend_plugin from its source tree (pip install -e . in a clone of the "
            f"repository; mla_backend_plugin/evals/model/ holds them), or set CUTE_MLA_EVAL_MODEL_DIR (or pass "
            f"--model) to a directory holding config.json and {WEIGHTS}, e.g. that folder of a clone; or train "
            f"one: python -m mla_backend_plugin.evals.train --out DIR")


def require_model(directory: str | None = None) -> str:
    """``directory`` (default: ``model_dir()``) when it holds the eval model; FileNotFoundError saying how to get
    the weights when it does not."""
    directory = directory or model_dir()
    why = missing_model(directory)
    if why:
        raise FileNotFoundError(why)
    return directory
