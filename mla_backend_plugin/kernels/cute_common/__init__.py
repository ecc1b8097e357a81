"""Pieces every CuTe-DSL decode family shares (cute_sm90 and the Blackwell family cute_sm100).

Host side, importable without the DSL (a host that only loads prebuilt kernels has no cutlass):

* ``aot.py``: the on-disk cache of exported kernels (TVM-FFI libraries), generic over families, keyed by a
  fingerprint of the family's folder and this one;
* ``host.py``: dtype names, the DSL-availability check, the launch-time form of the q/kv scales;
* ``sass.py``: the SASS and resource usage of a cubin for the builds' checks (an nvdisasm that decodes the arch).

Device side (import cutlass):

* ``scheduler.py``: the balanced split plan as the device computes it (``BalancedScheduler``), bit for bit
  ``ops/plan.balanced_schedule``;
* ``epilogue.py``: the global-memory half of the epilogue (final output + LSE, or the partial in its slot of
  the workspace) and the dequantisation scales as a kernel reads them;
* ``barriers.py``: named-barrier ids and an mbarrier ring with its phase arithmetic;
* ``compat.py``: what differs between the nvidia-cutlass-dsl versions we support.

Softmax and the MMA pipeline stay per arch (SM90 keeps O in registers, SM100 in tensor memory).
No ``MANIFEST`` here: this is not a kernel family.
"""
