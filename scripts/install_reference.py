"""Install the reference implementation (torchft-nightly) next to torchheal, for interop tests.

Installed with --no-deps so it can never change our torch or protobuf; only the small pure-Python
packages its import needs are added. Exits non-zero when it cannot be installed.
"""

import subprocess
import sys

REFERENCE = "torchft-nightly==2026.10.26"


def main() -> int:
    pip = [sys.executable, "-m", "pip", "install", "-q"]
    try:
        subprocess.run([*pip, "--no-deps", REFERENCE], check=True)
    except subprocess.CalledProcessError as e:
        print(f"could not install {REFERENCE}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
