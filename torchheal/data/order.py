"""The job's deterministic sample order: stream position -> dataset index (pure, no torch).

Position ``p`` is sample ``perm_e(p mod N)`` of epoch ``e = p // N``, where ``perm_e`` is a keyed
Feistel network over ``range(N)`` (cycle-walking), computed per index: nothing of size ``N`` is
built, and any position can be looked up alone.
"""

from __future__ import annotations

from collections.abc import Callable

_MASK64 = (1 << 64) - 1
_MASK32 = (1 << 32) - 1
ROUNDS = 4  # four rounds of a keyed Feistel network give a pseudo-random permutation
MAX_SIZE = 1 << 64  # each half of the network is at most 32 bits wide (the round's width)


def _mix64(x: int) -> int:
    """A 64-bit finaliser (splitmix64's): every input bit affects every output bit."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class Order:
    """Position in the stream -> dataset index, for a dataset of ``size`` samples.

    Args:
        size: number of samples in the dataset (> 0).
        seed: the permutation's seed; every replica group must use the same.
        shuffle: False reads every epoch in dataset order (position ``p`` is ``p mod size``).
    """

    def __init__(self, size: int, seed: int = 0, shuffle: bool = True) -> None:
        if not 0 < size <= MAX_SIZE:
            raise ValueError(f"dataset size must be in 1..2**64, got {size}")
        self.size = size
        self.seed = seed
        self.shuffle = shuffle
        bits = max(2, (size - 1).bit_length())
        bits += bits % 2  # a balanced network: two halves of equal width
        self._half = bits // 2
        self._mask = (1 << self._half) - 1
        self._keys_epoch = -1
        self._keys: tuple[int, ...] = ()

    def index(self, position: int) -> int:
        """The dataset index read at stream position ``position`` (>= 0)."""
        return self.indices(position, position + 1)[0]

    def indices(self, start: int, stop: int) -> tuple[int, ...]:
        """Dataset indices of stream positions ``start`` .. ``stop - 1``."""
        if start < 0:
            raise ValueError(f"stream position must be >= 0, got {start}")
        out: list[int] = []
        size = self.size
        while start < stop:  # one epoch at a time
            epoch, i = divmod(start, size)
            end = min(stop - start + i, size)
            if self.shuffle:
                permute = self._permutation(epoch)
                out.extend(map(permute, range(i, end)))
            else:
                out.extend(range(i, end))
            start += end - i
        return tuple(out)

    def _permutation(self, epoch: int) -> Callable[[int], int]:
        """Epoch ``epoch``'s permutation of ``range(size)``, one index at a time."""
        if epoch != self._keys_epoch:
            base = _mix64((self.seed & _MASK64) ^ _mix64(epoch & _MASK64))
            self._keys = tuple(_mix64(base + r) & _MASK32 for r in range(ROUNDS))
            self._keys_epoch = epoch
        k0, k1, k2, k3 = self._keys
        half, mask, size, m32 = self._half, self._mask, self.size, _MASK32

        # Unrolled and on 32-bit values: this runs once per sample read.
        # The round function is murmur3's 32-bit finaliser of (half ^ key).
        def permute(x: int) -> int:
            while True:  # cycle walking: the network permutes range(4**half), keep < size
                left, right = x >> half, x & mask
                y = ((right ^ k0) * 0x85EBCA6B) & m32
                y = ((y ^ (y >> 13)) * 0xC2B2AE35) & m32
                left ^= (y ^ (y >> 16)) & mask
                y = ((left ^ k1) * 0x85EBCA6B) & m32
                y = ((y ^ (y >> 13)) * 0xC2B2AE35) & m32
                right ^= (y ^ (y >> 16)) & mask
                y = ((right ^ k2) * 0x85EBCA6B) & m32
                y = ((y ^ (y >> 13)) * 0xC2B2AE35) & m32
                left ^= (y ^ (y >> 16)) & mask
                y = ((left ^ k3) * 0x85EBCA6B) & m32
                y = ((y ^ (y >> 13)) * 0xC2B2AE35) & m32
                right ^= (y ^ (y >> 16)) & mask
                x = (left << half) | right
                if x < size:
                    return x

        return permute
