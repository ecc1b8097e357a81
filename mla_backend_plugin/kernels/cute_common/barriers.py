"""Synchronisation names of the CuTe decode kernels: named-barrier ids, and an mbarrier ring.

Named barriers (``bar.sync id, n``): id 0 is ``__syncthreads``; each kernel's other ids are an ``IntEnum``
here, so no kernel writes a literal id and two roles never share one by accident.

``MbarrierRing`` is ``stages`` mbarriers used round-robin by a producer and its consumers: use ``j`` (tile j)
lives in slot ``j % stages`` at phase ``(j // stages) & 1``; a producer reusing a slot first waits for the
previous use's release (``wait_released``), a consumer waits for the fill (``wait_filled``). It replaces
hand-written slot and phase arithmetic, and generates the same instructions. It is a frozen dataclass: the
DSL passes frozen dataclasses through dynamic ``if``/``for`` bodies unchanged (a mutable object used there is
treated as written and must be a runtime value).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import cutlass.cute as cute


class Sm90DecodeBarrier(enum.IntEnum):
    SYNC_THREADS = 0  # reserved: __syncthreads
    CONSUMERS = 1  # the two consumer warp groups (256 threads): Q in smem, row maxima posted, P written, sums
    # the staggered ("seesaw") schedule, kernels/cute_sm90/kernel_seesaw.py: both groups meet
    SCALE_A = 2  # left group posted tile A's running row maxima -> right group
    SCALE_B = 3  # right group posted tile B's (the pair's final) row maxima -> left group
    P_FULL = 4  # left wrote P_A (rescaled to tile B's maxima) to sP0, right wrote P_B to sP1 -> the SS P V


class Sm100DecodeBarrier(enum.IntEnum):
    """Named barriers of the SM100 decode kernel (one CTA of the pair each)."""

    SYNC_THREADS = 0  # reserved: __syncthreads
    TMEM_PTR = 1  # MMA warp (allocates) + softmax and correction warp groups (read the TMEM address): 288
    SOFTMAX_ROWS = 2  # the softmax warp group: row maxima and sums exchanged between lanes t and t ^ 64: 128
    Q_READY = 3  # correction warps (arrive) wrote Q's per-row scales -> softmax warps (wait) read them: 256
    FINAL_STATS = 4  # softmax warps (arrive) wrote each row's final max and sum -> correction warps (wait): 256


def consumer_barrier(num_threads: int = 256) -> None:
    """Both SM90 consumer warp groups meet."""
    cute.arch.barrier(barrier_id=int(Sm90DecodeBarrier.CONSUMERS), number_of_threads=num_threads)


def consumer_sync(barrier: Sm90DecodeBarrier) -> None:
    """Both SM90 consumer groups meet at a named exchange point (``bar.sync``, 256 threads)."""
    cute.arch.barrier(barrier_id=int(barrier), number_of_threads=256)


@dataclasses.dataclass(frozen=True)
class MbarrierRing:
    base: Any  # shared-memory pointer to ``stages`` consecutive Int64 mbarriers
    stages: int
    arrivals: int  # arrivals that complete one phase

    def init(self) -> None:
        """One thread initialises every slot (then ``mbarrier_init_fence`` and a CTA barrier)."""
        for s in range(self.stages):
            cute.arch.mbarrier_init(self.base + s, self.arrivals)

    def slot(self, j):
        return self.base + j % self.stages

    def phase(self, j):
        return (j // self.stages) & 1

    def wait_filled(self, j) -> None:
        cute.arch.mbarrier_wait(self.slot(j), self.phase(j))

    def wait_released(self, j) -> None:
        """Before use ``j`` refills its slot: the consumers released use ``j - stages`` (passes at once for
        the first ``stages`` uses)."""
        cute.arch.mbarrier_wait(self.slot(j), self.phase(j) ^ 1)

    def arrive(self, j) -> None:
        cute.arch.mbarrier_arrive(self.slot(j))

    def arrive_peer(self, j, peer) -> None:
        """Arrive at the same slot in the shared memory of CTA ``peer`` of this cluster (``mapa``)."""
        cute.arch.mbarrier_arrive(self.slot(j), peer_cta_rank_in_cluster=peer)

    def arrive_expect_tx(self, j, nbytes: int) -> None:
        cute.arch.mbarrier_arrive_and_expect_tx(self.slot(j), nbytes)

