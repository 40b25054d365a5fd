"""Precision and device names: what `precision` and `device` mean, and refusals that name the setting."""

from __future__ import annotations

import pytest
import torch

from rlhf_core.precision import accelerate_mixed_precision, autocast, check_precision, compute_dtype, resolve_device


def test_each_precision_names_its_dtype_and_accelerate_setting():
    assert [compute_dtype(p) for p in ("fp32", "bf16", "fp16")] == [torch.float32, torch.bfloat16, torch.float16]
    assert [accelerate_mixed_precision(p) for p in ("fp32", "bf16", "fp16")] == ["no", "bf16", "fp16"]
    with pytest.raises(ValueError, match="`precision` must be one of .*'fp8'"):
        check_precision("fp8")


def test_autocast_runs_matrix_products_in_the_precision_and_fp32_changes_nothing():
    a, b = torch.randn(4, 8), torch.randn(8, 3)
    cpu = torch.device("cpu")
    with autocast(cpu, "bf16"):
        assert (a @ b).dtype == torch.bfloat16
    with autocast(cpu, "fp32"):
        product = a @ b
    assert product.dtype == torch.float32 and torch.equal(product, a @ b)


def test_device_choices():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="`execution.device` must be one of"):
        resolve_device("tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_asking_for_cuda_without_a_gpu_is_an_error_not_a_silent_cpu_run():
    with pytest.raises(ValueError, match="`execution.device` is 'cuda' but torch sees no CUDA device"):
        resolve_device("cuda")


def test_issue23_auto_threads_take_every_core_for_a_large_model_and_one_for_a_small_one():
    from rlhf_core.precision import AUTO_THREADS_MIN_PARAMETERS, resolve_threads

    assert resolve_threads("auto", parameters=100_000, cores=2) == 1  # the demo's model
    assert resolve_threads("auto", parameters=134_515_008, cores=2) == 2  # SmolLM2-135M
    assert resolve_threads("auto", parameters=AUTO_THREADS_MIN_PARAMETERS, cores=16) == 16
    assert resolve_threads("auto", parameters=134_515_008, cores=2, load=18.0) == 1  # busy cores: one thread
    assert resolve_threads("auto", parameters=134_515_008, cores=16, load=4.2) == 12
    assert resolve_threads("auto", parameters=134_515_008, cores=2, load=0.7) == 2  # a light load: both
    assert resolve_threads(3, parameters=100_000, cores=2, load=18.0) == 3  # a number is kept as it is
    with pytest.raises(ValueError, match="`execution.torch_threads`"):
        resolve_threads(0, parameters=1, cores=2)
