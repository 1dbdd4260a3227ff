"""The tensor math against the independent reference, on active sets built per element."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from mergekit_ram.kernel import CHUNK_ELEMENTS, NonFiniteInputError, overlap_ratio, ram_merge, rescale_factor
from mergekit_ram.memory import peak_allocated_bytes
from tests import reference

EPSILON = 1e-5


def designed_group(
    n: int, shape: tuple[int, ...] = (64, 48), dtype: torch.dtype = torch.float32, seed: int = 0
) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """A base and n fine-tunes whose active sets are drawn per element; returns the masks too.

    Changes are at least 1e-3 (far above epsilon) and sub-threshold noise (below epsilon)
    is added to some inactive elements, so the threshold itself is exercised.
    """
    generator = torch.Generator().manual_seed(seed)
    base = torch.randn(shape, generator=generator).to(dtype)
    active = torch.rand((n, *shape), generator=generator) < torch.linspace(0.05, 0.6, n).view(n, *[1] * len(shape))
    finetunes = []
    for index in range(n):
        delta = (torch.rand(shape, generator=generator) * 0.05 + 1e-3) * torch.sign(
            torch.randn(shape, generator=generator)
        )
        changed = (base.float() + delta).to(dtype)
        finetune = torch.where(active[index], changed, base)
        if dtype == torch.float32:
            noise = (torch.rand(shape, generator=generator) - 0.5) * EPSILON  # |noise| <= eps / 2
            finetune = torch.where(active[index], finetune, base + noise)
        finetunes.append(finetune)
    return base, finetunes, active


@pytest.mark.parametrize("n", [1, 2, 3, 5])
@pytest.mark.parametrize("lambdas_kind", ["ram", "ram_plus"])
def test_float32_merge_equals_reference(n: int, lambdas_kind: str) -> None:
    base, finetunes, _ = designed_group(n)
    lambdas = [1.0] * n if lambdas_kind == "ram" else [1.0 + 0.07 * (i + 1) for i in range(n)]
    result = ram_merge(base, finetunes, EPSILON, lambdas)
    expected = reference.merge(base, finetunes, EPSILON, lambdas)
    assert result.merged.dtype == torch.float32
    torch.testing.assert_close(result.merged, expected, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_output_is_reference_rounded(dtype: torch.dtype) -> None:
    base, finetunes, _ = designed_group(3, dtype=dtype)
    lambdas = [1.2, 1.145, 1.11]
    result = ram_merge(base, finetunes, EPSILON, lambdas)
    expected = reference.merge(base, finetunes, EPSILON, lambdas).to(dtype)
    assert result.merged.dtype == dtype
    assert torch.equal(result.merged, expected)


def test_counts_match_design_and_reference() -> None:
    base, finetunes, active = designed_group(4)
    result = ram_merge(base, finetunes, EPSILON, merge=False, count=True)
    assert result.merged is None
    ref = reference.counts(base, finetunes, EPSILON)
    assert [list(row) for row in result.histograms] == ref.histograms
    overlap = active.sum(0)
    for index in range(4):
        assert sum(result.histograms[index]) == int(active[index].sum())  # the design, exactly
        assert result.histograms[index][0] == int((active[index] & (overlap == 1)).sum())


def test_merge_and_count_agree_with_count_only() -> None:
    base, finetunes, _ = designed_group(3, dtype=torch.bfloat16)
    both = ram_merge(base, finetunes, EPSILON, [1.1, 1.2, 1.3], count=True)
    merged_only = ram_merge(base, finetunes, EPSILON, [1.1, 1.2, 1.3])
    counted_only = ram_merge(base, finetunes, EPSILON, merge=False, count=True)
    assert torch.equal(both.merged, merged_only.merged)
    assert both.histograms == counted_only.histograms


@pytest.mark.parametrize("n", [15, 17, 22, 26])
def test_many_models_use_the_wider_pattern_paths(n: int) -> None:
    """int16 and int32 bincounts (15, 17), the sparse table (22), the int64 pattern (26)."""
    base, finetunes, _ = designed_group(n, shape=(40, 30))
    expected = reference.counts(base, finetunes, EPSILON).histograms
    result = ram_merge(base, finetunes, EPSILON, merge=False, count=True)
    assert [list(row) for row in result.histograms] == expected
    merged = ram_merge(base, finetunes, EPSILON, [1.1] * n, count=True)
    assert [list(row) for row in merged.histograms] == expected
    assert torch.equal(merged.merged, reference.merge(base, finetunes, EPSILON, [1.1] * n))


def test_epsilon_is_strict_and_compared_in_float32() -> None:
    base = torch.zeros(4)
    finetune = torch.tensor([1e-5, 2e-5, -1e-5, -3e-5])
    result = ram_merge(base, [finetune], 1e-5, count=True)
    assert result.histograms == ((2,),)
    assert torch.equal(result.merged, torch.tensor([0.0, 2e-5, 0.0, -3e-5]))


def test_epsilon_zero_counts_every_change() -> None:
    base, finetunes, _ = designed_group(2)
    result = ram_merge(base, finetunes, 0.0, count=True)
    assert [sum(row) for row in result.histograms] == [int((f != base).sum()) for f in finetunes]
    torch.testing.assert_close(result.merged, reference.merge(base, finetunes, 0.0, [1.0, 1.0]), rtol=0, atol=0)


def test_overflow_gives_inf_never_nan() -> None:
    """Finite inputs whose float32 sum or RAM+ scaling overflows: inf as in the reference, not NaN."""
    big = 3.0e38
    base = torch.zeros(6)
    finetunes = [
        torch.tensor([big, big, 0.0, big, 1.0, -big]),
        torch.tensor([big, 0.0, big, 0.0, 1.0, -big]),
    ]
    lambdas = [1.5, 1.5]
    result = ram_merge(base, finetunes, EPSILON, lambdas, count=True)
    expected = reference.merge(base, finetunes, EPSILON, lambdas)
    assert not torch.isnan(result.merged).any(), result.merged
    assert torch.isinf(result.merged).any()  # the case is an overflow
    assert torch.equal(result.merged, expected), (result.merged, expected)


def test_finetune_equal_to_base_changes_nothing() -> None:
    base, finetunes, _ = designed_group(2)
    result = ram_merge(base, [base.clone(), finetunes[1]], EPSILON, [1.2, 1.2], count=True)
    assert result.histograms[0] == (0, 0)
    assert not torch.isnan(result.merged).any()
    torch.testing.assert_close(
        result.merged, reference.merge(base, [base, finetunes[1]], EPSILON, [1.2, 1.2]), rtol=0, atol=0
    )


def test_identical_finetunes_average_to_themselves_without_nan() -> None:
    base, finetunes, _ = designed_group(1)
    result = ram_merge(base, [finetunes[0], finetunes[0].clone()], EPSILON, [1.2, 1.2], count=True)
    assert result.histograms[0][0] == 0  # nothing unique
    assert not torch.isnan(result.merged).any()
    changed = (finetunes[0] - base).abs() > EPSILON
    assert torch.equal(result.merged[changed], finetunes[0][changed])


def test_single_model_resets_subthreshold_changes() -> None:
    base, finetunes, active = designed_group(1)
    result = ram_merge(base, finetunes, EPSILON, [1.0])
    assert torch.equal(result.merged[active[0]], finetunes[0][active[0]])
    assert torch.equal(result.merged[~active[0]], base[~active[0]])


def test_no_finetunes_returns_the_base() -> None:
    base = torch.randn(5, 3)
    result = ram_merge(base, [], EPSILON, count=True)
    assert torch.equal(result.merged, base)
    assert result.histograms == ()


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_inputs_are_named(bad: float) -> None:
    base, finetunes, _ = designed_group(3)
    finetunes[2] = finetunes[2].clone()
    finetunes[2][3, 4] = bad
    with pytest.raises(NonFiniteInputError) as error:
        ram_merge(base, finetunes, EPSILON)
    assert error.value.index == 2
    poisoned = base.clone()
    poisoned[0, 0] = bad
    with pytest.raises(NonFiniteInputError) as error:
        ram_merge(poisoned, finetunes[:2], EPSILON, merge=False, count=True)
    assert error.value.index is None


def test_large_finite_values_are_not_mistaken_for_inf() -> None:
    base = torch.full((1000,), 3e35)
    finetune = base.clone()
    finetune[:500] = -3e35  # |tau| = 6e35; the sum of magnitudes overflows float32
    result = ram_merge(base, [finetune], EPSILON)
    assert torch.isfinite(result.merged).all()


def test_rho_and_lambda_follow_the_paper() -> None:
    assert overlap_ratio(30, 2) == reference.rho(30, 2) == 15.0
    assert overlap_ratio(0, 0) == 0.0
    assert math.isinf(overlap_ratio(5, 0))
    for rho in (0.0, 0.5, 1.11, 1.45, 2.0, 14.9, math.inf):
        assert rescale_factor(rho, 0.1, 2.0, "clip") == reference.lambda_clip(rho, 0.1, 2.0)
        assert rescale_factor(rho, 0.1, 2.0, "soft") == reference.lambda_soft(rho, 0.1)
    assert rescale_factor(14.9, 0.1, 2.0, "clip") == pytest.approx(1.2)
    assert rescale_factor(1.45, 0.1, 2.0, "clip") == pytest.approx(1.145)
    assert rescale_factor(3.0, 0.1, 2.0, "soft") == pytest.approx(1.075)
    with pytest.raises(ValueError, match="rule"):
        rescale_factor(1.0, 0.1, 2.0, "tanh")  # type: ignore[arg-type]


def peak_scratch_bytes(function) -> int:
    """Measured with one thread: the profiler sees the calling thread's allocations only."""
    return peak_allocated_bytes(function, threads=1)[0]


