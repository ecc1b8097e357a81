"""CPU model of the split kernel's step time under a plan (ops/plan.py), with which tests and
benchmarks/model_schedules.py compare the plans: CTA costs in launch order, greedy list scheduling onto the SMs,
and the ideal bound.
"""

from __future__ import annotations

import heapq

from mla_backend_plugin.ops.plan import ShareSchedule, SplitPlan, step_schedule, uniform_request_splits


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def makespan(cta_costs, num_sms: int) -> float:
    """Greedy list scheduling in launch order: each CTA goes to the SM that frees first (one resident CTA per
    SM, as for the Triton and CuTe tiles); returns the time the last SM finishes."""
    free = [0.0] * num_sms
    for cost in cta_costs:
        heapq.heappush(free, heapq.heappop(free) + cost)
    return max(free)


def plan_cta_costs(plan: SplitPlan, seq_lens, q_len: int, num_heads: int, block_n: int,
                   cta_overhead: float = 1.5, exit_cost: float = 0.15, longest_first: bool = False) -> list[float]:
    """Cost of every CTA of the split kernel in launch order (x fastest), in units of one KV tile of block_n
    keys: a working CTA costs ``cta_overhead`` (prologue, q load, epilogue) plus its tiles, a CTA that
    exits at once ``exit_cost``. ``longest_first``: the balanced plan's items in a step-planned kernel's order
    (``BalancedSchedule.longest_first``) instead of w's; a share plan's pieces the same way. The combine is not
    modelled."""
    m_blocks = _cdiv(q_len * num_heads, plan.rows_per_cta)
    costs: list[float] = []
    if not plan.balanced:  # grid (B, m_blocks, Z)
        per_request = [uniform_request_splits(int(x), plan.num_splits, plan.min_chunk, block_n) for x in seq_lens]
        for z in range(plan.num_splits):
            for _ in range(m_blocks):
                for x, (n, chunk) in zip(seq_lens, per_request):
                    tiles = _cdiv(max(min(chunk, int(x) - z * chunk), 0), block_n)
                    costs.append(cta_overhead + tiles if z < n else exit_cost)
        return costs
    sched = step_schedule(seq_lens, block_n, plan, plan.device_plan)
    if isinstance(sched, ShareSchedule):  # the share plan's pieces, one CTA each
        order = sched.longest_first() if longest_first else list(range(len(sched.pieces)))
        for r in range(plan.grid_items):
            if r < len(order):
                b, _, t0, t1 = sched.pieces[order[r]]
                tiles = _cdiv(max(min(t1 * block_n, int(seq_lens[b])) - t0 * block_n, 0), block_n)
                costs.extend([cta_overhead + tiles] * m_blocks)
            else:
                costs.extend([exit_cost] * m_blocks)
        return costs
    order = sched.longest_first() if longest_first else list(range(len(sched.items)))
    for r in range(plan.grid_items):  # grid (m_blocks, G)
        if r < len(order):
            b, s = sched.items[order[r]]
            chunk = sched.chunk[b]
            tiles = _cdiv(max(min(chunk, int(seq_lens[b]) - s * chunk), 0), block_n)
            costs.extend([cta_overhead + tiles] * m_blocks)
        else:
            costs.extend([exit_cost] * m_blocks)
    return costs


def ideal_makespan(seq_lens, q_len: int, num_heads: int, rows_per_cta: int, block_n: int, num_sms: int) -> float:
    """Total KV tiles of the step (every m-block reads each tile) spread evenly over the SMs, no overhead."""
    m_blocks = _cdiv(q_len * num_heads, rows_per_cta)
    return m_blocks * sum(max(_cdiv(int(x), block_n), 1) for x in seq_lens) / num_sms
