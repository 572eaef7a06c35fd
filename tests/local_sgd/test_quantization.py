"""8-bit per-row quantization and the quantized collectives over a real 2-rank gloo group.

The two ranks are threads of this process, each with its own gloo process group rendezvousing
through a TCPStore on 127.0.0.1 port 0. Quantized results are compared with the exact
reduction under the error bound derived from the quantization step (see
``_allreduce_bound``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from torchheal.collectives import (
    allocate_reduce_scatter_output,
    allreduce_quantized,
    get_padded_sizes,
    reduce_scatter_quantized,
)
from torchheal.quantization import (
    dequantize_rows,
    fused_dequantize_from_fp8,
    fused_quantize_into_fp8,
    group_chunk_bytes,
    quantize_rows,
    quantized_dtype_for,
    row_bytes,
)

WORLD = 2
TIMEOUT = timedelta(seconds=20)


# --- pure quantization --------------------------------------------------------------------


def _rows_with_scales(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scales = torch.logspace(-3, 3, rows).unsqueeze(1)  # rows of very different magnitude
    return torch.randn(rows, cols, generator=g) * scales


def test_int8_round_trip_error_is_half_a_step_per_row() -> None:
    x = _rows_with_scales(16, 37)
    x[3] = 0.0
    q = quantize_rows(x, torch.int8)
    assert q.dtype == torch.uint8
    assert q.shape == (16, row_bytes(37)) == (16, 44)
    y = dequantize_rows(q, 37, torch.int8)
    absmax = x.abs().amax(dim=1, keepdim=True)
    step = absmax / 127
    assert torch.all((y - x).abs() <= step / 2 * (1 + 1e-5))
    assert torch.equal(y[3], torch.zeros(37))  # an all-zero row stays exactly zero
    assert torch.all(y.abs().amax(dim=1, keepdim=True) <= absmax * (1 + 1e-6))


def test_fp8_round_trip_error_is_relative() -> None:
    x = _rows_with_scales(8, 33, seed=1)
    y = dequantize_rows(quantize_rows(x, torch.float8_e4m3fn), 33, torch.float8_e4m3fn)
    absmax = x.abs().amax(dim=1, keepdim=True)
    # e4m3: 3 mantissa bits -> relative error <= 2^-4; subnormals -> absolute 2^-10 scaled.
    bound = x.abs() / 16 + absmax / 448 * 2**-10
    assert torch.all((y - x).abs() <= bound * (1 + 1e-5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_group_buffer_round_trip(dtype: torch.dtype) -> None:
    tensors = [
        torch.randn(7, dtype=dtype),
        torch.randn(5, 3, 2, dtype=dtype),
        torch.randn((), dtype=dtype),
    ]
    buf = fused_quantize_into_fp8(tensors, group_size=3, qdtype=torch.int8)
    # rows padded to multiples of 3: (9 rows of 1) + (6 rows of 6) + (3 rows of 1)
    expected_chunk = 3 * row_bytes(1) + 2 * row_bytes(6) + 1 * row_bytes(1)
    assert group_chunk_bytes(tensors, 3) == expected_chunk
    assert buf.numel() == 3 * expected_chunk
    out = [torch.empty_like(t) for t in tensors]
    fused_dequantize_from_fp8(out, buf, group_size=3, qdtype=torch.int8)
    for t, o in zip(tensors, out, strict=True):
        assert o.shape == t.shape and o.dtype == t.dtype
        rows = _as_rows(t)
        absmax = rows.abs().amax(dim=1, keepdim=True)
        err = (o.float().reshape(rows.shape) - rows).abs()
        # half a quantization step, plus the rounding of the result to the tensor's dtype
        assert torch.all(err <= absmax / 254 + rows.abs() * torch.finfo(dtype).eps + 1e-7)


def test_rejects_unsupported_and_mixed_inputs() -> None:
    with pytest.raises(ValueError, match="float32, float16 and bfloat16"):
        fused_quantize_into_fp8([torch.zeros(3, dtype=torch.float64)], 2)
    with pytest.raises(ValueError, match="share one dtype and device"):
        fused_quantize_into_fp8([torch.zeros(3), torch.zeros(3, dtype=torch.float16)], 2)


def test_padded_sizes_and_reduce_scatter_output() -> None:
    tensors = [torch.zeros(5), torch.zeros(3, 4), torch.zeros(4, 2, 2)]
    sizes = get_padded_sizes(tensors, 2)
    assert sizes == [torch.Size((6, 1)), torch.Size((4, 4)), torch.Size((4, 2, 2))]
    out, padded = allocate_reduce_scatter_output(tensors, 2)
    assert padded == sizes
    assert out.numel() == 3 + 8 + 8 and out.dtype == torch.float32


# --- collectives over gloo ----------------------------------------------------------------


class _NoAlltoall:
    """A process group without all-to-all, to exercise the allgather fallback."""

    def __init__(self, pg: Any) -> None:
        self._pg = pg

    def alltoall_base(self, *args: Any) -> Any:
        raise NotImplementedError("no alltoall here")

    def allgather(self, *args: Any) -> Any:
        return self._pg.allgather(*args)

    def size(self) -> int:
        return self._pg.size()

    def rank(self) -> int:
        return self._pg.rank()


class _Pair:
    """Two gloo ranks on two threads; ``run(fn)`` calls ``fn(rank, pg)`` on both at once."""

    def __init__(self) -> None:
        self._master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self._pool = ThreadPoolExecutor(max_workers=WORLD)
        port = self._master.port

        def make(rank: int) -> Any:
            store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)
            return dist.ProcessGroupGloo(dist.PrefixStore("q", store), rank, WORLD, TIMEOUT)

        self.pgs = self._gather([self._pool.submit(make, r) for r in range(WORLD)])

    @staticmethod
    def _gather(futures: list) -> list:
        return [f.result(timeout=TIMEOUT.total_seconds()) for f in futures]

    def run(self, fn: Callable[[int, Any], Any]) -> list:
        return self._gather([self._pool.submit(fn, r, self.pgs[r]) for r in range(WORLD)])

    def close(self) -> None:
        self._pool.shutdown(wait=True)


@pytest.fixture(scope="module")
def pair() -> Iterator[_Pair]:
    p = _Pair()
    yield p
    p.close()


def _inputs(rank: int, shape: tuple[int, ...], dtype: torch.dtype, mult: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    return (torch.randn(shape, generator=g) * mult).to(dtype)


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """The quantizer's 2-D view: dim 0 = rows; 1-D and 0-d tensors are one value per row."""
    return t.float().reshape(t.shape[0], -1) if t.dim() > 1 else t.float().reshape(-1, 1)