#: Scratch bytes per chunk element of a bfloat16 group, by what the kernel is asked for.
SCRATCH_BOUNDS = {
    "ram with statistics": (dict(count=True), 24),
    "ram_plus merge after the pre-pass": (dict(lambdas=True), 24),
    "ram_plus with pinned statistics": (dict(lambdas=True, count=True), 28),
    "pre-pass (count only)": (dict(merge=False, count=True), 16),
}


@pytest.mark.parametrize("mode", SCRATCH_BOUNDS)
def test_scratch_memory_is_bounded_and_independent_of_n(mode: str) -> None:
    """Beyond the output, a few float32 buffers of one chunk, whatever N and the tensor size.

    Measured with one worker thread (the profiler sees the calling thread's allocations);
    each further worker has its own scratch of the same size.
    """
    options, bytes_per_element = SCRATCH_BOUNDS[mode]
    scratch = {}
    for numel in (2 * CHUNK_ELEMENTS, 5 * CHUNK_ELEMENTS):
        for n in (2, 3, 5):
            base, finetunes, _ = designed_group(n, shape=(numel,), dtype=torch.bfloat16)
            merge = options.get("merge", True)
            call = functools.partial(
                ram_merge,
                base,
                finetunes,
                EPSILON,
                [1.1] * n if options.get("lambdas") else None,
                merge=merge,
                count=options.get("count", False),
            )
            peak = peak_scratch_bytes(call)
            scratch[numel, n] = peak - (2 * numel if merge else 0)  # minus the bfloat16 output
    assert max(scratch.values()) - min(scratch.values()) < 4096, scratch  # a bincount of 2**N counters at most
    assert max(scratch.values()) <= bytes_per_element * CHUNK_ELEMENTS + 4096, scratch
    assert max(scratch.values()) > (bytes_per_element - 4) * CHUNK_ELEMENTS, scratch  # the bound is tight


def test_chunk_boundaries_do_not_change_results() -> None:
    base, finetunes, _ = designed_group(3, shape=(1000, 7), dtype=torch.bfloat16)
    whole = ram_merge(base, finetunes, EPSILON, [1.2, 1.1, 1.0], count=True)
    for chunk in (1, 997, 4096):
        chunked = ram_merge(base, finetunes, EPSILON, [1.2, 1.1, 1.0], count=True, chunk_elements=chunk)
        assert torch.equal(chunked.merged, whole.merged)
        assert chunked.histograms == whole.histograms
