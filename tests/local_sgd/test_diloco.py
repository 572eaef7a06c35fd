"""DiLoCo with a one-replica stand-in manager: validation, sync mechanics, numerics, state."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tests.local_sgd.fake_manager import FakeManager
from torchheal.local_sgd import DiLoCo
from torchheal.local_sgd.bucketing import plan_buckets


class RecordingSGD(torch.optim.SGD):
    """Outer optimizer that records the gradients it was stepped with."""

    def __init__(self, params, **kwargs) -> None:
        super().__init__(params, **kwargs)
        self.seen_grads: list[list[torch.Tensor]] = []

    def step(self, closure=None):  # type: ignore[override]
        self.seen_grads.append(
            [p.grad.clone() for g in self.param_groups for p in g["params"] if p.grad is not None]
        )
        return super().step(closure)


def _model(n_layers: int = 2) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(3, 3) for _ in range(n_layers)))  # 2 params per layer


def _inner_step(model: nn.Module, optimizer: torch.optim.Optimizer, delta: float = 2.0) -> None:
    """One inner step moving every parameter by ``+delta`` (SGD lr 1, grad -delta)."""
    for p in model.parameters():
        p.grad = torch.full_like(p, -delta)
    optimizer.step()


def _diloco(manager, model, outer=None, sync_every=2, fragments=None, **kwargs) -> DiLoCo:
    inner = torch.optim.SGD(model.parameters(), lr=1.0)
    fragments = fragments if fragments is not None else [model]
    outer = outer if outer is not None else RecordingSGD(model.parameters(), lr=1.0)
    diloco = DiLoCo(manager, fragments, inner, outer, sync_every=sync_every, **kwargs)
    diloco._test_inner = inner  # type: ignore[attr-defined]
    return diloco


# --- validation -----------------------------------------------------------------------------


def test_requires_synchronous_quorum() -> None:
    model = _model()
    with pytest.raises(ValueError, match="Using DiLoCo require synchronous quorum"):
        _diloco(FakeManager(use_async_quorum=True), model)


def test_sync_every_smaller_than_fragments() -> None:
    model = _model()
    with pytest.raises(ValueError, match="Only 1 fragment can be syncrhonized at a time"):
        _diloco(FakeManager(), model, fragments=[model[0], model[1]], sync_every=1)


def test_sync_every_not_multiple_of_fragments() -> None:
    model = _model()
    with pytest.raises(ValueError, match="sync_every must divide the number of fragments"):
        _diloco(FakeManager(), model, fragments=[model[0], model[1]], sync_every=3)


def test_delay_must_be_below_period() -> None:
    model = _model()
    with pytest.raises(ValueError, match="fragment_sync_delay"):
        _diloco(
            FakeManager(),
            model,
            fragments=[model[0], model[1]],
            sync_every=4,
            fragment_sync_delay=2,
        )


@pytest.mark.parametrize("alpha", [-0.1, 1.5])
def test_alpha_range(alpha: float) -> None:
    with pytest.raises(ValueError, match="fragment_update_alpha"):
        _diloco(FakeManager(), _model(), fragment_update_alpha=alpha)


def test_outer_optimizer_count_must_match_fragments() -> None:
    model = _model()
    outers = [torch.optim.SGD(model.parameters(), lr=1.0)] * 3
    with pytest.raises(ValueError, match="3 outer optimizers for 2 model fragments"):
        _diloco(FakeManager(), model, outer=outers, fragments=[model[0], model[1]], sync_every=2)


# --- healthy sync -------------------------------------------------------------------------


def test_healthy_counts_and_outer_state() -> None:
    model = _model()
    manager = FakeManager()
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9)
    diloco = _diloco(manager, model, outer=outer)
    assert set(manager.state_dict_fns) == {"StreamingDiLoCoFragment_0"}
    with diloco:
        _inner_step(model, diloco._test_inner)
        assert manager.quorum_calls == 0
        _inner_step(model, diloco._test_inner)
    assert manager.quorum_calls == 1
    assert manager.commit_calls == 1
    assert manager.allreduce_calls == len(list(model.parameters())) == 4
    assert manager.current_step() == 1
    assert all("momentum_buffer" in s for s in outer.state.values())
    assert len(outer.state) == 4


@pytest.mark.parametrize("bucketized", [False, True])
def test_pseudo_gradient_values(bucketized: bool) -> None:
    # Params move +2 in one inner step; the stand-in allreduce doubles: grad = 2 * (g - l) = -4.
    model = _model()
    manager = FakeManager(allreduce_fn=lambda t: t * 2)
    outer = RecordingSGD(model.parameters(), lr=1.0)
    diloco = _diloco(manager, model, outer=outer, sync_every=1, use_bucketization=bucketized)
    start = [p.detach().clone() for p in model.parameters()]
    with diloco:
        _inner_step(model, diloco._test_inner)
    assert len(outer.seen_grads) == 1
    for grad in outer.seen_grads[0]:
        torch.testing.assert_close(grad, torch.full_like(grad, -4.0))
    # Outer SGD lr 1 from the global weights: g - (-4) = g + 4; alpha 0 keeps the global.
    for p, s in zip(model.parameters(), start, strict=True):
        torch.testing.assert_close(p.detach(), s + 4)
        assert p.grad is None
    for name, p in model.named_parameters():
        torch.testing.assert_close(diloco._fragments[0].original_parameters[name], p.detach())
    expected_calls = 1 if bucketized else 4
    assert manager.allreduce_calls == expected_calls


def test_bucketized_uses_fewer_allreduces() -> None:
    counts = {}
    for bucketized in (False, True):
        model = _model(3)
        manager = FakeManager()
        diloco = _diloco(manager, model, sync_every=1, use_bucketization=bucketized)
        with diloco:
            _inner_step(model, diloco._test_inner)
        counts[bucketized] = manager.allreduce_calls
    assert counts[True] < counts[False] == 6


def test_bucketization_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHFT_USE_BUCKETIZATION", "True")
    model = _model()
    manager = FakeManager()
    diloco = _diloco(manager, model, sync_every=1)
    assert diloco.use_bucketization
    with diloco:
        _inner_step(model, diloco._test_inner)
    assert manager.allreduce_calls == 1


class Mixed(nn.Module):
    """Small fp32 params, an oversized fp32 param, and fp64 params interleaved."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.zeros(3))
        self.big = nn.Parameter(torch.zeros(64))  # 256 bytes
        self.b = nn.Parameter(torch.zeros(2, dtype=torch.float64))
        self.c = nn.Parameter(torch.zeros(4))
        self.d = nn.Parameter(torch.zeros(3, dtype=torch.float64))


