#!/usr/bin/env python
"""Run the reference's own test files against torchheal and print how many pass (issue 43).

A torchft user switches by changing the import; the reference's tests are the strongest check
of that promise. This copies the ``*_test.py`` files of the installed reference (torchft-nightly)
into a temporary directory, rewrites ``torchft`` to ``torchheal`` in module paths only (imports
and dotted ``patch`` targets; ``"torchft"`` in store prefixes and state keys stays), runs each
file in its own pytest process with a per-file timeout, and prints a table and the totals::

    .venv/bin/python scripts/reference_suite.py                 # every file
    .venv/bin/python scripts/reference_suite.py manager futures # files whose name contains these
    .venv/bin/python scripts/reference_suite.py --timeout 300 --keep

The rate is passed / (passed + failed + errors): skipped tests (CUDA only) are not counted. A
file that fails to collect or runs past its timeout is listed as such. Files that need the
reference's optional ``torchcomms`` backend are listed as not run. The reference's Rust
extension ``torchft._torchft`` is read as ``torchheal.coordination`` (the reference's public
``torchft.coordination`` re-exports its classes from there), and its test helpers
(``_test_utils``, ``_test/diloco_trainer``) are copied beside the tests. ``--source DIR`` runs
the test files of another checkout of the reference (``DIR/torchft``; an unpacked wheel of an
older torchft-nightly will do). ``--fixtures DIR`` supplies the JSON histories the DiLoCo
regression test compares with (named by test id, with or without the ``torchft.`` prefix).
A ``PYTHONPATH`` of the caller's comes after the copies, so another torchheal tree can be
measured. Issue 43's measurement (the reference at commit 73dafea, 2025-10-21)::

    pip download --no-deps torchft-nightly==2025.10.22 -d /tmp/ref && cd /tmp/ref && \
        python -m zipfile -e torchft_nightly-*.whl src
    .venv/bin/python scripts/reference_suite.py --source /tmp/ref/src \
        --fixtures ../shared/reference/diloco_fixtures

Not part of ``make test``: it needs the reference's test files and ``parameterized`` (the
reference's tests use it), and takes many minutes.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

# Reference modules with no torchheal counterpart by design; a file importing one is not run.
INTERNAL = ("torchft.torchcomms",)
# Test helpers of the reference: copied with the tests and imported as siblings.
HELPERS = ("_test_utils.py", "_test/diloco_trainer.py")

# A dotted module path or an import of the package: `torchft` followed by `.name`, or by
# ` import` in `from torchft import x`, or alone after `import`.
_TEST_MODULE = re.compile(r"\btorchft\.(?:\w+\.)*(\w+_test|diloco_trainer)\b")
_TEST_UTILS = re.compile(r"^(\s*)from\s+torchft\s+import\s+_test_utils\b", re.M)
_EXTENSION = re.compile(r"\btorchft\._torchft\b")
_DOTTED = re.compile(r"\btorchft(?=\.[A-Za-z_])")
_FROM_PKG = re.compile(r"^(\s*from\s+)torchft(\s+import\b)", re.M)
_IMPORT_PKG = re.compile(r"^(\s*import\s+)torchft\b(?!\.)", re.M)


def rewrite(source: str) -> str:
    """Rewrites module paths from the reference to torchheal.

    Another test file (``torchft.process_group_test``) becomes a sibling module of the copy,
    since test files are not part of either package.

    Args:
        source: a test file's text.
    """
    source = _TEST_MODULE.sub(r"\1", source)
    source = _TEST_UTILS.sub(r"\1import _test_utils", source)
    source = _EXTENSION.sub("torchheal.coordination", source)
    source = _DOTTED.sub("torchheal", source)
    source = _FROM_PKG.sub(r"\1torchheal\2", source)
    return _IMPORT_PKG.sub(r"\1torchheal", source)


def needs_internals(source: str) -> str | None:
    """The first reference-internal module a test file imports, or None.

    Args:
        source: the test file's original text.
    """
    for name in INTERNAL:
        # At module level only: an import guarded by try/except ImportError is optional.
        if re.search(rf"^(from|import)\s+{re.escape(name)}", source, re.M):
            return name.rstrip(".")
    return None


@dataclass
class Result:
    """One file's outcome."""

    name: str
    passed: int = 0
    failed: int = 0
    errors: int = 0
    skipped: int = 0
    status: str = "ok"
    seconds: float = 0.0


