"""Norms and fingerprints are computed in float32 whatever the tensors' dtype
(torch's `_foreach_norm` and `vector_norm` return the input dtype)."""

from __future__ import annotations

import math

import pytest
import torch

from rankwatch.agent.checks.grad_checks import fp32_norms


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_finite_low_precision_gradient_has_a_finite_exact_norm(dtype):
    # 300 x 100,000 elements: every value finite in fp16, the fp16 norm is inf.
    grads = [torch.full((100_000,), 300.0, dtype=dtype), torch.ones(7, dtype=dtype)]
    assert not math.isfinite(float(torch._foreach_norm([grads[0].half()])[0]))  # the trap
    norms = fp32_norms(grads)
    assert all(n.dtype == torch.float32 for n in norms)
    # fp32 accumulation of 1e5 terms is off by ~7e-5 relative: far inside what a
    # norm is used for (non-finite, spikes of 10x, bf16's 0.4 % resolution).
    assert float(norms[0]) == pytest.approx(300.0 * math.sqrt(100_000), rel=1e-3)
    assert float(norms[1]) == pytest.approx(math.sqrt(7), rel=1e-6)


def test_a_bf16_replica_perturbed_by_less_than_bf16_resolution_still_differs():
    torch.manual_seed(0)
    weight = torch.randn(256, 256).to(torch.bfloat16)
    moved = weight.clone()
    moved[0, 0] += 1.0  # one element: far below 0.4 % of the whole tensor's norm
    assert float(torch._foreach_norm([weight])[0]) == float(torch._foreach_norm([moved])[0])  # bf16 norm: blind
    assert float(fp32_norms([weight])[0]) != float(fp32_norms([moved])[0])


def test_without_foreach_dtype_support_the_same_numbers_come_per_tensor(monkeypatch):
    grads = [torch.full((1000,), 3.0, dtype=torch.float16), torch.arange(5, dtype=torch.bfloat16)]
    expected = [float(n) for n in fp32_norms(grads)]
    original = torch._foreach_norm

    def old_foreach_norm(tensors, ord=2, **kwargs):  # torch releases without the dtype argument
        if kwargs:
            raise TypeError("_foreach_norm() got an unexpected keyword argument 'dtype'")
        return original(tensors, ord)

    monkeypatch.setattr(torch, "_foreach_norm", old_foreach_norm)
    assert [float(n) for n in fp32_norms(grads)] == pytest.approx(expected)


def test_deferred_reads_take_per_parameter_norm_vectors_with_the_scalars():
    """The CUDA branch submits each bucket's norm (a scalar) and its
    per-parameter norms (a vector) together: they come back flat, in order."""
    from rankwatch.agent.checks.grad_checks import _DeferredRead

    got = []
    _DeferredRead().submit([torch.tensor(5.0), torch.tensor([1.0, 2.0, 3.0]), torch.tensor(float("nan"))], got.extend)
    assert got[:4] == [5.0, 1.0, 2.0, 3.0] and math.isnan(got[4])