def _allreduce_bound(inputs: list[torch.Tensor], exact: torch.Tensor, avg: bool) -> torch.Tensor:
    """Per-element bound: half a step per rank's quantization (summed), half a step of the
    requantized result, and the final rounding to the tensor's dtype."""
    first = sum(_as_rows(x).abs().amax(dim=1, keepdim=True) / 254 for x in inputs)
    if avg:
        first = first / len(inputs)
    rows = _as_rows(exact)
    reduced_max = rows.abs().amax(dim=1, keepdim=True) + first
    second = reduced_max / 254
    eps = torch.finfo(exact.dtype).eps
    return first + second + (rows.abs() + first + second) * eps + 1e-6


SHAPES = [(7,), (5, 3), (256,), (33, 17)]


@pytest.mark.parametrize("op", ["SUM", "AVG"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_allreduce_quantized_matches_exact(pair: _Pair, op: str, dtype: torch.dtype) -> None:
    reduce_op = getattr(ReduceOp, op)
    mult = 100.0 if dtype == torch.float16 else 1000.0  # fp16 max is 65504

    def work(rank: int, pg: Any) -> list[torch.Tensor]:
        tensors = [_inputs(rank, s, dtype, mult) for s in SHAPES]
        allreduce_quantized(tensors, reduce_op, pg).wait()
        return tensors

    results = pair.run(work)
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))  # ranks agree
    for i, shape in enumerate(SHAPES):
        inputs = [_inputs(r, shape, dtype, mult) for r in range(WORLD)]
        exact = sum(x.float() for x in inputs)
        if op == "AVG":
            exact = exact / WORLD
        got = results[0][i]
        assert got.dtype == dtype and got.shape == shape
        err = (_as_rows(got) - _as_rows(exact)).abs()
        bound = _allreduce_bound(inputs, exact.to(dtype), op == "AVG")
        assert torch.all(err <= bound), f"{shape}: max err {err.max()} vs bound {bound.max()}"
        assert err.max() > 0  # it really went through quantization


def test_allreduce_quantized_future_and_options(pair: _Pair) -> None:
    def work(rank: int, pg: Any) -> tuple[bool, bool]:
        t = torch.full((4, 2), float(rank + 1))
        opts = dist.AllreduceOptions()
        opts.reduceOp = ReduceOp.AVG
        w = allreduce_quantized([t], opts, pg)
        value = w.get_future().wait()
        return value[0] is t, torch.allclose(t, torch.full((4, 2), 1.5), atol=1.5 / 127)

    assert pair.run(work) == [(True, True), (True, True)]


