"""The CPU kernel library's helpers besides decode attention (`kvq_lab.kernels.cpu_native`): the finiteness check of
every new key and value, and the native Walsh-Hadamard transform, against their PyTorch twins bit for bit."""

from __future__ import annotations

import pytest
import torch

from kvq_lab.kernels import cpu_build, cpu_kernel, cpu_native
from kvq_lab.quant.transforms import hadamard

pytestmark = pytest.mark.skipif(cpu_kernel.build_error() is not None, reason="no C compiler: no CPU kernel")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_all_finite_reads_every_element(dtype):
    """The C check finds a NaN, +inf or -inf at any position of contiguous and transposed tensors (the projections'
    layout), says True for finite tensors up to the dtype's largest value (where an fp32 sum would overflow), and
    agrees with the PyTorch check on everything else."""
    from kvq_lab.kernels.torch_path import all_finite as torch_all_finite

    g = torch.Generator().manual_seed(3)
    big = torch.finfo(dtype).max
    for shape in [(1, 3, 1, 64), (2, 5, 7, 24), (1, 1, 1, 1), (3, 2, 0, 8)]:
        x = torch.randn(*shape, generator=g).to(dtype)
        for t in (x, x.transpose(1, 2)):
            assert cpu_native.all_finite(t) and torch_all_finite(t)
        if not x.numel():
            continue
        full = torch.full(shape, big, dtype=dtype)
        assert cpu_native.all_finite(full)  # finite; a sum of them is not
        for bad in (float("nan"), float("inf"), float("-inf")):
            for i in torch.randint(0, x.numel(), (5,), generator=g).tolist() + [0, x.numel() - 1]:
                y = x.clone()
                y.view(-1)[i] = bad
                assert not cpu_native.all_finite(x, y) and not cpu_native.all_finite(y.transpose(1, 2))
                assert not torch_all_finite(y)
    strided = torch.randn(4, 6, generator=g).to(dtype)[:, ::2]  # not dense: the PyTorch check
    assert cpu_native.all_finite(strided)
    strided[1, 1] = float("nan")
    assert not cpu_native.all_finite(strided)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_native_hadamard_is_the_pytorch_transform_bit_for_bit(dtype):
    """The hadamard transform's native path (`cpu_native.fwht`, registered for the CPU) gives the PyTorch
    butterflies' bits for every block size, awkward shapes, transposed inputs and large dynamic ranges; the query
    fold equals it to fp32 rounding."""
    g = torch.Generator().manual_seed(5)
    assert hadamard._FAST.get("cpu") is cpu_native.fwht
    for n, D, shape in [(2, 6, (3, 1, 5)), (8, 24, (1, 3, 7)), (32, 96, (2, 1, 1)), (64, 64, (1, 3, 1)),
                        (128, 256, (2, 2, 3)), (16, 16, (0, 2, 1))]:  # fmt: skip
        x = (torch.randn(*shape, D, generator=g) * 10 ** torch.randint(-4, 5, (*shape, D), generator=g)).to(dtype)
        t = hadamard.Hadamard(None if n == D else n)
        for xx in (x, x.transpose(0, 1)):
            ref = (hadamard.fwht(xx.float(), n) * n**-0.5).to(dtype)
            got = t.forward(xx)
            assert got.dtype == dtype and got.shape == xx.shape and torch.equal(got, ref), (n, D, shape)
            a, b = t.forward_pair(xx, -xx)  # a layer's key and value at once (one native call)
            assert a.dtype == b.dtype == dtype and torch.equal(a, ref) and torch.equal(b, t.forward(-xx)), (n, D)
            # into rows of larger fp32 buffers (a cache's window rows); other dtypes: new tensors, rows untouched
            buf = torch.full((2, *xx.shape[:-1], 3, D), float("nan"))
            out = (buf[0, ..., 1, :], buf[1, ..., 1, :])
            wa, wb = t.forward_pair(xx, -xx, out=out)
            assert torch.equal(wa, a) and torch.equal(wb, b) and (wa is out[0]) == (dtype == torch.float32)
            untouched = dtype != torch.float32 or xx.numel() == 0
            assert buf[:, ..., ::2, :].isnan().all() and buf.isnan().all() == untouched
            q = xx.float()
            blocks = q.reshape(*q.shape[:-1], D // n, n) @ hadamard.matrix(n)
            scale = float(q.abs().max()) if q.numel() else 1.0
            torch.testing.assert_close(t.fold_query(q), blocks.reshape(q.shape), rtol=1e-5, atol=1e-5 * scale)
    # read where it lies: a projection's [B, n, H, D] output seen as [B, H, n, D], a head slice, an expanded row
    x = torch.randn(2, 5, 3, 64, generator=g).to(dtype)
    for xx in (x.transpose(1, 2), x[:, 1:4, 1:], x[:1, :1, :1].expand(2, 3, 4, 64), x[0, 0, 0]):
        got = cpu_native.fwht(xx, 64, 0.125)
        assert got.is_contiguous() and torch.equal(got, (hadamard.fwht(xx.float(), 64) * 0.125).to(dtype))
    # refused (PyTorch computes it): more than 4 dims, a strided last dim; a pair of two shapes or dtypes
    assert cpu_native.fwht(x[None], 64, 0.125) is None and cpu_native.fwht(x[..., ::2], 32, 0.125) is None
    y = x.transpose(1, 2)
    assert (
        cpu_native.fwht_pair(y, y[:, :, 1:], 64, 0.125) is None and cpu_native.fwht_pair(y, y.double(), 64, 1) is None
    )
    assert cpu_native.fwht_pair(y, x[None], 64, 0.125) is None


def test_native_hadamard_declines_once_the_build_failed(monkeypatch):
    """After a failed build (`cpu_kernel.failed()`), `fwht` declines even for a layout it knew, and the hadamard
    transform computes the same bits in PyTorch: no KernelBuildError from the middle of a forward."""
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(7))
    assert cpu_native.fwht(x, 64, 0.125) is not None  # the layout is known now
    monkeypatch.setattr(cpu_build, "_LIB", None)
    monkeypatch.setattr(cpu_build, "_ERROR", cpu_kernel.KernelBuildError("no compiler"))
    assert cpu_kernel.failed()
    assert cpu_native.fwht(x, 64, 0.125) is None and cpu_native.fwht_pair(x, -x, 64, 0.125) is None
    assert torch.equal(hadamard.Hadamard().forward(x), hadamard.fwht(x, 64) * 64**-0.5)
