"""The spare template imports while the groups start, where it can do so at idle priority.

It used to start only once every group had committed a step, so a failure in the first seconds
of training found it still importing: on the lent H200 the first restart of the DDP example
(killed 12 s in) took 10.0 and 9.8 s, the later ones 1.8-2.0 s. Started with the groups, at
idle priority (CPU the starting groups leave), the first took 1.9 s like the rest. Where a
spare cannot preload idle (an unprivileged user: see ``spare_priority``), the template still
waits until the job trains, so it never slows the groups' own start.
"""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest

from torchheal.launcher import Launcher
from torchheal.launcher.spare_fork import supported
from torchheal.launcher.spare_priority import can_preload_idle

pytestmark = pytest.mark.skipif(not supported(), reason="forked spares are Linux only")

# The group waits for the file the template's preload writes: before its first step where the
# template starts with the groups, after it where the template waits for the job to train.
CHILD = textwrap.dedent(
    """
    import os, sys, time
    from torchheal.launcher.events import emit
    workdir, early = sys.argv[1], sys.argv[2] == "early"

    def wait_for_template():
        deadline = time.time() + 60
        while not os.path.exists(os.path.join(workdir, "template-imported")):
            assert time.time() < deadline, "the spare template never started"
            time.sleep(0.05)

    if early:
        wait_for_template()
    emit("step", 0, step=1, committed=True)
    if not early:
        wait_for_template()
    emit("done", 0, step=1, digest="abc")
    """
)

MARKER = "import os\nopen(os.path.join(os.environ['MARK_DIR'], 'template-imported'), 'w').close()\n"


def test_the_template_starts_with_the_groups_where_it_can_import_at_idle_priority(
    tmp_path: Path,
) -> None:
    (tmp_path / "child.py").write_text(CHILD)
    (tmp_path / "marker.py").write_text(MARKER)
    when = "early" if can_preload_idle() else "late"
    launcher = Launcher(
        [sys.executable, str(tmp_path / "child.py"), str(tmp_path), when],
        replicas=1,
        lighthouse_addr="http://lighthouse.invalid:1",
        deadline_s=90,
        env={"PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path]), "MARK_DIR": str(tmp_path)},
        startup_grace_s=0.0,
        warm_spares=1,
        spare_preload=("marker",),
    )
    result = launcher.run()
    assert not result.timed_out
    group = result.groups[0]
    assert group.done and len(group.starts) == 1, (group.crashes, group.starts)
