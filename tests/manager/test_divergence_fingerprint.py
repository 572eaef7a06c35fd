"""The fingerprint on the CPU: every single flipped bit caught, the fused digests equal to the
per-tensor definition, and the tensor that differs named.

``fingerprint.digests`` fuses the work over all tensors of a device (block sums written into one
shared vector, the weights applied once); these pin that it computes, for every tensor, exactly
the definition in the module's header, written here in plain Python integers.
"""

from __future__ import annotations

import pytest
import torch

from torchheal.manager.fingerprint import BLOCK, digests, fingerprint, tensor_digest

MASK = (1 << 64) - 1


def _definition(tensor: torch.Tensor) -> tuple[int, int]:
    """``(sum, weighted sum)`` of the tensor's bytes as little-endian words (the widest of 8, 4,
    2 or 1 bytes its size allows; signed, bytes unsigned), in Python ints."""
    data = tensor.detach().contiguous().reshape(-1)
    if data.dtype == torch.bool:
        data = data.view(torch.uint8)
    if data.is_complex():
        data = torch.view_as_real(data).reshape(-1)
    raw = data.view(torch.uint8).tolist()
    size = next(s for s in (8, 4, 2, 1) if len(raw) % s == 0 and s >= data.element_size())
    words = [
        int.from_bytes(bytes(raw[i : i + size]), "little", signed=size > 1)
        for i in range(0, len(raw), size)
    ]
    total = weighted = 0
    for index in range(0, len(words), BLOCK):
        block = sum(words[index : index + BLOCK])
        total += block
        weighted += (2 * (index // BLOCK) + 1) * block
    return total & MASK, weighted & MASK


def _tensor(dtype: torch.dtype, numel: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 1000 + numel)
    if dtype == torch.bool:
        return torch.rand(numel, generator=gen) > 0.5
    if dtype.is_complex:
        return torch.randn(numel, generator=gen, dtype=dtype)
    if not dtype.is_floating_point:
        return torch.randint(-100, 100, (numel,), generator=gen, dtype=dtype)
    return torch.randn(numel, generator=gen).to(dtype)


DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int8,
    torch.int32,
    torch.bool,
    torch.complex64,
]
SIZES = [0, 1, 3, BLOCK - 1, BLOCK, BLOCK + 1, 5 * BLOCK + 7]


def test_fused_digests_equal_the_definition() -> None:
    tensors = [_tensor(d, n) for d in DTYPES for n in SIZES]
    tensors.append(torch.randn(33, 64).t())  # not contiguous
    tensors.append(torch.randn(4 * BLOCK + 1)[1:])  # starts between int64 words: same words
    assert digests(tensors) == [_definition(t) for t in tensors]
    for t in tensors[:: len(SIZES)]:
        assert tuple(v & MASK for v in tensor_digest(t).tolist()) == _definition(t)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8], ids=str)
def test_every_single_flipped_bit_is_caught(dtype: torch.dtype) -> None:
    # Every bit of a tensor spanning two blocks and a tail, beside two tensors left alone: the
    # flipped tensor's digest changes, the others' do not.
    numel = (2 * BLOCK + 3) * 8 // torch.tensor([], dtype=dtype).element_size()
    others = [_tensor(torch.float32, 300, seed=1), _tensor(torch.float16, 17, seed=2)]
    t = _tensor(dtype, numel)
    before = digests([others[0], t, others[1]])
    raw = t.view(torch.uint8)
    for byte in range(raw.numel()):
        for bit in range(8):
            raw[byte] ^= 1 << bit
            after = digests([others[0], t, others[1]])
            raw[byte] ^= 1 << bit
            assert after[1][0] != before[1][0] and after[1][1] != before[1][1], (byte, bit)
            assert after[0] == before[0] and after[2] == before[2]
    assert digests([others[0], t, others[1]]) == before


def test_the_key_and_tensor_that_differ_are_named() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()

    def state() -> dict:
        return {
            "user": {"default": {"model": model.state_dict(), "optim": opt.state_dict()}},
            "torchft": {"step": 3},
        }

    a = fingerprint(state())
    with torch.no_grad():
        model[1].bias.view(torch.int32)[2] ^= 1 << 30
    b = fingerprint(state())
    assert a.keys == b.keys and a.tensors == b.tensors
    keys = [k for k, x, y in zip(a.keys, a.entries, b.entries, strict=True) if x != y]
    assert keys == ["default/model"]
    differ = [
        n for n, x, y in zip(a.tensors, a.tensor_digests, b.tensor_digests, strict=True) if x != y
    ]
    assert differ == ["default/model/1.bias"]


def test_the_layout_follows_the_sizes() -> None:
    # The cached layout is keyed by the tensors' sizes: a state that grows (an optimizer's
    # first step adds its moments) gets a new one, and the digests stay right.
    small = [_tensor(torch.float32, 10), _tensor(torch.float32, BLOCK * 2)]
    assert digests(small) == [_definition(t) for t in small]
    grown = [*small, _tensor(torch.float32, BLOCK * 3 + 1)]
    assert digests(grown) == [_definition(t) for t in grown]
    assert digests(small) == [_definition(t) for t in small]