def test_bucketization_big_tensor_and_mixed_dtypes() -> None:
    model = Mixed()
    manager = FakeManager(allreduce_fn=lambda t: t * 2)
    outer = RecordingSGD(model.parameters(), lr=1.0)
    # 64-byte buckets: a (12 B) + c (16 B) share one; big (256 B) alone; b + d (40 B) share.
    diloco = _diloco(
        manager, model, outer=outer, sync_every=1, use_bucketization=True, bucket_cap_mb=64 / 2**20
    )
    assert diloco.bucket_cap_mb == 64
    with diloco:
        _inner_step(model, diloco._test_inner)
    assert sorted(manager.allreduce_sizes) == sorted([3 + 4, 64, 2 + 3])
    grads = outer.seen_grads[0]
    assert [g.dtype for g in grads] == [p.dtype for p in model.parameters()]
    for grad in grads:
        torch.testing.assert_close(grad, torch.full_like(grad, -4.0))


def test_plan_buckets_rules() -> None:
    f32 = torch.zeros(4)  # 16 B
    f64 = torch.zeros(2, dtype=torch.float64)  # 16 B
    huge = torch.zeros(100)  # 400 B
    tensors = [f32, f64, huge, f32, f64, f32]
    assert plan_buckets(tensors, cap_bytes=32) == [[0, 3], [1, 4], [2], [5]]
    assert plan_buckets(tensors, cap_bytes=10**6) == [[0, 2, 3, 5], [1, 4]]
    with pytest.raises(ValueError, match="bucket cap"):
        plan_buckets(tensors, cap_bytes=0)


def test_should_quantize_is_forwarded() -> None:
    model = _model()
    manager = FakeManager()
    diloco = _diloco(manager, model, sync_every=1, should_quantize=True)
    with diloco:
        _inner_step(model, diloco._test_inner)
    assert manager.quantized_calls == manager.allreduce_calls == 4


# --- failure, streaming, merge ------------------------------------------------------------


def test_failed_commit_rolls_back_to_global_weights() -> None:
    model = _model()
    manager = FakeManager(allreduce_fn=lambda t: t * 2, commits=[False])
    outer = RecordingSGD(model.parameters(), lr=1.0)
    diloco = _diloco(manager, model, outer=outer, sync_every=2)
    start = [p.detach().clone() for p in model.parameters()]
    with diloco:
        _inner_step(model, diloco._test_inner)
        _inner_step(model, diloco._test_inner)
    assert manager.commit_calls == 1
    assert manager.current_step() == 0
    assert outer.seen_grads == []  # no outer step
    for (name, p), s in zip(model.named_parameters(), start, strict=True):
        torch.testing.assert_close(p.detach(), s)
        torch.testing.assert_close(diloco._fragments[0].original_parameters[name], s)
        assert p.grad is None


