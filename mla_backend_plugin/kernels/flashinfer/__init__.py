"""FlashInfer's Blackwell MLA decode kernels behind our ``mla_decode`` API and workspace (adapters, no kernel of
our own): on SM100/SM103 ``flashinfer.mla.trtllm_batch_decode_with_kv_cache_mla`` with an explicit backend, never
``"auto"`` (which instantiates trtllm-gen and may download its cubins); on SM120/SM121
``flashinfer.decode.xqa_batch_decode_with_kv_cache_mla``.

* ``flashinfer_cute_dsl``: ``backend="cute-dsl"``, the monolithic CuTe-DSL kernel (JIT-compiled by FlashInfer on
  first use, which vLLM's warm-up reaches before graph capture); in ``AUTO_ORDER`` on SM100, before Triton.
* ``flashinfer_trtllm``: ``backend="trtllm-gen"``, precompiled cubins; a candidate only when those are local
  (the ``flashinfer-cubin`` package or ``FLASHINFER_CUBIN_DIR``), since FlashInfer downloads them otherwise.
* ``flashinfer_xqa``: the XQA MLA kernel for SM120/SM121 (JIT-compiled by FlashInfer on first use), a tuner
  candidate beside ``xqa_sm120``, never ``auto``'s choice. It writes no LSE (``writes_lse=False``): the registry
  refuses it every call that needs one (``mla_decode``'s ``return_lse=True``, the default). It takes 128 heads,
  q_len 1, block size 16/32/64/128, q and cache both bf16 or both e4m3, bf16 output, host-float scales; its 8 MiB
  of semaphores and split-KV partials are the head of the same scratch, and a q pair is staged there too.

What the SM100 adapters take (``launch.py`` refuses the rest with the reason): SM100/SM103; q in the cache's dtype
(bf16 with a bf16 cache, e4m3 with an e4m3 cache); bf16 output; scales as host floats (FlashInfer fuses them into its
bmm1/bmm2 scales on the host); trtllm-gen: block size 32 or 64; a block table covering a multiple of 128 tokens;
``row_kv_lens`` (decode context parallelism) only on cute-dsl, as FlashInfer's DCP mode (FlashInfer >= 0.7,
``enable_dcp``), with mla_decode's ``dcp`` layout of interleave 1 (cyclic sharding, the only one it implements).
The kernels share one zero-initialised scratch buffer in our workspace (``MLAWorkspace.scratch_for``): trtllm-gen's
8 MiB of semaphores at its head (zeroed once at allocation, reset by the kernel after every launch), the region
both kernels use for split-KV partials (cute-dsl gets it past the semaphores), and a staging area where a
``(q_nope, q_pe)`` pair, as vLLM passes it, is joined into the one ``[B, q_len, H, 576]`` tensor FlashInfer reads.

Nothing here has run on hardware (no Blackwell GPU in this project): ``verified_archs`` is empty, so every kernel
passes the first-use self-check against the float32 reference before ``auto`` or the tuner uses them (XQA's: its
``out`` alone).
"""

from mla_backend_plugin.ops.manifest import KernelManifest, lazy

_HERE = "mla_backend_plugin.kernels.flashinfer.launch"


def _manifest(name: str, backend: str, description: str, writes_lse: bool = True,
              supports_row_kv_lens: bool = False) -> KernelManifest:
    return KernelManifest(
        name=name,
        description=description,
        archs=(),  # FlashInfer builds (JIT) or ships its kernels itself
        verified_archs=frozenset(),  # never run here: the self-check is the gate
        unsupported_reason=lazy(_HERE, f"unsupported_reason_{backend}"),
        launch=lazy(_HERE, f"launch_{backend}"),
        default_config=lazy(_HERE, "default_config"),
        configs=lazy(_HERE, "configs"),
        plan_tile=None,  # FlashInfer plans its own splits
        combine="own",
        scratch=lazy(_HERE, "scratch"),
        config_label=lazy(_HERE, "config_label"),
        writes_lse=writes_lse,
        supports_row_kv_lens=supports_row_kv_lens,
    )


MANIFESTS = (
    _manifest("flashinfer_cute_dsl", "cute_dsl",
              "FlashInfer CuTe-DSL MLA decode (SM100/103; trtllm_batch_decode_with_kv_cache_mla backend='cute-dsl')",
              supports_row_kv_lens=True),  # as its DCP mode, with mla_decode's dcp layout (launch._dcp_reason)
    _manifest("flashinfer_trtllm", "trtllm",
              "FlashInfer trtllm-gen MLA decode (SM100/103, local cubins only; backend='trtllm-gen')"),
    _manifest("flashinfer_xqa", "xqa",
              "FlashInfer XQA MLA decode (SM120/121; xqa_batch_decode_with_kv_cache_mla; no LSE)", writes_lse=False),
)
