"""``python -m torchheal.cli``: the same as the ``torchheal`` console script."""

import sys

from torchheal.cli import main

sys.exit(main())
