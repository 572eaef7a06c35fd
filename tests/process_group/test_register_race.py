"""ProcessGroup.register from several threads of one process (issue 43).

Replica groups run as threads of one process in tests and notebooks; each registers its group
under the same name (``ft_init_device_mesh``). torch's backend registry is process-global, so
unserialised registrations replace each other's factory and a group gets another's.
"""

from __future__ import annotations

import threading

import pytest
import torch.distributed as dist

from torchheal.process_group import ProcessGroup, ProcessGroupDummy


@pytest.fixture
def default_pg():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_three_threads_register_the_same_name_at_once(default_pg: None, monkeypatch) -> None:
    real_register_backend = dist.Backend.register_backend
    # Holds each thread between registering the backend and creating its group until all three
    # have registered: the interleaving that loses factories. With registration serialised the
    # others cannot arrive while the first holds the lock, so its wait times out once and the
    # broken barrier lets every later thread through at once.
    all_registered = threading.Barrier(3, timeout=1.0)

    def register_then_wait(*args, **kwargs):
        real_register_backend(*args, **kwargs)
        try:
            all_registered.wait()
        except threading.BrokenBarrierError:
            pass

    monkeypatch.setattr(dist.Backend, "register_backend", staticmethod(register_then_wait))

    groups = [ProcessGroupDummy(0, 1) for _ in range(3)]
    results: list[object] = [None] * 3

    def register(i: int) -> None:
        try:
            results[i] = groups[i].register("same_name")
        except Exception as e:  # the failure is what the test reports
            results[i] = e

    threads = [threading.Thread(target=register, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    try:
        for group, result in zip(groups, results, strict=True):
            assert result is group, result
        names = {group.group_name for group in groups}
        assert len(names) == 3
    finally:
        for result in results:
            if isinstance(result, ProcessGroup):
                result.unregister()
