"""Run ``torchtitan.train`` unchanged, with run-time patches for what torchtitan 0.3.0 lacks.

Use it where ``torchrun`` would run ``-m torchtitan.train``::

    torchrun --nproc_per_node=1 --rdzv_backend c10d --rdzv_endpoint=localhost:0 \\
        examples/torchtitan/cpu_train.py --module torchft.llama3 ...

torchtitan 0.3.0 targets torch nightly and CUDA. On a machine without an accelerator it stops at
several places that have nothing to do with fault tolerance (the example README lists them as
B1-B7); the patches below go around them, in this process only. They touch torchtitan and torch,
never torchheal: the fault-tolerance library (torchheal through the ``torchft`` import name, or
the real torchft) runs exactly as installed. With a CUDA device only the torch-version patch
(B6) applies.
"""

from __future__ import annotations

import math
import os
import runpy
import sys
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

ON_CPU = not torch.cuda.is_available()


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


def _patch_device_is_cpu() -> None:
    """B2: torchtitan falls back to "cuda" when no accelerator is found; make it "cpu".

    Must run before torchtitan is imported (it reads the device type at import time). With
    device "cpu" torchtitan also picks the gloo backend for its own process group.
    """
    torch._utils._get_available_device_type = lambda: "cpu"


def _patch_cpu_memory_api() -> None:
    """B3: the device memory monitor calls CUDA-only functions on ``torch.cpu``."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    fill = {
        "get_device_name": lambda *a, **k: "cpu",
        "get_device_properties": lambda *a, **k: SimpleNamespace(name="cpu", total_memory=total),
        "reset_peak_memory_stats": _noop,
        "empty_cache": _noop,
        "memory_stats": lambda *a, **k: {},
    }
    for name, fn in fill.items():
        if not hasattr(torch.cpu, name):
            setattr(torch.cpu, name, fn)


def _patch_barrier_device_ids() -> None:
    """B5: ``barrier(device_ids=[torch.cpu.current_device()])`` passes the string "cpu"."""
    barrier = dist.barrier

    def cpu_barrier(*args: Any, device_ids: Any = None, **kwargs: Any) -> Any:
        if device_ids is not None and not all(isinstance(d, int) for d in device_ids):
            device_ids = None
        return barrier(*args, device_ids=device_ids, **kwargs)

    dist.barrier = cpu_barrier


def _patch_set_timeout() -> None:
    """B6: torch 2.13 has no ``torch.distributed.set_timeout`` (torchtitan targets nightly)."""
    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = lambda timeout, group=None: c10d._set_pg_timeout(timeout, group)


def _dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    score_mod: Any = None,
    block_mask: Any = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_aux: Any = None,
    kernel_options: Any = None,
) -> tuple[torch.Tensor, Any]:
    """FlexAttention's contract computed densely (softmax(QK^T) V with the block mask's mask).

    Inputs are (batch, heads, length, head_dim). Returns the output and an ``AuxOutput`` with
    the log-sum-exp when asked, as ``flex_attention(..., return_aux=...)`` does.
    """
    from torch.nn.attention.flex_attention import AuxOutput, create_mask

    if score_mod is not None:
        raise NotImplementedError("cpu_train.py's dense attention supports no score_mod")
    batch, heads, q_len, head_dim = q.shape
    kv_len = k.shape[-2]
    if enable_gqa and k.shape[1] != heads:
        repeat = heads // k.shape[1]
        k = k.repeat_interleave(repeat, dim=1)
        v = v.repeat_interleave(repeat, dim=1)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    scores = torch.matmul(q, k.transpose(-2, -1)).float() * scale
    if block_mask is not None:
        keep = create_mask(block_mask.mask_mod, batch, 1, q_len, kv_len, device=q.device)
        scores = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    # Fully masked rows give nan (-inf - -inf): they attend to nothing.
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
    out = torch.matmul(probs.to(v.dtype), v)
    want_lse = return_aux is not None and getattr(return_aux, "lse", False)
    return out, AuxOutput(lse=lse if want_lse else None)


def _patch_flex_attention() -> None:
    """B4: FlexAttention has no backward on CPU; the llama3 models offer no other backend."""
    from torchtitan.models.common.attention import FlexAttention

    FlexAttention._compiled_flex_attn = staticmethod(_dense_attention)
    # Not a blocker, a cost: compiling create_block_mask with inductor takes ~35 s per process
    # on a 2-core machine, longer than a whole test run; the eager function gives the same mask.
    from torch.nn.attention.flex_attention import create_block_mask
    from torchtitan.models.common import attention

    attention._compiled_create_block_mask = create_block_mask


def _log_commit_decisions() -> None:
    """Opt-in (``FT_LOG_COMMITS=1``, set by ``run_scenarios.py``): print torchheal's per-step
    commit decisions, which it logs at DEBUG, so the scenarios can count the syncs that
    committed with both groups. torchtitan's handler only passes INFO and above."""
    import logging

    handler = logging.StreamHandler(sys.stdout)
    handler.setLevel(logging.DEBUG)
    handler.addFilter(lambda record: record.levelno < logging.INFO)
    handler.setFormatter(logging.Formatter("[ft] %(name)s - %(message)s"))
    manager_logger = logging.getLogger("torchheal.manager")
    manager_logger.setLevel(logging.DEBUG)
    manager_logger.addHandler(handler)


def main() -> None:
    """Applies the patches this machine needs, then runs ``torchtitan.train`` as ``__main__``."""
    if os.environ.get("FT_LOG_COMMITS") == "1":
        _log_commit_decisions()
    _patch_set_timeout()
    if ON_CPU:
        _patch_device_is_cpu()
        _patch_cpu_memory_api()
        _patch_barrier_device_ids()
        _patch_flex_attention()
    sys.argv[0] = "torchtitan.train"
    runpy.run_module("torchtitan.train", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
