"""Reconfigurable process groups (public import path ``torchheal.process_group``).

Each family lives in its own module; this file only re-exports them.
"""

from torchheal.process_group.baby import (
    ProcessGroupBaby,
    ProcessGroupBabyGloo,
    ProcessGroupBabyNCCL,
)
from torchheal.process_group.base import ProcessGroup
from torchheal.process_group.dummy import ProcessGroupDummy
from torchheal.process_group.gloo import ProcessGroupGloo
from torchheal.process_group.managed import ManagedProcessGroup
from torchheal.process_group.nccl import ProcessGroupNCCL
from torchheal.process_group.store import create_store_client
from torchheal.process_group.work import _DummyWork
from torchheal.process_group.wrappers import (
    ErrorSwallowingProcessGroupWrapper,
    FakeProcessGroupWrapper,
    ProcessGroupWrapper,
)

__all__ = [
    "ErrorSwallowingProcessGroupWrapper",
    "FakeProcessGroupWrapper",
    "ManagedProcessGroup",
    "ProcessGroup",
    "ProcessGroupBaby",
    "ProcessGroupBabyGloo",
    "ProcessGroupBabyNCCL",
    "ProcessGroupDummy",
    "ProcessGroupGloo",
    "ProcessGroupNCCL",
    "ProcessGroupWrapper",
    "_DummyWork",
    "create_store_client",
]
