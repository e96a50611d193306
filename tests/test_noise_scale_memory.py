"""The meter's squared norms in bounded extra memory: float64 accumulation, converted a chunk at a
time.

Before the chunking, ``torch.linalg.vector_norm(range, dtype=torch.float64)`` converted each counted
range to float64 whole: 8 extra bytes per element (a 32M-element bucket: 256 MiB; 256M elements: 2
GiB) on every measured step. These tests fail on that code: the peak grows by the whole copy, and
one conversion holds every element of the range.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from megatron_ga_ext.science.integration import noise_scale
from megatron_ga_ext.science.integration.noise_scale import squared_norm

_PEAK = textwrap.dedent("""
    import resource
    import torch
    from megatron_ga_ext.science.integration import noise_scale

    torch.set_num_threads(1)
    noise_scale.NORM_CHUNK = 1 << 20  # 8 MiB of float64 per chunk
    values = torch.ones(32 << 20, dtype=torch.float32)  # a 32M-element bucket's grad_data, 128 MiB

    def peak_mib():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    before = peak_mib()
    total = noise_scale.squared_norm(values)
    print(peak_mib() - before, total.item())
""")


def test_the_peak_extra_memory_of_a_norm_is_one_chunk_not_the_bucket():
    """32M float32 elements: a whole float64 copy is 256 MiB more peak; chunks of 1M elements are 8
    MiB."""
    done = subprocess.run(
        [sys.executable, "-c", _PEAK], capture_output=True, text=True, timeout=300, check=True
    )
    growth, total = (float(x) for x in done.stdout.split())
    assert total == 32 << 20
    assert growth < 64, (
        f"the norm grew the peak RSS by {growth:.0f} MiB (bound 64 MiB; a float64 copy is 256 MiB)"
    )


def test_no_conversion_holds_more_than_a_chunk(monkeypatch):
    seen = []
    original = torch.linalg.vector_norm

    def spy(values, *args, **kwargs):
        seen.append(values.numel())
        return original(values, *args, **kwargs)

    monkeypatch.setattr(noise_scale, "NORM_CHUNK", 1000)
    monkeypatch.setattr(torch.linalg, "vector_norm", spy)
    squared_norm(torch.ones(4500))
    assert seen == [1000, 1000, 1000, 1000, 500]


@pytest.mark.parametrize("size", [1, 999, 1000, 1001, 12345])
def test_the_chunked_norm_keeps_float64_accuracy(monkeypatch, size):
    monkeypatch.setattr(noise_scale, "NORM_CHUNK", 1000)
    values = (
        torch.randn(size, generator=torch.Generator().manual_seed(size), dtype=torch.float32) * 1e3
    )
    total = squared_norm(values)
    assert total.dtype == torch.float64 and total.dim() == 0
    reference = float((values.double() ** 2).sum())
    assert total.item() == pytest.approx(reference, rel=1e-13)


def test_an_empty_range_is_zero():
    assert squared_norm(torch.empty(0)).item() == 0.0
