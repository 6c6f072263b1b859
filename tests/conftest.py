import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402 (importing torch does not import triton)

# Before anything imports triton: without a GPU, Triton kernels run on CPU tensors through
# the interpreter. With a GPU they compile for it, and the interpreter tests are skipped.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"

torch.set_num_threads(min(2, torch.get_num_threads()))

# (device, dtype) pairs the model-level tests run on: fp32 on CPU always, bf16 on a GPU.
DEVICES = [
    pytest.param(("cpu", torch.float32), id="cpu-fp32"),
    pytest.param(("cuda", torch.bfloat16), id="cuda-bf16", marks=pytest.mark.gpu),
]


# Set by the MPI launchers (MPICH's Hydra, Open MPI) in every rank they start.
MPI_RANKS = int(os.environ.get("PMI_SIZE") or os.environ.get("OMPI_COMM_WORLD_SIZE") or 1)


def pytest_collection_modifyitems(config, items):
    no_mpi = pytest.mark.skip(reason="multi-rank test: run it under mpiexec -n 2 or more")
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    no_interp = pytest.mark.skip(reason="Triton interpreter tests run where there is no GPU (CI)")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_gpu)
        if "interp" in item.keywords and not INTERPRETING:
            item.add_marker(no_interp)
        if "mpi" in item.keywords and MPI_RANKS < 2:
            item.add_marker(no_mpi)


@pytest.fixture(params=DEVICES)
def device_dtype(request):
    return request.param


@pytest.fixture(scope="session")
def info():
    """The multi-rank tests' job: this rank's process group and device (``comm.bootstrap``)."""
    from comm import bootstrap

    return bootstrap(timeout_s=120)


@pytest.fixture(scope="session")
def world(info):
    return info.world_size


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under mpirun a test that fails on one rank would leave the others blocked in their
    next collective: print the failure and end the whole job at once."""
    outcome = yield
    report = outcome.get_result()
    if MPI_RANKS > 1 and "mpi" in item.keywords and report.failed:
        from mpi4py import MPI

        os.write(2, f"[rank {MPI.COMM_WORLD.Get_rank()}] {item.nodeid} failed:\n{report.longreprtext}\n".encode())
        import time

        time.sleep(0.5)  # let the launcher forward the message
        MPI.COMM_WORLD.Abort(1)


@pytest.fixture
def graph_outputs(monkeypatch):
    """On the CPU, the runner's fixed-shape step returns buffers of its own that its next
    run rewrites, as a captured CUDA graph's replays do (its eager run returns fresh
    tensors): callers that keep a step's outputs past the next one must copy them."""
    from moe_infer.runner import PagedDecodeStep

    real = PagedDecodeStep._step

    def step(self, sampling):
        out = real(self, sampling)
        if not hasattr(self, "buffers"):
            self.buffers = tuple(torch.empty_like(t) for t in out)
        for buf, t in zip(self.buffers, out):
            buf.copy_(t)
        return self.buffers

    monkeypatch.setattr(PagedDecodeStep, "_step", step)
