"""First-use self-check of kernels on unverified architectures (ops/selfcheck.py, api.select_kernel's gate), on CPU.

Fake kernels stand in for a compiled one: the reference (correct), one that leaves a row unwritten, one that
is slightly wrong, one that raises. The registry is pointed at them with a pretend SM120 device.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mla_backend_plugin.ops import api, registry, selfcheck
from mla_backend_plugin.ops.api import mla_decode
from mla_backend_plugin.testing import SOFTMAX_SCALE, make_decode_inputs

REFERENCE = registry.KERNELS["reference"]
GOOD = dataclasses.replace(REFERENCE, name="good", verified_archs=frozenset())


def _skips_last_row(args, workspace, config):
    REFERENCE.launch(args, workspace, config)
    args.out[-1].fill_(float("nan"))


def _slightly_wrong(args, workspace, config):
    REFERENCE.launch(args, workspace, config)
    args.out.mul_(1.1)


def _raises(args, workspace, config):
    raise RuntimeError("illegal instruction")


def _reads_whole_last_page(args, workspace, config):
    """Attends over the whole last page of each request, slots past its length included (masked or not, a
    NaN there reaches the output once it is multiplied into V)."""
    import copy

    page = args.kv_cache.shape[1]
    padded = copy.copy(args)
    padded.seq_lens = (args.seq_lens + page - 1) // page * page
    REFERENCE.launch(padded, workspace, config)


BAD = {name: dataclasses.replace(REFERENCE, name=name, launch=fn, verified_archs=frozenset())
       for name, fn in (("unwritten", _skips_last_row), ("wrong", _slightly_wrong), ("raises", _raises),
                        ("reads_tail", _reads_whole_last_page))}


@pytest.fixture(autouse=True)
def fresh_results(monkeypatch):
    selfcheck.clear_results()
    api._WARNED.clear()
    monkeypatch.delenv(selfcheck.SELF_CHECK_ENV_VAR, raising=False)
    yield
    selfcheck.clear_results()


@pytest.fixture
def fake_sm120(monkeypatch):
    kernels = {"reference": REFERENCE, "good": GOOD, **BAD}  # the reference: what the self-check compares with
    monkeypatch.setattr(registry, "KERNELS", kernels)
    monkeypatch.setattr(registry, "AUTO_ORDER", {12: ("unwritten", "wrong", "raises", "reads_tail", "good")})
    monkeypatch.setattr(registry, "device_capability", lambda device: (12, 0))
    return kernels


def test_reference_passes_its_own_check():
    assert selfcheck.run_self_check(GOOD, torch.device("cpu")) is None


@pytest.mark.parametrize("name,expected", [("unwritten", "NaN/inf in out"), ("wrong", "beyond atol"),
                                           ("raises", "raised RuntimeError: illegal instruction"),
                                           ("reads_tail", "NaN/inf in out")])
def test_broken_kernels_fail_with_a_reason(name, expected):
    reason = selfcheck.run_self_check(BAD[name], torch.device("cpu"))
    assert reason is not None and expected in reason, reason


def _inputs():
    return make_decode_inputs(batch=2, seq_lens=[9, 40], q_len=1, num_heads=16, block_size=16,
                              kv_dtype=torch.bfloat16, q_form="pair", device="cpu", seed=3)


def test_auto_skips_kernels_that_fail_and_warns(fake_sm120):
    inp = _inputs()
    with pytest.warns(RuntimeWarning, match="failed its self-check") as record:
        out, lse = mla_decode(inp.q, inp.kv_cache, inp.block_table, inp.seq_lens, softmax_scale=SOFTMAX_SCALE)
    assert len(record) == 4  # unwritten, wrong, raises, reads_tail: each skipped once
    ref_out, ref_lse = inp.reference()
    torch.testing.assert_close(out.float(), ref_out, atol=1e-2, rtol=1e-2)
    # results are cached: no new warnings, no new checks
    with warnings_as_errors():
        mla_decode(inp.q, inp.kv_cache, inp.block_table, inp.seq_lens, softmax_scale=SOFTMAX_SCALE)


def test_explicit_kernel_that_fails_raises(fake_sm120):
    inp = _inputs()
    with pytest.raises(RuntimeError, match=r"kernel 'wrong' failed its self-check on compute capability \(12, 0\)"):
        mla_decode(inp.q, inp.kv_cache, inp.block_table, inp.seq_lens, softmax_scale=SOFTMAX_SCALE,
                   kernel="wrong")


def test_no_kernel_left_is_an_error(fake_sm120, monkeypatch):
    monkeypatch.setattr(registry, "AUTO_ORDER", {12: ("wrong",)})
    inp = _inputs()
    with pytest.warns(RuntimeWarning), pytest.raises(ValueError, match="no kernel supports this call: wrong: failed"):
        mla_decode(inp.q, inp.kv_cache, inp.block_table, inp.seq_lens, softmax_scale=SOFTMAX_SCALE)


def test_modes(fake_sm120, monkeypatch):
    inp = _inputs()
    monkeypatch.setenv(selfcheck.SELF_CHECK_ENV_VAR, "never")  # trust the kernel: it runs, unchecked
    out, _ = mla_decode(inp.q, inp.kv_cache, inp.block_table, inp.seq_lens, softmax_scale=SOFTMAX_SCALE,
                        kernel="wrong")
    assert not torch.allclose(out.float(), inp.reference()[0], atol=1e-2, rtol=1e-2)
    # a verified architecture is not checked in auto mode, and is in always mode
    monkeypatch.setitem(registry.KERNELS, "wrong", dataclasses.replace(BAD["wrong"], verified_archs={(12, 0)}))
    monkeypatch.setenv(selfcheck.SELF_CHECK_ENV_VAR, "auto")
    mla_decode(inp.q, inp.kv_cache, inp.block_table, inp.seq_lens, softmax_scale=SOFTMAX_SCALE, kernel="wrong")
    monkeypatch.setenv(selfcheck.SELF_CHECK_ENV_VAR, "always")
    with pytest.raises(RuntimeError, match="failed its self-check"):
        mla_decode(inp.q, inp.kv_cache, inp.block_table, inp.seq_lens, softmax_scale=SOFTMAX_SCALE,
                   kernel="wrong")
    monkeypatch.setenv(selfcheck.SELF_CHECK_ENV_VAR, "sometimes")
    with pytest.raises(ValueError, match="CUTE_MLA_SELF_CHECK='sometimes': allowed values are auto, always, never"):
        mla_decode(inp.q, inp.kv_cache, inp.block_table, inp.seq_lens, softmax_scale=SOFTMAX_SCALE,
                   kernel="good")


class warnings_as_errors:
    def __enter__(self):
        import warnings

        self._ctx = warnings.catch_warnings()
        self._ctx.__enter__()
        warnings.simplefilter("error")

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)
