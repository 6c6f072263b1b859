from pathlib import Path

from setuptools import setup

# torch is required but never pinned to a build here: a CPU machine installs the local
# CPU wheel first (scripts/install.sh), and a GPU machine keeps the CUDA torch it has.
setup(
    name="moe-infer",
    version="0.1.0",
    description="Mixture-of-experts specialist inference: fused kernels, expert parallelism, serving",
    long_description=Path(__file__).with_name("README.md").read_text(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=["moe_infer", "moe_infer.configs", "dense", "comm", "kernels", "kernels.argmax", "kernels.attention",
              "kernels.layout", "kernels.linear", "kernels.moe", "kernels.norm", "kernels.routing"],
    package_dir={"moe_infer.configs": "configs"},
    # CUDA C++ sources (each operator's .cu, the shared header in kernels/cuda/) compile at run time
    # (kernels.cuda_common.cuda_source); tuning tables sit in their operator's tables/
    package_data={"moe_infer": ["default_model/*", "hardware/*.yaml"], "moe_infer.configs": ["*.yaml"],
                  "kernels": ["cuda/*.cuh"], "kernels.moe": ["tables/*.json", "*.cu"],
                  "kernels.linear": ["tables/*.json", "*.cu"]},
    install_requires=[
        "torch>=2.4",
        "numpy",
        "safetensors>=0.4",
        "tokenizers>=0.19",
        "PyYAML>=6",
        "tqdm",
    ],
    extras_require={
        "test": [
            "pytest>=7",
            "pytest-xdist>=3",  # the main suite on two workers (scripts/test.sh)
            "hypothesis>=6",  # property-based tests of the server's request parsing
            "transformers>=5.0",
            "mpi4py>=4",
            "mpich",  # an MPI runtime from PyPI (mpiexec) for the mpi-marked tests on CPU
            # The GPU image has Triton 3.6; its CPU interpreter runs our kernels in CI.
            "triton==3.6.0; platform_system == 'Linux'",
            # Triton 3.6's interpreter calls int() on 1-element arrays (loop bounds), which
            # numpy 2.4 rejects.
            "numpy<2.4",
            # SBI-GeMM's CUDA C++ source compiles for Hopper through NVRTC in CI (no GPU):
            # CuPy as on the GPU image, and NVRTC from PyPI.
            "cupy-cuda12x==14.2.0; platform_system == 'Linux'",
            "nvidia-cuda-nvrtc-cu12; platform_system == 'Linux'",
            # the server and its tests: the official client on loopback
            "fastapi", "uvicorn", "prometheus-client", "jinja2", "httpx", "openai",
        ],
        # uvicorn[standard]: uvloop and httptools, the event loop and HTTP parser it runs fastest on
        "serve": ["fastapi", "uvicorn[standard]", "prometheus-client", "jinja2"],
    },
    entry_points={"console_scripts": ["moe-infer=moe_infer.cli:main"]},
)
