"""The package's top-level names match the reference's (drop-in import switch)."""

import subprocess
import sys

import torchheal
import torchheal.manager as manager_module


def test_top_level_exports() -> None:
    assert sorted(torchheal.__all__) == [
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
    for name in torchheal.__all__:
        assert getattr(torchheal, name).__name__
    assert torchheal.Manager is manager_module.Manager


def test_manager_module_constants() -> None:
    assert manager_module.MANAGER_ADDR_KEY == "manager_addr"
    assert manager_module.REPLICA_ID_KEY == "replica_id"
    assert manager_module.MANAGER_PORT_ENV == "TORCHFT_MANAGER_PORT"
    assert manager_module.TIMEOUT_SEC_ENV == "TORCHFT_TIMEOUT_SEC"
    assert manager_module.QUORUM_TIMEOUT_SEC_ENV == "TORCHFT_QUORUM_TIMEOUT_SEC"
    assert manager_module.CONNECT_TIMEOUT_SEC_ENV == "TORCHFT_CONNECT_TIMEOUT_SEC"
    assert manager_module.QUORUM_RETRIES_ENV == "TORCHFT_QUORUM_RETRIES"
    assert manager_module.WorldSizeMode.DYNAMIC.value == 0
    assert manager_module.WorldSizeMode.FIXED_WITH_SPARES.value == 1


def test_light_submodules_do_not_import_the_manager() -> None:
    code = (
        "import sys, torchheal.coordination.quorum; assert 'torchheal.manager' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
