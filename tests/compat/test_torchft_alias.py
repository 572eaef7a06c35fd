"""The opt-in ``torchft`` import name of ``compat/`` (never installed in the test venv).

The test venv has the real reference installed, so the compat package itself is only imported
here to show it refuses to share an environment with it. The aliasing mechanism is loaded from
its file and installed under a made-up name; the full package runs in the torchtitan example's
own venv (``make torchtitan``), where ``import torchft`` is torchheal.
"""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

COMPAT_SRC = Path(__file__).resolve().parents[2] / "compat" / "src"
PROBE = "torchft_alias_probe"


def _load(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def probe() -> Iterator[str]:
    alias = _load("compat_alias_under_test", COMPAT_SRC / "torchft" / "_alias.py")
    parent = types.ModuleType(PROBE)
    parent.__path__ = []  # a package with no files of its own: everything is aliased
    sys.modules[PROBE] = parent
    alias.install(PROBE, "torchheal")
    alias.install(PROBE, "torchheal")  # idempotent
    try:
        yield PROBE
    finally:
        sys.meta_path[:] = [f for f in sys.meta_path if getattr(f, "alias", None) != PROBE]
        for name in [n for n in sys.modules if n == PROBE or n.startswith(PROBE + ".")]:
            del sys.modules[name]


def test_alias_serves_the_same_module_objects(probe: str) -> None:
    import torchheal.checkpointing.pg_transport
    import torchheal.process_group

    pg = importlib.import_module(f"{probe}.process_group")
    assert pg is torchheal.process_group
    transport = importlib.import_module(f"{probe}.checkpointing.pg_transport")
    assert transport is torchheal.checkpointing.pg_transport
    assert transport.PGTransport is torchheal.checkpointing.pg_transport.PGTransport
    # The parent package gets the attribute, as after a normal import.
    assert sys.modules[probe].process_group is torchheal.process_group
    from torchft_alias_probe.manager import Manager  # type: ignore[import-not-found]

    import torchheal

    assert Manager is torchheal.Manager


def test_alias_of_a_missing_module_is_the_usual_error(probe: str) -> None:
    with pytest.raises(ModuleNotFoundError, match=rf"No module named '{probe}\.no_such'"):
        importlib.import_module(f"{probe}.no_such")


def test_compat_refuses_to_share_an_environment_with_the_reference(tmp_path: Path) -> None:
    # A reference distribution's metadata on the path, whether or not one is installed here.
    dist_info = tmp_path / "torchft_nightly-2026.10.26.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: torchft-nightly\nVersion: 2026.10.26\n"
    )
    env_path = f"{COMPAT_SRC}:{tmp_path}"
    proc = subprocess.run(
        [sys.executable, "-c", "import torchft"],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"},
        timeout=60,
    )
    assert proc.returncode != 0
    assert "ImportError" in proc.stderr
    assert "must never share an environment" in proc.stderr
    assert "torchft-nightly 2026.10.26" in proc.stderr


def test_torchft_lighthouse_command_is_torchheals_lighthouse(
    capsys: pytest.CaptureFixture[str],
) -> None:
    cli = _load("compat_lighthouse_under_test", COMPAT_SRC / "torchft" / "_lighthouse.py")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--min_replicas", "--join_timeout_ms", "--quorum_tick_ms", "--bind"):
        assert flag in out
