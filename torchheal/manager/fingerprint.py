"""Fingerprints of the state a healer would receive: per key, per tensor, on the tensor's device.

A tensor's fingerprint is two integers modulo 2**64 over its bytes read as integer words (the
word size depends on its size only): their sum, and the sum of its :data:`BLOCK`-word blocks
weighted by odd numbers. Any single flipped bit changes both (an odd weight times ``2**k`` is
never a multiple of ``2**64``), which a float sum would not guarantee; moved blocks are caught
too, words permuted within a block are not. The work is fused over all tensors of a device (one
pass over their bytes), so a model with many tensors does not pay many small operations each.

Plain values are hashed from their ``repr``; a sharded ``DTensor`` by its local shard.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from torchheal.manager.divergence import MAX_KEYS, combine, name_hash

__all__ = ["Fingerprint", "digests", "fingerprint", "tensor_digest"]

#: Words per block of the weighted sum (measured fastest for a row-wise sum on CPU).
BLOCK = 256

_MASK = (1 << 64) - 1

_WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


def _words(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as one flat vector of integer words (a view where possible)."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # DTensor: its shard
    flat = local.detach().contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    element = flat.element_size()
    nbytes = flat.numel() * element
    for size, dtype in _WORDS:
        if nbytes % size == 0 and size >= element and size % element == 0:
            if flat.storage_offset() * element % size:
                # A view that starts between words (a slice of a flat buffer): read an aligned
                # copy, so the words depend on the bytes only, not on where they lie.
                flat = flat.clone()
            return flat.view(dtype)
    return flat.view(torch.uint8)


def _int64_words(tensor: torch.Tensor) -> torch.Tensor:
    words = _words(tensor)
    return words if words.dtype == torch.int64 else words.to(torch.int64)


@dataclass(frozen=True)
class _Layout:
    """Where each tensor's block sums go in the shared vector, and the weights (cached while
    the tensors' sizes stay the same: every step, usually).

    Args:
        spans: per tensor, ``(first block, full blocks, tail words)``; the tail is summed into
            one more block after the full ones.
        owner: per block, the index of its tensor.
        weights: per block, its odd weight (``2i + 1`` for the tensor's block ``i``).
        small: per word of the tensors shorter than a block, taken together, its tensor's
            block: they are summed in one indexed sum instead of one reduction each (biases,
            norms and their optimizer state are most of a model's tensors).
    """

    spans: tuple[tuple[int, int, int], ...]
    owner: torch.Tensor
    weights: torch.Tensor
    small: torch.Tensor


_layouts: dict[tuple[torch.device, tuple[int, ...]], _Layout] = {}


def _layout(device: torch.device, sizes: tuple[int, ...]) -> _Layout:
    key = (device, sizes)
    layout = _layouts.get(key)
    if layout is not None:
        return layout
    spans, owner, weights, small = [], [], [], []
    for index, n in enumerate(sizes):
        rows, tail = divmod(n, BLOCK)
        blocks = rows + (1 if tail else 0)
        spans.append((len(owner), rows, tail))
        if not rows:
            small.extend([len(owner)] * tail)
        owner.extend([index] * blocks)
        weights.extend(range(1, 2 * blocks, 2))
    layout = _Layout(
        tuple(spans),
        torch.tensor(owner, dtype=torch.int64, device=device),
        torch.tensor(weights, dtype=torch.int64, device=device),
        torch.tensor(small, dtype=torch.int64, device=device),
    )
    if len(_layouts) >= 8:  # a few states at once (tests, several Managers); not a leak
        _layouts.clear()
    _layouts[key] = layout
    return layout


def _device_digests(words: list[torch.Tensor]) -> torch.Tensor:
    """``[[sum...], [weighted sum...]]`` of tensors of one device, as a ``(2, n)`` int64 tensor."""
    device = words[0].device
    layout = _layout(device, tuple(w.numel() for w in words))
    sums = torch.zeros(len(layout.weights), dtype=torch.int64, device=device)
    small = []
    for w, (first, rows, tail) in zip(words, layout.spans, strict=True):
        if not rows:
            small.append(w)
            continue
        head = rows * BLOCK
        torch.sum(w[:head].view(rows, BLOCK), 1, out=sums[first : first + rows])
        if tail:
            torch.sum(w[head:], 0, keepdim=True, out=sums[first + rows : first + rows + 1])
    if len(layout.small):
        sums.index_add_(0, layout.small, torch.cat(small))
    out = torch.zeros((2, len(words)), dtype=torch.int64, device=device)
    out[0].index_add_(0, layout.owner, sums)
    out[1].index_add_(0, layout.owner, sums.mul_(layout.weights))
    return out


def digests(tensors: list[torch.Tensor]) -> list[tuple[int, int]]:
    """``(sum, weighted sum)`` of each tensor's words, as unsigned 64-bit integers.

    The reductions run on each tensor's device, fused over the tensors of one device; one small
    vector per device comes to the host.

    Args:
        tensors: dense tensors (a DTensor: its local shard).
    """
    values: list[tuple[int, int]] = [(0, 0)] * len(tensors)
    by_device: dict[torch.device, list[int]] = {}
    words = [_int64_words(t) for t in tensors]
    for i, w in enumerate(words):
        by_device.setdefault(w.device, []).append(i)
    for indices in by_device.values():
        host = _device_digests([words[i] for i in indices]).cpu().tolist()
        for i, s, w in zip(indices, host[0], host[1], strict=True):
            values[i] = (s & _MASK, w & _MASK)
    return values


def tensor_digest(tensor: torch.Tensor) -> torch.Tensor:
    """``[sum, weighted sum]`` of a tensor's words as a 2-element int64 tensor on its device.

    Args:
        tensor: any dense tensor (a DTensor: its local shard).
    """
    return _device_digests([_int64_words(tensor)])[:, 0]


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
    tensors: list[torch.Tensor] = []
    owner: list[int] = []
    plain: list[list[tuple[int, int]]] = [[] for _ in keys]
    for index, (key, value) in enumerate(keys):
        leaves: list[tuple[str, Any]] = []
        _leaves(value, key, leaves)
        for path, leaf in leaves:
            if isinstance(leaf, torch.Tensor) and not leaf.is_sparse:
                names.append(path)
                tensors.append(leaf)
                owner.append(index)
            else:
                h = name_hash(f"{path}={leaf!r}")
                plain[index].append((h, h))
    values = digests(tensors)
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
