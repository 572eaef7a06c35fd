"""Fingerprints of the state a healer would receive: per key, per tensor, on the tensor's device.

A tensor's fingerprint is two integers modulo 2**64 over its bytes read as integer words (int64
where its size allows, else int32, int16 or bytes): their sum, and the sum of its blocks of
:data:`BLOCK` words weighted by odd numbers (``2i + 1`` for block ``i``). Flipping bit ``k`` of
one word changes the word by ``±2**k`` and so both sums by a non-zero amount (an odd weight
times ``2**k`` is never a multiple of ``2**64``): any single flipped bit is caught, which a
float sum would not guarantee (``x + tiny`` rounds back). The weighted sum also catches blocks
moved or swapped; words permuted within one block are not caught (the price of one pass over
the tensor instead of two). Both are integer reductions on the tensor's own device, in one
pass; the only copy to the host is one small vector at the end.

Plain values (an optimizer's learning rate, a scheduler's counters, strings) are hashed from
their ``repr``. A sharded ``DTensor`` is fingerprinted by its local shard.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from torchheal.manager.divergence import MAX_KEYS, combine, name_hash

__all__ = ["Fingerprint", "fingerprint", "tensor_digest"]

#: Words per block of the weighted sum (measured fastest for a row-wise sum on CPU).
BLOCK = 256

_WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


def _words(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as one flat vector of integer words (a view where possible)."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # DTensor: its shard
    flat = local.detach().contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    nbytes = flat.numel() * flat.element_size()
    for size, dtype in _WORDS:
        if nbytes % size == 0 and size >= flat.element_size() and size % flat.element_size() == 0:
            try:
                return flat.view(dtype)
            except RuntimeError:
                continue  # an unaligned view: try a narrower word
    return flat.view(torch.uint8)


def tensor_digest(tensor: torch.Tensor) -> torch.Tensor:
    """``[sum, weighted sum]`` of a tensor's words as a 2-element int64 tensor on its device.

    One pass over the tensor: the words are summed per block of :data:`BLOCK`; the sum adds
    the blocks, the weighted sum weighs block ``i`` by ``2i + 1``.

    Args:
        tensor: any dense tensor (a DTensor: its local shard).
    """
    words = _words(tensor)
    if words.dtype != torch.int64:
        words = words.to(torch.int64)
    n = words.numel()
    device = words.device
    rows = n // BLOCK
    head_n = rows * BLOCK
    total = torch.zeros((), dtype=torch.int64, device=device)
    weighted = torch.zeros((), dtype=torch.int64, device=device)
    if rows:
        sums = words[:head_n].view(rows, BLOCK).sum(1)
        odd = torch.arange(1, 2 * rows, 2, dtype=torch.int64, device=device)
        total = sums.sum()
        weighted = (odd * sums).sum()
    if head_n < n:
        tail = words[head_n:].sum()
        total = total + tail
        weighted = weighted + (2 * rows + 1) * tail
    return torch.stack([total, weighted])


@dataclass(frozen=True)
class Fingerprint:
    """One rank's fingerprint of its state.

    Args:
        keys: the key names, in order (``<user key>[/<subkey>]``, ``torchft``, and
            ``compared/<key>`` for state registered with ``Manager.register_fingerprint``).
        entries: ``(name hash, sum, weighted sum)`` per key, same order.
        tensors: the tensor names (``key/path``), in order.
        tensor_digests: ``(sum, weighted sum)`` per tensor.
    """

    keys: tuple[str, ...]
    entries: tuple[tuple[int, int, int], ...]
    tensors: tuple[str, ...]
    tensor_digests: tuple[tuple[int, int], ...]


def _leaves(tree: Any, path: str, out: list[tuple[str, Any]]) -> None:
    if isinstance(tree, dict):
        for key in sorted(tree, key=str):
            _leaves(tree[key], f"{path}/{key}", out)
    elif isinstance(tree, (list, tuple)) and not hasattr(tree, "_fields"):
        for index, value in enumerate(tree):
            _leaves(value, f"{path}/{index}", out)
    else:
        out.append((path, tree))


def _keys(state: dict[str, Any]) -> list[tuple[str, Any]]:
    """The compared keys: each user key (and its sub-keys when it is a dict), the counters."""
    keys: list[tuple[str, Any]] = []
    for key in sorted(state.get("user", {})):
        value = state["user"][key]
        if isinstance(value, dict) and value:
            keys.extend((f"{key}/{sub}", value[sub]) for sub in sorted(value, key=str))
        else:
            keys.append((key, value))
    keys.append(("torchft", state.get("torchft", {})))
    compared = state.get("compared", {})
    keys.extend((f"compared/{key}", compared[key]) for key in sorted(compared))
    if len(keys) > MAX_KEYS:  # the rest share the last entry
        rest = dict(keys[MAX_KEYS - 1 :])
        keys = [*keys[: MAX_KEYS - 1], ("(other keys)", rest)]
    return keys


def fingerprint(state: dict[str, Any]) -> Fingerprint:
    """Fingerprints ``{"user": {key: state}, "torchft": counters, "compared": {key: state}}``.

    Args:
        state: the state a healer would receive (live tensors: nothing is copied).
    """
    keys = _keys(state)
    names: list[str] = []
    digests: list[torch.Tensor] = []
    owner: list[int] = []
    plain: list[list[tuple[int, int]]] = [[] for _ in keys]
    for index, (key, value) in enumerate(keys):
        leaves: list[tuple[str, Any]] = []
        _leaves(value, key, leaves)
        for path, leaf in leaves:
            if isinstance(leaf, torch.Tensor) and not leaf.is_sparse:
                names.append(path)
                digests.append(tensor_digest(leaf))
                owner.append(index)
            else:
                h = name_hash(f"{path}={leaf!r}")
                plain[index].append((h, h))
    # One copy to the host for every tensor's digest (grouped by device).
    values: list[tuple[int, int]] = [(0, 0)] * len(digests)
    by_device: dict[torch.device, list[int]] = {}
    for i, d in enumerate(digests):
        by_device.setdefault(d.device, []).append(i)
    for indices in by_device.values():
        host = torch.stack([digests[i] for i in indices]).cpu().tolist()
        for i, (s, w) in zip(indices, host, strict=True):
            values[i] = (s, w)
    per_key: list[list[tuple[int, int]]] = [[] for _ in keys]
    for i, index in enumerate(owner):
        per_key[index].append(values[i])
    entries = []
    for index, (key, _) in enumerate(keys):
        seed = name_hash(key)
        total, weighted = combine(per_key[index] + plain[index], seed)
        entries.append((seed, total, weighted))
    return Fingerprint(
        keys=tuple(k for k, _ in keys),
        entries=tuple(entries),
        tensors=tuple(names),
        tensor_digests=tuple(values),
    )