def test_allgather_fallback_gives_same_result(pair: _Pair) -> None:
    def work(rank: int, pg: Any) -> tuple[torch.Tensor, torch.Tensor]:
        a = _inputs(rank, (9, 5), torch.float32, 10.0)
        b = a.clone()
        allreduce_quantized([a], ReduceOp.SUM, pg).wait()
        allreduce_quantized([b], ReduceOp.SUM, _NoAlltoall(pg)).wait()
        return a, b

    for a, b in pair.run(work):
        assert torch.equal(a, b)


@pytest.mark.parametrize("op", ["SUM", "AVG"])
def test_reduce_scatter_quantized(pair: _Pair, op: str) -> None:
    shapes = [(5,), (3, 4)]

    def work(rank: int, pg: Any) -> torch.Tensor:
        inputs = [_inputs(rank, s, torch.float32, 10.0) for s in shapes]
        out, _ = allocate_reduce_scatter_output(inputs, WORLD)
        reduce_scatter_quantized(out, inputs, getattr(ReduceOp, op), pg).wait()
        return out

    outs = pair.run(work)
    for rank, out in enumerate(outs):
        expected_parts = []
        bound_parts = []
        for s in shapes:
            inputs = [_inputs(r, s, torch.float32, 10.0) for r in range(WORLD)]
            exact = sum(_as_rows(x) for x in inputs)
            if op == "AVG":
                exact = exact / WORLD
            bound = _allreduce_bound(inputs, exact, op == "AVG")
            rpr = math.ceil(exact.shape[0] / WORLD)
            pad = rpr * WORLD - exact.shape[0]
            exact = torch.cat([exact, exact.new_zeros(pad, exact.shape[1])])
            bound = torch.cat([bound, bound.new_zeros(pad, bound.shape[1]) + 1e-6])
            expected_parts.append(exact[rank * rpr : (rank + 1) * rpr].reshape(-1))
            bound_parts.append(bound[rank * rpr : (rank + 1) * rpr].reshape(-1))
        expected = torch.cat(expected_parts)
        assert torch.all((out - expected).abs() <= torch.cat(bound_parts))


@pytest.mark.parametrize("op", [ReduceOp.MAX, ReduceOp.PRODUCT])
def test_only_sum_and_avg(op: ReduceOp) -> None:
    with pytest.raises(NotImplementedError, match="SUM and AVG"):
        allreduce_quantized([torch.zeros(2)], op, None)  # type: ignore[arg-type]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_allreduce_quantized_on_gpu(pair: _Pair, dtype: torch.dtype) -> None:
    # CUDA tensors over Gloo: the quantization runs on the GPU, in fp8 where the device has
    # it natively (compute capability >= 9.0), and both ranks end with the same values.
    device = torch.device("cuda")
    fp8 = torch.cuda.get_device_capability(device) >= (9, 0)
    assert quantized_dtype_for(device) == (torch.float8_e4m3fn if fp8 else torch.int8)

    def work(rank: int, pg: Any) -> list[torch.Tensor]:
        tensors = [_inputs(rank, s, dtype, 1000.0).to(device) for s in SHAPES]
        allreduce_quantized(tensors, ReduceOp.SUM, pg).wait()
        torch.cuda.synchronize(device)
        return [t.cpu() for t in tensors]

    results = pair.run(work)
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))
    for i, shape in enumerate(SHAPES):
        inputs = [_inputs(r, shape, dtype, 1000.0) for r in range(WORLD)]
        exact = sum(x.float() for x in inputs)
        got = results[0][i]
        assert got.dtype == dtype and got.shape == shape
        err = (_as_rows(got) - _as_rows(exact)).abs()
        if fp8:  # 3 mantissa bits: half a step is 1/16 of the value, per quantization
            first = sum(_as_rows(x).abs() for x in inputs) / 16
            rows = _as_rows(exact).abs()
            bound = first + (rows + first) / 16 + rows.amax(dim=1, keepdim=True) * 2**-8
            bound = bound + (rows + 2 * first) * torch.finfo(dtype).eps + 1e-6
        else:
            bound = _allreduce_bound(inputs, exact.to(dtype), avg=False)
        assert torch.all(err <= bound), f"{shape}: max err {err.max()}"
        assert err.max() > 0
