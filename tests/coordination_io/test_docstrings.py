"""Every public class of torchheal.coordination documents its arguments (reference's
coordination_test), and every module of the I/O layer has a header docstring."""

from __future__ import annotations

import importlib
import inspect

import pytest

import torchheal.coordination as coordination

IO_MODULES = [
    "torchheal.coordination",
    "torchheal.coordination.clients",
    "torchheal.coordination.clients.lighthouse_client",
    "torchheal.coordination.clients.manager_client",
    "torchheal.coordination.convert",
    "torchheal.coordination.rpc",
    "torchheal.coordination.rpc.addresses",
    "torchheal.coordination.rpc.channels",
    "torchheal.coordination.rpc.errors",
    "torchheal.coordination.rpc.in_process",
    "torchheal.coordination.rpc.server",
    "torchheal.coordination.lighthouse",
    "torchheal.coordination.lighthouse.server",
    "torchheal.coordination.group",
    "torchheal.coordination.group.dial",
    "torchheal.coordination.group.link",
    "torchheal.coordination.group.server",
    "torchheal._wire",
    "torchheal._wire.methods",
    "torchheal.cli",
    "torchheal.cli.lighthouse",
]


@pytest.mark.parametrize("name", coordination.__all__)
def test_public_class_docstring_has_args(name):
    obj = getattr(coordination, name)
    assert inspect.isclass(obj)
    assert "Args:" in (obj.__doc__ or ""), f"{name} docstring lacks Args:"


@pytest.mark.parametrize("module_name", IO_MODULES)
def test_module_header_and_public_classes(module_name):
    module = importlib.import_module(module_name)
    assert (module.__doc__ or "").strip(), f"{module_name} has no module docstring"
    for name in getattr(module, "__all__", []):
        obj = getattr(module, name)
        if inspect.isclass(obj):
            assert "Args:" in (obj.__doc__ or ""), f"{module_name}.{name} lacks Args:"
