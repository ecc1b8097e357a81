"""float32 torch reference of paged MLA decode (``torch_ref.py``): the ground truth every kernel is tested
against, and a kernel of the registry that runs anywhere (slowly, never inside a CUDA graph)."""

from mla_backend_plugin.kernels.reference.torch_ref import mla_decode_reference
from mla_backend_plugin.ops.manifest import KernelManifest, LaunchConfig


def _launch(args, workspace, config) -> None:
    out, lse = mla_decode_reference(args.q_nope, args.q_pe, args.kv_cache, args.block_table, args.seq_lens,
                                    args.q_len, args.softmax_scale, args.q_scale, args.kv_scale,
                                    row_kv_lens=args.row_kv_lens)
    args.out.copy_(out)
    args.lse.copy_(lse)


_ONLY = LaunchConfig(enable_pdl=False)

MANIFEST = KernelManifest(
    name="reference",
    description="float32 torch reference (slow, host loop, not CUDA-graph safe)",
    archs=(),
    verified_archs=None,
    unsupported_reason=lambda args, cc: None,
    launch=_launch,
    default_config=lambda args, cc: _ONLY,
    configs=lambda args, cc: [_ONLY],
    plan_tile=None,
    combine="none",
    supports_row_kv_lens=True,
)

__all__ = ["MANIFEST", "mla_decode_reference"]
