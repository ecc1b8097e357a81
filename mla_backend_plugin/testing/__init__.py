"""What tests, benchmarks, the self-check and the tuner share to check and time kernels.

* ``inputs``: the adversarial decode-input generator (``make_decode_inputs``, ``DecodeInputs``);
* ``tolerances``: the one tolerance table and comparison against the float32 reference;
* ``kernels``: which registry kernels can run here (per-kernel tests); NaN in the serving runner's outputs;
* the timing core is ``mla_backend_plugin.ops.timing`` (the tuner needs it below this layer); re-exported here.

Nothing here is imported by the kernel API at import time.
"""

from mla_backend_plugin.ops.timing import (
    Timing,
    calls_per_graph_for,
    capture_graph,
    kv_copies_for,
    measure_bf16_flops_per_s,
    measure_hbm_bytes_per_s,
    time_graphs,
)
from mla_backend_plugin.testing.inputs import (
    FP8_MAX,
    POISON_16BIT,
    POISON_FP8,
    SOFTMAX_SCALE,
    DecodeInputs,
    draw_seq_lens,
    make_decode_inputs,
    quantize_fp8,
)
from mla_backend_plugin.testing.kernels import (
    kernel_unsupported_reason,
    poison_runner_outputs,
    select_kernel_for_test,
)
from mla_backend_plugin.testing.tolerances import (
    TOLERANCES,
    Comparison,
    Tolerance,
    assert_close_decode,
    compare_decode,
    tolerance_for,
)

__all__ = [
    "FP8_MAX", "POISON_16BIT", "POISON_FP8", "SOFTMAX_SCALE", "TOLERANCES", "Comparison", "DecodeInputs",
    "Timing", "Tolerance", "assert_close_decode", "calls_per_graph_for", "capture_graph", "compare_decode",
    "draw_seq_lens", "kernel_unsupported_reason", "kv_copies_for", "make_decode_inputs",
    "measure_bf16_flops_per_s", "measure_hbm_bytes_per_s", "poison_runner_outputs", "quantize_fp8",
    "select_kernel_for_test",
    "time_graphs", "tolerance_for",
]
