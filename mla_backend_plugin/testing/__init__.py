"""What tests and benchmarks share to check and time kernels: the shelf beside the floors (ops/ never imports it).

* the adversarial decode-input generator (``make_decode_inputs``, ``DecodeInputs``: ops/inputs.py), the one
  tolerance table and comparison against the float32 reference (ops/tolerances.py) and the timing core
  (ops/timing.py): the self-check and the tuner need them below this layer, so they live in ops/ and are
  re-exported here; ``inputs``: ragged lengths (``draw_seq_lens``), a graph replayed on new inputs
  (``replay_with``); ``tolerances``: ``assert_close_decode``;
* ``kernels``: which registry kernels can run here (per-kernel tests); NaN in the serving runner's outputs;
* ``reference_check``: an engine's decode calls recomputed with the reference (``CUTE_MLA_CHECK_DIR``);
* ``schedule_model``: the CPU model of a split plan's step time; ``dcp``: decode context parallelism simulated.
"""

from mla_backend_plugin.ops.inputs import (
    FP8_MAX,
    POISON_16BIT,
    POISON_FP8,
    SOFTMAX_SCALE,
    DecodeInputs,
    make_decode_inputs,
    quantize_fp8,
)
from mla_backend_plugin.ops.timing import (
    Timing,
    calls_per_graph_for,
    capture_graph,
    kv_copies_for,
    measure_bf16_flops_per_s,
    measure_hbm_bytes_per_s,
    time_graphs,
)
from mla_backend_plugin.ops.tolerances import TOLERANCES, Comparison, Tolerance, compare_decode, tolerance_for
from mla_backend_plugin.testing.inputs import draw_seq_lens, replay_with
from mla_backend_plugin.testing.kernels import (
    kernel_unsupported_reason,
    poison_runner_outputs,
    select_kernel_for_test,
)
from mla_backend_plugin.testing.tolerances import assert_close_decode

__all__ = [
    "FP8_MAX", "POISON_16BIT", "POISON_FP8", "SOFTMAX_SCALE", "TOLERANCES", "Comparison", "DecodeInputs",
    "Timing", "Tolerance", "assert_close_decode", "calls_per_graph_for", "capture_graph", "compare_decode",
    "draw_seq_lens", "kernel_unsupported_reason", "kv_copies_for", "make_decode_inputs",
    "measure_bf16_flops_per_s", "measure_hbm_bytes_per_s", "poison_runner_outputs", "quantize_fp8",
    "replay_with", "select_kernel_for_test",
    "time_graphs", "tolerance_for",
]
