"""Reconfigurable process groups (public import path ``torchheal.process_group``).

The reference's device-mesh names exported here live a layer above, in
:mod:`torchheal.device_mesh`, so they are resolved on first access.
"""

import importlib
from typing import Any

from torchheal.process_group.baby import (
    ProcessGroupBaby,
    ProcessGroupBabyGloo,
    ProcessGroupBabyNCCL,
)
from torchheal.process_group.base import ProcessGroup
from torchheal.process_group.dummy import ProcessGroupDummy
from torchheal.process_group.flight_recorder import trigger_nccl_fr_trace_through_pipe
from torchheal.process_group.gloo import ProcessGroupGloo
from torchheal.process_group.managed import ManagedProcessGroup
from torchheal.process_group.nccl import ProcessGroupNCCL
from torchheal.process_group.store import create_store_client
from torchheal.process_group.work import _DummyWork
from torchheal.process_group.wrappers import (
    ErrorSwallowingProcessGroupWrapper,
    FakeProcessGroupWrapper,
    ProcessGroupWrapper,
    _ErrorSwallowingWork,
)
from torchheal.process_group.xccl import ProcessGroupBabyXCCL, ProcessGroupXCCL

__all__ = [
    "ErrorSwallowingProcessGroupWrapper",
    "FakeProcessGroupWrapper",
    "ManagedProcessGroup",
    "ProcessGroup",
    "ProcessGroupBaby",
    "ProcessGroupBabyGloo",
    "ProcessGroupBabyNCCL",
    "ProcessGroupBabyXCCL",
    "ProcessGroupDummy",
    "ProcessGroupGloo",
    "ProcessGroupNCCL",
    "ProcessGroupWrapper",
    "ProcessGroupXCCL",
    "_DummyWork",
    "_ErrorSwallowingWork",
    "create_store_client",
    "trigger_nccl_fr_trace_through_pipe",
]

# Reference names served lazily from torchheal.device_mesh (a higher layer; see above).
_DEVICE_MESH_NAMES = ("ManagedDeviceMesh", "extend_device_mesh", "ft_init_device_mesh")


def __getattr__(name: str) -> Any:
    if name in _DEVICE_MESH_NAMES:
        return getattr(importlib.import_module("torchheal.device_mesh"), name)
    raise AttributeError(f"module 'torchheal.process_group' has no attribute {name!r}")
