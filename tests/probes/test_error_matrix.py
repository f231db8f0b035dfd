"""Every registered error definition (`kvq_lab.probes.metrics.ERRORS`), driven by the registry: a new one is covered
with no edit here. Each ranks a worse approximation worse in its own direction, reports one value per slice, and is
what the probes' fused path (`all_errors`) reports."""

import pytest
import torch

from kvq_lab.common.metric import DIRECTIONS
from kvq_lab.probes.metrics import ERRORS, all_errors


def _pair(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, 8, 16, generator=g)
    noise = torch.randn(2, 3, 8, 16, generator=g)
    return x, x + 0.01 * noise, x + 0.5 * noise


@pytest.mark.parametrize("name", sorted(ERRORS))
def test_error_ranks_a_worse_approximation_worse(name):
    m = ERRORS[name]
    assert m.name == name and m.direction in DIRECTIONS
    x, close, far = _pair()
    a, b = m.compute(x, close, (-2, -1), 0.01), m.compute(x, far, (-2, -1), 0.01)
    assert a.shape == b.shape == (2, 3)
    assert bool((a < b).all()) if m.direction == "lower" else bool((a > b).all())


@pytest.mark.parametrize("name", sorted(ERRORS))
def test_error_of_an_exact_copy_is_its_best(name):
    m = ERRORS[name]
    x, close, _ = _pair(1)
    exact, near = m.compute(x, x.clone(), -1, 0.01), m.compute(x, close, -1, 0.01)
    assert bool((exact <= near).all()) if m.direction == "lower" else bool((exact >= near).all())


@pytest.mark.parametrize("name", sorted(ERRORS))
def test_the_fused_path_reports_it(name):
    x, close, _ = _pair(2)
    fused = all_errors(x, close, dims=(-2, -1), eps=0.01)
    torch.testing.assert_close(fused[name], ERRORS[name].compute(x, close, (-2, -1), 0.01))