def test_fragments_selected_by_manager_step_and_retried_after_failure() -> None:
    model = _model()
    manager = FakeManager(commits=[True, False, True])
    outers = [RecordingSGD(layer.parameters(), lr=1.0) for layer in model]
    diloco = _diloco(manager, model, outer=outers, fragments=[model[0], model[1]], sync_every=4)
    with diloco:
        for _ in range(6):  # period 2: syncs after inner steps 2, 4, 6
            _inner_step(model, diloco._test_inner)
    # step 0 -> fragment 0 commits; step 1 -> fragment 1 fails; step 1 again -> fragment 1.
    assert [len(o.seen_grads) for o in outers] == [1, 1]
    assert manager.current_step() == 2
    assert manager.allreduce_calls == 6  # 2 params per fragment, 3 syncs


def test_fragment_sync_delay_orders_calls() -> None:
    model = _model()
    manager = FakeManager()
    diloco = _diloco(
        manager, model, fragments=[model[0], model[1]], sync_every=6, fragment_sync_delay=1
    )
    diloco_outer = [RecordingSGD(m.parameters(), lr=1.0) for m in model]
    diloco._fragments[0]._outer_optimizer = diloco_outer[0]
    with diloco:
        _inner_step(model, diloco._test_inner)
        assert manager.quorum_calls == 0
        _inner_step(model, diloco._test_inner)  # step H - d = 2: quorum + allreduce start
        assert (manager.quorum_calls, manager.allreduce_calls, manager.commit_calls) == (1, 2, 0)
        _inner_step(model, diloco._test_inner)  # step H = 3: commit
        assert manager.commit_calls == 1
    # The pseudo-gradient was taken after 2 inner steps (+4), not 3.
    for grad in diloco_outer[0].seen_grads[0]:
        torch.testing.assert_close(grad, torch.full_like(grad, -4.0))


@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
def test_alpha_merge(alpha: float) -> None:
    model = _model()
    manager = FakeManager(allreduce_fn=lambda t: t * 0.5)
    diloco = _diloco(manager, model, sync_every=1, fragment_update_alpha=alpha)
    start = [p.detach().clone() for p in model.parameters()]
    with diloco:
        _inner_step(model, diloco._test_inner)  # local = s + 2, delta = -2, averaged -1
    for (name, p), s in zip(model.named_parameters(), start, strict=True):
        global_w = s + 1  # outer SGD lr 1 with grad -1
        local_w = s + 2
        torch.testing.assert_close(diloco._fragments[0].original_parameters[name], global_w)
        torch.testing.assert_close(p.detach(), global_w + alpha * (local_w - global_w))


def test_perform_sync_without_prepare_raises() -> None:
    model = _model()
    diloco = _diloco(FakeManager(), model)
    with pytest.raises(RuntimeError, match="without a prior prepare_sync"):
        diloco._fragments[0].perform_sync()


# --- state registered for healing ---------------------------------------------------------


def test_state_dict_reload_gives_identical_global_state() -> None:
    def build(seed: int):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
        manager = FakeManager(allreduce_fn=lambda t: t * 0.5)
        outers = [torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9) for m in model]
        diloco = _diloco(manager, model, outer=outers, fragments=[model[0], model[1]], sync_every=4)
        return model, manager, outers, diloco

    model_a, manager_a, outers_a, diloco_a = build(0)
    with diloco_a:
        for _ in range(4):
            _inner_step(model_a, diloco_a._test_inner)
    assert manager_a.current_step() == 2
    assert set(manager_a.state_dict_fns) == {
        "StreamingDiLoCoFragment_0",
        "StreamingDiLoCoFragment_1",
    }

    _, manager_b, outers_b, diloco_b = build(1)
    assert not torch.equal(
        diloco_b._fragments[0].original_parameters["weight"],
        diloco_a._fragments[0].original_parameters["weight"],
    )
    captured = manager_a.capture_state()
    manager_b.load_captured_state(captured)
    for frag_a, frag_b in zip(diloco_a._fragments, diloco_b._fragments, strict=True):
        for name, t in frag_a.original_parameters.items():
            torch.testing.assert_close(frag_b.original_parameters[name], t)
        # Backups are reused (copied into), not replaced by the received tensors.
        received = captured["user"][frag_a.state_dict_key]["original_parameters"]
        assert all(
            frag_b.original_parameters[n].data_ptr() != received[n].data_ptr() for n in received
        )
    for oa, ob in zip(outers_a, outers_b, strict=True):
        sa, sb = oa.state_dict(), ob.state_dict()
        assert sa["param_groups"] == sb["param_groups"]
        assert sa["state"].keys() == sb["state"].keys()
        for k in sa["state"]:
            torch.testing.assert_close(sa["state"][k], sb["state"][k])


def test_state_dict_with_wrong_names_is_rejected() -> None:
    model = _model()
    manager = FakeManager()
    diloco = _diloco(manager, model)
    state = copy.deepcopy(diloco._fragments[0].state_dict())
    state["original_parameters"]["bogus"] = torch.zeros(1)
    with pytest.raises(KeyError, match="unexpected \\['bogus'\\]"):
        diloco._fragments[0].load_state_dict(state)
