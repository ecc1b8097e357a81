"""The combine's prepared Triton launch (kernels/combine/kernel.py ``prepared_launch``) without a GPU: a launch
whose specialisation was launched before goes straight to that compiled kernel's launcher with every argument in
signature order; anything Triton specialises on that changed, launch hooks, or an untested Triton version take
the ordinary ``fn[grid](...)`` path."""

from __future__ import annotations

import inspect

import pytest
import torch

from mla_backend_plugin.kernels.combine import kernel as combine


class FakeCompiled:
    function = "fn-handle"
    packed_metadata = "meta"

    def __init__(self, log):
        self.log = log

    def run(self, *a):
        self.log.append(("run", a))


class FakeParam:
    def __init__(self, p: inspect.Parameter):
        self.name, self.default = p.name, p.default


class FakeJit:
    """Stands in for a @triton.jit function: x, y, stride (runtime), A, B=7 (constexprs)."""

    def __init__(self):
        def f(x, y, stride, A, B=7):
            pass

        self.params = [FakeParam(p) for p in inspect.signature(f).parameters.values()]
        self.arg_names = [p.name for p in self.params]
        self.log = []

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.log.append(("jit", grid, args, kw))
            return FakeCompiled(self.log)
        return launch


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr(combine, "_PREPARED", {})
    monkeypatch.setenv("CUTE_MLA_PREPARED_COMBINE", "1")
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))  # CPU tensors stand in for device ones
    monkeypatch.setattr(combine, "_stream_getter", lambda: (lambda device: f"stream{device}"))
    monkeypatch.setattr(combine, "_triton_version", lambda: (3, 6))
    return FakeJit()


def test_second_launch_goes_to_the_compiled_launcher(fake):
    x, y = torch.zeros(64), torch.zeros(64, dtype=torch.bfloat16)
    assert combine.prepared_launch(fake, (2, 3, 1), (x, y, 512), {"A": 5}, 4, True) == "triton"
    assert fake.log[-1] == ("jit", (2, 3, 1), (x, y, 512), {"A": 5, "num_warps": 4, "launch_pdl": True})
    x2, y2 = torch.ones(64), torch.ones(64, dtype=torch.bfloat16)  # new tensors, same dtypes and alignment
    assert combine.prepared_launch(fake, (2, 3, 1), (x2, y2, 512), {"A": 5}, 4, True) == "prepared"
    # grid, stream, handle, metadata, no launch metadata or hooks, the arguments, the constexprs with defaults
    assert fake.log[-1] == ("run", (2, 3, 1, "streamNone", "fn-handle", "meta", None, None, None, x2, y2, 512, 5, 7))


@pytest.mark.parametrize("change", ["int", "alignment", "dtype", "constexpr", "grid", "pdl"])
def test_any_specialisation_change_takes_the_ordinary_path(fake, change):
    x, y = torch.zeros(64), torch.zeros(64, dtype=torch.bfloat16)
    call = dict(grid=(2, 3, 1), args=(x, y, 512), constexprs={"A": 5}, use_pdl=False)
    assert combine.prepared_launch(fake, call["grid"], call["args"], call["constexprs"], 4, False) == "triton"
    if change == "int":
        call["args"] = (x, y, 513)
    elif change == "alignment":
        call["args"] = (torch.zeros(65)[1:], y, 512)  # 4 bytes past a 16-byte boundary
    elif change == "dtype":
        call["args"] = (x.double(), y, 512)
    elif change == "constexpr":
        call["constexprs"] = {"A": 6}
    elif change == "grid":
        call["grid"] = (2, 4, 1)
    else:
        call["use_pdl"] = True
    assert combine.prepared_launch(fake, call["grid"], call["args"], call["constexprs"], 4,
                                   call["use_pdl"]) == "triton"


def test_hooks_and_untested_versions_take_the_ordinary_path(fake, monkeypatch):
    x, y = torch.zeros(64), torch.zeros(64, dtype=torch.bfloat16)
    launch = lambda: combine.prepared_launch(fake, (1, 1, 1), (x, y, 16), {"A": 1}, 4, False)  # noqa: E731
    assert launch() == "triton" and launch() == "prepared"
    monkeypatch.setattr(combine, "_hooks_unset", lambda: False)  # e.g. a profiler's launch hooks
    assert launch() == "triton"
    monkeypatch.setattr(combine, "_hooks_unset", lambda: True)
    monkeypatch.setattr(combine, "_PREPARED", {})
    monkeypatch.setattr(combine, "_triton_version", lambda: (3, 7))
    assert launch() == "triton" and launch() == "triton"


def test_hooks_unset_reads_tritons_hook_chains():
    from triton import knobs

    chain = knobs.runtime.launch_enter_hook
    if not hasattr(chain, "add"):
        pytest.skip("this Triton's launch hooks are plain attributes (None when unset)")
    assert combine._hooks_unset()
    hook = lambda metadata: None  # noqa: E731
    chain.add(hook)
    try:
        assert not combine._hooks_unset()
    finally:
        chain.remove(hook)
    assert combine._hooks_unset()


def test_on_by_default_off_by_env_and_on_cpu_tensors(fake, monkeypatch):
    """On by default (CUTE_MLA_PREPARED_COMBINE=0 turns it off); tensors off the GPU (Triton's CPU interpreter)
    always take the ordinary path."""
    x, y = torch.zeros(64), torch.zeros(64, dtype=torch.bfloat16)
    launch = lambda: combine.prepared_launch(fake, (1, 1, 1), (x, y, 16), {"A": 1}, 4, False)  # noqa: E731
    monkeypatch.setenv("CUTE_MLA_PREPARED_COMBINE", "0")
    assert [launch(), launch()] == ["triton", "triton"] and not combine._PREPARED
    monkeypatch.delenv("CUTE_MLA_PREPARED_COMBINE")
    assert [launch(), launch()] == ["triton", "prepared"]
    combine._PREPARED.clear()
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: False))
    assert [launch(), launch()] == ["triton", "triton"] and not combine._PREPARED
