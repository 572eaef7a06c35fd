"""torchheal: per-step fault tolerance for PyTorch training.

The top-level names match the reference (``torchft``); they resolve lazily, so importing a light
submodule does not pull in torch, gRPC servers or process groups.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "DistributedDataParallel",
    "DistributedSampler",
    "Manager",
    "Optimizer",
    "ProcessGroupBabyGloo",
    "ProcessGroupBabyNCCL",
    "ProcessGroupBabyXCCL",
    "ProcessGroupGloo",
    "ProcessGroupNCCL",
    "ProcessGroupXCCL",
]

# public name -> (module, attribute)
_EXPORTS: dict[str, tuple[str, str]] = {
    "DistributedDataParallel": ("torchheal.ddp", "DistributedDataParallel"),
    "DistributedSampler": ("torchheal.data", "DistributedSampler"),
    "Manager": ("torchheal.manager", "Manager"),
    "Optimizer": ("torchheal.optim", "OptimizerWrapper"),
    "ProcessGroupBabyGloo": ("torchheal.process_group", "ProcessGroupBabyGloo"),
    "ProcessGroupBabyNCCL": ("torchheal.process_group", "ProcessGroupBabyNCCL"),
    "ProcessGroupBabyXCCL": ("torchheal.process_group", "ProcessGroupBabyXCCL"),
    "ProcessGroupGloo": ("torchheal.process_group", "ProcessGroupGloo"),
    "ProcessGroupNCCL": ("torchheal.process_group", "ProcessGroupNCCL"),
    "ProcessGroupXCCL": ("torchheal.process_group", "ProcessGroupXCCL"),
}


def __getattr__(name: str) -> Any:
    try:
        module, attribute = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module 'torchheal' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
