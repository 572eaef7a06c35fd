"""The divergence guard with the reference's lighthouse (torchft-nightly): nothing new travels
through it, so a flipped bit is found and repaired there too."""

from __future__ import annotations

from pathlib import Path

from tests.divergence import test_guard_processes as guard_tests
from tests.reference import import_reference

reference = import_reference("torchft.coordination")


def test_a_flipped_bit_is_repaired_with_the_reference_lighthouse(tmp_path: Path) -> None:
    guard_tests.test_a_flipped_bit_is_repaired_from_the_majority(
        tmp_path, lighthouse_cls=reference.LighthouseServer
    )
