"""Every public module path and name of the reference resolves under ``torchheal``.

A program written for torchft switches by replacing ``torchft`` with ``torchheal`` in its
imports (or, unchanged, through the opt-in ``compat/`` distribution, which maps
``torchft.<path>`` to ``torchheal.<path>``), so the paths must match, not only the names.

The list was built once by introspecting the installed reference wheel (torchft-nightly
2026.10.26: every public module it ships and, per module, its ``__all__`` or the public classes,
functions and constants it defines), plus the mirror-only names of the behaviour doc
(``torchft.device_mesh``, re-exported by ``torchft.process_group``). It is hard-coded on purpose:
this test must not import torchft, and it must fail when torchheal drifts.

Left out for now, on purpose (each arrives with other work, and is then added here):
* ``torchft.examples.slurm.*`` - torchheal's Slurm scripts are ``examples/slurm/`` of the
  repository (not a package), like the reference's source tree; ``torchft.otel.main`` (a demo);
* ``torchft.torchcomms`` (``ProcessGroupTorchComms``, needs the ``torchcomms`` package), the
  wheel's handle-based rendezvous (``process_group.ReconfigureOptions``,
  ``process_group.reconfigure_with_store``) and its per-quorum flight-recorder dump path
  (``manager.TORCH_FR_DUMP_TEMP_FILE_ENV``): newer-wheel features torchheal does not have yet.
"""

from __future__ import annotations

import importlib

import pytest

# reference module path (under the package) -> public names it must provide
REFERENCE_PUBLIC_NAMES: dict[str, tuple[str, ...]] = {
    "": (
        "DistributedDataParallel",
        "DistributedSampler",
        "Manager",
        "Optimizer",
        "ProcessGroupBabyNCCL",
        "ProcessGroupBabyXCCL",
        "ProcessGroupGloo",
        "ProcessGroupNCCL",
        "ProcessGroupXCCL",
    ),
    "checkpointing": ("CheckpointTransport", "HTTPTransport"),
    "checkpointing._rwlock": ("RWLock",),
    "checkpointing.http_transport": ("HTTPTransport",),
    "checkpointing.pg_transport": ("PGTransport",),
    "checkpointing.transport": ("CheckpointTransport",),
    "collectives": (
        "allocate_reduce_scatter_output",
        "allreduce_quantized",
        "get_padded_sizes",
        "reduce_scatter_quantized",
    ),
    "coordination": (
        "LighthouseClient",
        "LighthouseServer",
        "ManagerClient",
        "ManagerServer",
        "Quorum",
        "QuorumMember",
        "QuorumResult",
    ),
    "data": ("DistributedSampler",),
    "ddp": ("DistributedDataParallel", "PureDistributedDataParallel"),
    "device_mesh": (
        "ManagedDeviceMesh",
        "_FlattenDeviceMesh",
        "extend_device_mesh",
        "ft_init_device_mesh",
    ),
    "futures": ("context_timeout", "future_timeout", "future_wait", "stream_timeout"),
    "http": ("_IPv6HTTPServer",),
    "local_sgd": ("DiLoCo", "LocalSGD", "extract_local_tensor"),
    "manager": (
        "CONNECT_TIMEOUT_SEC_ENV",
        "IS_TRITON_AVAILABLE",
        "MANAGER_ADDR_KEY",
        "MANAGER_PORT_ENV",
        "QUORUM_RETRIES_ENV",
        "QUORUM_TIMEOUT_SEC_ENV",
        "REPLICA_ID_KEY",
        "TIMEOUT_SEC_ENV",
        "ExceptionWithTraceback",
        "Manager",
        "WorldSizeMode",
        "extract_trailing_digits",
        "get_timeout",
    ),
    "multiprocessing": ("_MonitoredPipe",),
    "multiprocessing_dummy_context": ("DummyContext", "get_context"),
    "optim": ("OptimizerWrapper",),
    "otel": ("TORCHFT_OTEL_RESOURCE_ATTRIBUTES_JSON", "TeeLogExporter", "setup_logger", "shutdown"),
    "parameter_server": ("ParameterServer",),
    "process_group": (
        "ErrorSwallowingProcessGroupWrapper",
        "FakeProcessGroupWrapper",
        "ManagedDeviceMesh",
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
        "extend_device_mesh",
        "ft_init_device_mesh",
        "trigger_nccl_fr_trace_through_pipe",
    ),
    "quantization": ("fused_dequantize_from_fp8", "fused_quantize_into_fp8", "fused_reduce_fp8"),
    "torchx": ("hsdp",),
    "utils": ("get_stream_context", "record_event", "synchronize"),
    "work": ("_DummyWork",),
}


def _module_name(path: str) -> str:
    return f"torchheal.{path}" if path else "torchheal"


@pytest.mark.parametrize("path", sorted(REFERENCE_PUBLIC_NAMES))
def test_reference_module_path_and_names_resolve(path: str) -> None:
    module = importlib.import_module(_module_name(path))
    missing = [n for n in REFERENCE_PUBLIC_NAMES[path] if getattr(module, n, None) is None]
    assert not missing, f"{_module_name(path)} lacks {missing}"


def test_same_object_wherever_the_reference_exports_it() -> None:
    """Re-exports are the same objects, so isinstance checks hold across paths."""
    import torchheal
    import torchheal.device_mesh as device_mesh
    import torchheal.process_group as pg
    import torchheal.work as work
    from torchheal.checkpointing import _rwlock, rwlock

    assert _rwlock.RWLock is rwlock.RWLock
    assert work._DummyWork is pg._DummyWork
    assert pg.ft_init_device_mesh is device_mesh.ft_init_device_mesh
    assert torchheal.ProcessGroupXCCL is pg.ProcessGroupXCCL


def test_xccl_groups_are_import_safe_and_refuse_clearly_without_an_xpu() -> None:
    import torch

    from torchheal.process_group import ProcessGroupBabyXCCL, ProcessGroupXCCL

    assert ProcessGroupXCCL().getBackendName() == "torchft-xccl"
    assert ProcessGroupBabyXCCL().getBackendName() == "torchft-baby-xccl"
    if torch.xpu.is_available():
        pytest.skip("an XPU is present: configure would really try to connect")
    for cls in (ProcessGroupXCCL, ProcessGroupBabyXCCL):
        with pytest.raises(RuntimeError, match="needs an Intel XPU device"):
            cls().configure("localhost:1/prefix", "r", 0, 1)
