"""Fingerprints of CUDA state: the same integers as on the CPU, and a flipped bit still caught.

Groups may hold their state on different devices (a CPU healer checks against a GPU peer), and
the divergence guard compares the integers as they are, so a digest must not depend on where
its reductions ran.
"""

from __future__ import annotations

import pytest
import torch

from torchheal.manager.fingerprint import fingerprint, tensor_digest

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.bool, torch.float64]


def _tensor(dtype: torch.dtype, numel: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(numel)
    if dtype == torch.bool:
        return torch.rand(numel, generator=gen) > 0.5
    if not dtype.is_floating_point:
        return torch.randint(-128, 127, (numel,), generator=gen, dtype=dtype)
    return torch.randn(numel, generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("numel", [1, 255, 256 * 1024 + 3])
def test_cuda_digest_equals_cpu_digest(dtype: torch.dtype, numel: int) -> None:
    cpu = _tensor(dtype, numel)
    assert tensor_digest(cpu.cuda()).cpu().tolist() == tensor_digest(cpu).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_flipped_bit_in_a_cuda_tensor_changes_its_digest(dtype: torch.dtype) -> None:
    t = _tensor(dtype, 4096).cuda()
    before = tensor_digest(t).cpu().tolist()
    words = t.view(torch.int16)
    words[1234] ^= 1 << 9
    assert tensor_digest(t).cpu().tolist() != before


def test_state_fingerprint_is_the_same_on_either_device() -> None:
    model = torch.nn.Linear(64, 32)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    on_cpu = {"user": {"model": model.state_dict(), "optim": opt.state_dict()}, "torchft": {}}
    model.cuda()
    opt_cuda = torch.optim.AdamW(model.parameters())
    opt_cuda.load_state_dict(opt.state_dict())
    on_gpu = {"user": {"model": model.state_dict(), "optim": opt_cuda.state_dict()}, "torchft": {}}
    a, b = fingerprint(on_cpu), fingerprint(on_gpu)
    assert a == b
