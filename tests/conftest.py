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


def pytest_collection_modifyitems(config, items):
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    no_interp = pytest.mark.skip(reason="Triton interpreter tests run where there is no GPU (CI)")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_gpu)
        if "interp" in item.keywords and not INTERPRETING:
            item.add_marker(no_interp)


@pytest.fixture(params=DEVICES)
def device_dtype(request):
    return request.param
