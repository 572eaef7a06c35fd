"""Fuzz test sizes: a few hundred inputs per endpoint (``bench/fuzz.py`` sends 10,000 each).

Every run of the same commit draws the same inputs (hypothesis ``derandomize=True``, no example
database), so a failure in CI reproduces anywhere on that commit (hypothesis also draws
constants found in torchheal's modules: a code change can change the inputs);
``TORCHHEAL_FUZZ_EXAMPLES`` scales the generated inputs.
"""

from __future__ import annotations

import os

import pytest

# Generated inputs per endpoint, on top of each endpoint's known hostile inputs.
EXAMPLES = int(os.environ.get("TORCHHEAL_FUZZ_EXAMPLES", "100"))


@pytest.fixture
def examples() -> int:
    return EXAMPLES
