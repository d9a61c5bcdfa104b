"""ray_ep: Mixture-of-Experts token dispatch and combine across GPUs.

Each rank is a Ray actor that owns its device, its Triton kernels and (on GPUs) its NVSHMEM
symmetric buffers; :class:`EPCluster` drives them. On a machine without GPUs the same API
runs CPU workers over torch.distributed (gloo).
"""

from .communicator import EPCommunicator
from .config import BufferPlan, EPConfig, PRESETS, plan_buffers
from .driver import CheckReport, EPCluster
from .errors import (EPClusterError, EPConfigError, EPError, EPInputError, EPOverflowError, EPStateError,
                     EPTimeoutError, EPWorkerError)
from .inputs import make_inputs
from .routing import route
from .weights import ExpertWeights, init_expert_weights, load_deepseek_experts

__version__ = "0.1.0"

# submodules the examples use, imported on first touch (nothing heavy at `import ray_ep`)
_LAZY_MODULES = ("bench", "serving", "reference", "nn")


def __getattr__(name: str):
    if name in _LAZY_MODULES:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "BufferPlan", "CheckReport", "EPCluster", "EPClusterError", "EPCommunicator", "EPConfig", "EPConfigError",
    "EPError", "EPInputError", "EPOverflowError", "EPStateError", "EPTimeoutError", "EPWorkerError", "ExpertWeights",
    "PRESETS",
    "init_expert_weights", "load_deepseek_experts", "make_inputs", "plan_buffers", "route", "__version__",
    "bench", "serving", "reference", "nn",
]
