"""LocalSGD and DiLoCo tell a DTensor from a plain tensor without importing DTensor's module.

That import took about 1.1 s here (it pulls in sympy), paid by every LocalSGD or DiLoCo user at
``import torchheal.local_sgd`` until it was deferred: no object can be a DTensor while nothing
in the process has imported it. A fresh interpreter checks the import; this one (which may have
imported DTensor already) checks that a DTensor is still taken for one.
"""

from __future__ import annotations

import subprocess
import sys

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from tests.checkpointing.test_dtensor import world_of_one  # noqa: F401 (a fixture)
from torchheal.local_sgd import extract_local_tensor

PLAIN = """
import sys
import torch
from torch import nn
from torchheal.local_sgd import DiLoCo, LocalSGD, extract_local_tensor
out = extract_local_tensor(nn.Parameter(torch.ones(3)))
assert out.tolist() == [1.0, 1.0, 1.0]
print("imported" if "torch.distributed.tensor" in sys.modules else "not imported")
"""


def test_plain_tensors_do_not_import_dtensor() -> None:
    done = subprocess.run(
        [sys.executable, "-c", PLAIN], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "not imported", done.stdout


def test_a_dtensor_gives_a_copy_of_its_local_shard(world_of_one: None) -> None:  # noqa: F811
    mesh = DeviceMesh("cpu", torch.tensor([0]), _init_backend=False)
    p = nn.Parameter(DTensor.from_local(torch.arange(3.0), mesh, [Shard(0)], run_check=False))
    out = extract_local_tensor(p)
    assert type(out) is torch.Tensor and not out.requires_grad
    assert out.tolist() == [0.0, 1.0, 2.0]
    assert out.data_ptr() != p.to_local().data_ptr()
