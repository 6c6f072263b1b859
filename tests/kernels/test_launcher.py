"""kernels.launcher.CachedLaunch on a stand-in for a Triton kernel (no GPU needed): the JIT
runs once per key, later calls go to the compiled launcher with the arguments in the
kernel's parameter order, the plan is not worked out again, and a set launch hook sends
every call back through the JIT. The real kernel behind it is tested on the GPU
(tests/kernels/test_routing.py::test_route_through_the_cached_launcher)."""
import torch

from kernels import launcher


class FakeRunner:
    """Stands in for Triton 3.6's CudaLauncher: a C entry point plus the scratch sizes."""

    def __init__(self, calls, scratch=0):
        self.calls = calls
        self.global_scratch_size = self.profile_scratch_size = scratch
        self.launch_cooperative_grid, self.launch_pdl = 0, 1

    def launch(self, *a):
        self.calls.append(("direct", a))

    def __call__(self, *a):
        self.calls.append(("wrapper", a))


class FakeCompiled:
    def __init__(self, runner):
        self.run, self.function, self.packed_metadata = runner, "fn", "meta"


class FakeJit:
    arg_names = ["x", "n", "A", "B"]

    def __init__(self, scratch=0):
        self.calls, self.jit_calls, self.scratch = [], [], scratch

    def __getitem__(self, grid):
        def run(*args, **kw):
            self.jit_calls.append((grid, args, kw))
            return FakeCompiled(FakeRunner(self.calls, self.scratch))
        return run


def _launch(kernel, key, args, plans, device=torch.device("cuda", 0)):
    def plan():
        plans.append(key)
        return (3, 2), {"B": 7, "A": 5, "num_warps": 4}
    kernel(key, args, plan, device)


def test_jit_once_per_key_then_the_c_launcher(monkeypatch):
    monkeypatch.setattr(launcher.CachedLaunch, "stream", staticmethod(lambda index: 1000 + index))
    fake = FakeJit()
    kernel, plans = launcher.CachedLaunch(fake), []
    _launch(kernel, "a", ("x0", 1), plans)
    assert fake.jit_calls == [((3, 2), ("x0", 1), {"B": 7, "A": 5, "num_warps": 4})] and fake.calls == []
    _launch(kernel, "a", ("x1", 2), plans)
    _launch(kernel, "a", ("x2", 3), plans)
    # Grid padded to 3-D, the stream, function, flags, no scratch, metadata, no hooks,
    # then every parameter in signature order (constexprs A, B last).
    assert fake.calls == [("direct", (3, 2, 1, 1000, "fn", 0, 1, None, None, "meta", None, None, None, x, n, 5, 7))
                          for x, n in (("x1", 2), ("x2", 3))]
    assert plans == ["a"] and len(fake.jit_calls) == 1
    _launch(kernel, "b", ("x3", 4), plans)  # a new key compiles again
    assert plans == ["a", "b"] and len(fake.jit_calls) == 2 and len(kernel.cache) == 2


def test_scratch_memory_goes_through_the_wrapper(monkeypatch):
    monkeypatch.setattr(launcher.CachedLaunch, "stream", staticmethod(lambda index: 7))
    fake = FakeJit(scratch=256)
    kernel, plans = launcher.CachedLaunch(fake), []
    _launch(kernel, "a", ("x0", 1), plans)
    _launch(kernel, "a", ("x1", 2), plans)
    assert fake.calls == [("wrapper", (3, 2, 1, 7, "fn", "meta", None, None, None, "x1", 2, 5, 7))]


def test_a_launch_hook_or_the_cpu_keeps_the_jit(monkeypatch):
    fake = FakeJit()
    kernel, plans = launcher.CachedLaunch(fake), []
    _launch(kernel, "cpu", ("x0", 1), plans, torch.device("cpu"))
    _launch(kernel, "cpu", ("x1", 1), plans, torch.device("cpu"))
    assert len(fake.jit_calls) == 2 and not kernel.cache  # the interpreter: nothing to cache
    monkeypatch.setattr(launcher, "_hooked", lambda: True)
    _launch(kernel, "a", ("x0", 1), plans)
    _launch(kernel, "a", ("x1", 1), plans)
    assert len(fake.jit_calls) == 4 and fake.calls == []


def test_hooked_reads_the_hook_chain():
    from triton import knobs

    def hook(*args):
        return None

    chain = knobs.runtime.launch_enter_hook
    assert not launcher._hooked()
    chain.add(hook)
    try:
        assert launcher._hooked()
    finally:
        chain.remove(hook)
    assert not launcher._hooked()