def _count(report: Path, result: Result) -> None:
    root = ET.parse(report).getroot()
    for case in root.iter("testcase"):
        tags = {child.tag for child in case}
        if "skipped" in tags:
            result.skipped += 1
        elif "failure" in tags:
            result.failed += 1
        elif "error" in tags:
            result.errors += 1
        else:
            result.passed += 1


def run_file(workdir: Path, name: str, timeout: float) -> Result:
    """Runs one test file in its own pytest process.

    Args:
        workdir: the directory holding the rewritten copies.
        name: the file's name there.
        timeout: seconds before the process is killed and the file is reported as hung.
    """
    result = Result(name)
    report = workdir / f"{name}.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", "pytest.ini"]
    cmd += ["--junitxml", str(report), name]
    # The copies come first; a PYTHONPATH of the caller's (another torchheal tree) next.
    paths = [str(workdir), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
    started = time.monotonic()
    # A new session so that a hung file's children (spawned ranks) are killed with it.
    proc = subprocess.Popen(
        cmd,
        cwd=workdir,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        result.status = "TIMEOUT"
    result.seconds = time.monotonic() - started
    (workdir / f"{name}.log").write_bytes(out)
    if report.exists():
        _count(report, result)
    if result.status == "ok" and (proc.returncode in (2, 3, 4) or not report.exists()):
        result.status = f"no collect (rc {proc.returncode})"
    elif result.status == "ok" and b"ERROR collecting" in out:
        result.status = "no collect"
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("only", nargs="*", help="run files whose name contains one of these")
    parser.add_argument("--timeout", type=float, default=420.0, help="seconds per file")
    parser.add_argument("--source", help="a checkout of the reference (holding torchft/)")
    parser.add_argument("--fixtures", help="the DiLoCo regression test's JSON fixtures")
    parser.add_argument("--keep", action="store_true", help="keep the copies and logs")
    args = parser.parse_args(argv)

    if args.source:
        ref = Path(args.source) / "torchft"
    else:
        spec = importlib.util.find_spec("torchft")  # finds the package without importing it
        if spec is None or not spec.submodule_search_locations:
            print("the reference (torchft-nightly) is not installed", file=sys.stderr)
            return 2
        ref = Path(next(iter(spec.submodule_search_locations)))
    if importlib.util.find_spec("parameterized") is None:
        print("the reference's tests need `pip install parameterized`", file=sys.stderr)
        return 2
    top = Path(tempfile.mkdtemp(prefix="reference_suite_"))
    # The DiLoCo regression test reads its fixtures from ../test_fixtures of its own directory.
    workdir = top / "tests"
    workdir.mkdir()
    (workdir / "pytest.ini").write_text("[pytest]\n")
    if args.fixtures:
        (top / "test_fixtures").mkdir()
        for fixture in Path(args.fixtures).glob("*.json"):
            name = fixture.name.removeprefix("torchft.")
            shutil.copyfile(fixture, top / "test_fixtures" / name)
    for helper in HELPERS:
        if (ref / helper).exists():
            (workdir / Path(helper).name).write_text(rewrite((ref / helper).read_text()))
    run, not_run = [], []
    for path in sorted(ref.rglob("*_test.py")):
        source = path.read_text()
        (workdir / path.name).write_text(rewrite(source))
        if args.only and not any(o in path.name for o in args.only):
            continue
        internal = needs_internals(source)
        if internal:
            not_run.append((path.name, internal))
        else:
            run.append(path.name)

    results = []
    for name in run:
        result = run_file(workdir, name, args.timeout)
        results.append(result)
        print(
            f"{name:36} {result.passed:4} passed {result.failed:4} failed {result.errors:3} "
            f"errors {result.skipped:3} skipped {result.seconds:6.1f}s  {result.status}",
            flush=True,
        )
    for name, internal in not_run:
        print(f"{name:36} not run: imports {internal}")

    passed = sum(r.passed for r in results)
    bad = sum(r.failed + r.errors for r in results)
    skipped = sum(r.skipped for r in results)
    broken = [r.name for r in results if r.status != "ok"]
    rate = 100.0 * passed / (passed + bad) if passed + bad else 0.0
    print(
        f"\nTOTAL {passed} passed, {bad} failed or errors, {skipped} skipped, "
        f"{len(broken)} files not collected or hung {broken}: {rate:.0f}% of what runs"
    )
    if args.keep:
        print(f"copies and logs kept in {workdir}")
    else:
        shutil.rmtree(top, ignore_errors=True)
    return 0 if rate >= 90.0 and not broken else 1


if __name__ == "__main__":
    sys.exit(main())
