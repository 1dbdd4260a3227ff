"""The tensor math against the independent reference (tests/reference.py), on active sets built per element.

Both entry points: ``count_overlaps`` (the pre-pass) and ``merge_tensors`` (with or without counts), in one
chunk and in many; under autograd on whole tensors, with the reference's gradients.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Optional

import pytest
import torch

from benchmarks.memory import peak_allocated_bytes
from mergekit_ram import kernel
from mergekit_ram.kernel import (
    CHUNK_ELEMENTS,
    MergeOverflowError,
    NonFiniteInputError,
    SharedRule,
    _ties_thresholds,
    compute_dtype,
    count_overlaps,
    merge_tensors,
)
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


BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32, torch.float64: torch.int64}


def same_bits(ours: torch.Tensor, expected: torch.Tensor) -> bool:
    """The same dtype, shape and bytes (0.0 and -0.0 differ here)."""
    return ours.dtype == expected.dtype and torch.equal(ours.view(BITS[ours.dtype]), expected.view(BITS[ours.dtype]))


def reference_histograms(base: torch.Tensor, finetunes: list[torch.Tensor], epsilon: float = EPSILON) -> tuple:
    return tuple(tuple(row) for row in reference.counts(base, finetunes, epsilon).histograms)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 26])
@pytest.mark.parametrize("lambdas_kind", ["ram", "ram_plus"])
def test_float32_merge_equals_reference(n: int, lambdas_kind: str) -> None:
    base, finetunes, _ = designed_group(n, shape=(40, 30) if n > 5 else (64, 48))
    lambdas = [1.0] * n if lambdas_kind == "ram" else [1.0 + 0.07 * (i + 1) for i in range(n)]
    result = merge_tensors(base, finetunes, EPSILON, lambdas)
    expected = reference.merge(base, finetunes, EPSILON, lambdas)
    assert result.histograms is None
    assert result.merged.dtype == torch.float32
    torch.testing.assert_close(result.merged, expected, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_output_is_reference_rounded(dtype: torch.dtype) -> None:
    base, finetunes, _ = designed_group(3, dtype=dtype)
    lambdas = [1.2, 1.145, 1.11]
    result = merge_tensors(base, finetunes, EPSILON, lambdas)
    expected = reference.merge(base, finetunes, EPSILON, lambdas).to(dtype)
    assert result.merged.dtype == dtype
    assert torch.equal(result.merged, expected)


@pytest.mark.parametrize("n", [4, 26])
def test_counts_match_design_and_reference(n: int) -> None:
    base, finetunes, active = designed_group(n, shape=(64, 48) if n < 5 else (40, 30))
    result = count_overlaps(base, finetunes, EPSILON)
    assert result.histograms == reference_histograms(base, finetunes)
    overlap = active.sum(0)
    for index in range(n):
        assert sum(result.histograms[index]) == int(active[index].sum())  # the design, exactly
        assert result.histograms[index][0] == int((active[index] & (overlap == 1)).sum())


@pytest.mark.parametrize("n", [1, 2, 3, 5])
@pytest.mark.parametrize("lambdas_kind", ["ram", "ram_plus"])
def test_merge_with_counts_equals_merge_and_count_overlaps(n: int, lambdas_kind: str) -> None:
    """count=True adds the histograms of count_overlaps (the reference's) and changes no merged bit."""
    base, finetunes, _ = designed_group(n, dtype=torch.bfloat16, seed=n)
    lambdas = None if lambdas_kind == "ram" else [1.0 + 0.1 * (i + 1) for i in range(n)]
    both = merge_tensors(base, finetunes, EPSILON, lambdas, count=True)
    merged_only = merge_tensors(base, finetunes, EPSILON, lambdas)
    counted_only = count_overlaps(base, finetunes, EPSILON)
    assert counted_only.histograms == reference_histograms(base, finetunes)
    assert both.histograms == counted_only.histograms
    assert merged_only.histograms is None
    assert torch.equal(both.merged, merged_only.merged)
    assert torch.equal(both.merged, reference.merge(base, finetunes, EPSILON, lambdas or [1.0] * n).to(base.dtype))


@pytest.mark.parametrize("epsilon", [1e-5, 1e-3])
def test_epsilon_is_strict_and_compared_in_float32(epsilon: float) -> None:
    """An update of exactly float32(epsilon) is inactive: float32(1e-5) rounds down, float32(1e-3) up
    (above 1e-3, so a comparison with the exact epsilon would count it)."""
    base = torch.zeros(4)
    finetune = torch.tensor([epsilon, 2 * epsilon, -epsilon, -3 * epsilon])
    result = merge_tensors(base, [finetune], epsilon, count=True)
    assert result.histograms == ((2,),)
    assert count_overlaps(base, [finetune], epsilon).histograms == ((2,),)
    assert torch.equal(result.merged, torch.tensor([0.0, 2 * epsilon, 0.0, -3 * epsilon]))


def test_epsilon_zero_counts_every_change() -> None:
    base, finetunes, _ = designed_group(2)
    result = merge_tensors(base, finetunes, 0.0, count=True)
    assert [sum(row) for row in result.histograms] == [int((f != base).sum()) for f in finetunes]
    torch.testing.assert_close(result.merged, reference.merge(base, finetunes, 0.0, [1.0, 1.0]), rtol=0, atol=0)


RULES = [("mean", 1.0), ("ties", 0.5), ("ties", 1.0), ("base", 1.0)]


@pytest.mark.parametrize(("rule", "density"), RULES)
def test_an_overflow_is_an_error_that_float64_merges(rule: SharedRule, density: float) -> None:
    """Finite inputs whose float32 merge overflows, never NaN or Inf: an update (3e38 - -3e38, where model 1 alone
    changed the base), lambda times an update, the sum of the shared updates (two of 3e38: their mean fits).
    float64, the fix the error names, merges them; unique-only keeps the base where several changed it."""
    base = torch.tensor([-3e38, 2e38, 0.0, 1.0])
    finetunes = [torch.tensor([-3e38, 2e38, 3e38, 1.0]), torch.tensor([3e38, 2e38, 3e38, 1.5])]
    for lambdas in ([1.0, 1.0], [1.0, 1e-3]):  # model 1's update overflows, then only [2]'s sum
        with pytest.raises(MergeOverflowError) as error:
            merge_tensors(base, finetunes, EPSILON, lambdas, count=True, shared=rule, density=density)
        assert error.value.dtype == torch.float32
        if rule == "base":
            break
        base[0], finetunes[1][0] = 0.0, 0.0
    scaled = [torch.tensor([0.0, 3.3e38, 0.0, 1.0]), torch.tensor([0.0, 2e38, 0.0, 1.5])]  # model 0 alone at [1]
    with pytest.raises(MergeOverflowError):
        merge_tensors(torch.tensor([0.0, 2e38, 0.0, 1.0]), scaled, EPSILON, [1.2, 1.0], shared=rule, density=density)
    base[0], finetunes[1][0] = -3e38, 3e38
    wide = merge_tensors(base.double(), [f.double() for f in finetunes], EPSILON, shared=rule, density=density)
    big = torch.tensor(3e38).item()  # 3e38 as float32
    assert wide.merged.tolist() == [big, torch.tensor(2e38).item(), 0.0 if rule == "base" else big, 1.5]


@pytest.mark.parametrize("lam", [1e300, -1e300, math.nan])
def test_a_lambda_beyond_the_arithmetic_dtype_is_refused(lam: float) -> None:
    base, finetunes, _ = designed_group(2)
    with pytest.raises(MergeOverflowError) as error:
        merge_tensors(base, finetunes, EPSILON, [1.2, lam])
    assert error.value.dtype == torch.float32


def test_large_lambdas_that_fit_are_applied_exactly() -> None:
    """1e38 * 2 fits float32: no NaN from 0 * lambda where the model is inactive."""
    base = torch.zeros(4)
    finetunes = [torch.tensor([5.0, 0.0, 1.0, 0.0]), torch.tensor([0.0, 2.0, 1.0, 0.0])]
    fits = merge_tensors(base, finetunes, EPSILON, [1.2, 1e38])
    assert fits.merged.tolist() == [6.0, (torch.tensor(1e38) * 2).item(), 1.0, 0.0]
    assert torch.equal(fits.merged, reference.merge(base, finetunes, EPSILON, [1.2, 1e38]))


def test_an_overflow_of_the_output_dtype_alone_names_it() -> None:
    base = torch.tensor([60000.0, 1.0])
    finetune = torch.tensor([70000.0, 1.5])
    with pytest.raises(MergeOverflowError) as error:
        merge_tensors(base, [finetune], EPSILON, out_dtype=torch.float16)
    assert error.value.dtype == torch.float16
    assert str(error.value) == "the merged values do not fit float16"


def test_finite_sums_far_apart_are_no_overflow() -> None:
    """Shared mean -1e38 beside a scaled sum of 2.7e38 (their difference overflows): blended exactly, no error."""
    base = torch.zeros(2)
    finetunes = [torch.tensor([3e38, 1.0]), torch.tensor([-3e38, 0.0]), torch.tensor([-3e38, 0.0])]
    lambdas = [1.1, 0.1, 0.1]
    result = merge_tensors(base, finetunes, EPSILON, lambdas).merged
    assert same_bits(result, reference.merge(base, finetunes, EPSILON, lambdas))
    assert result.tolist() == [(torch.tensor(-3e38) / 3).item(), torch.tensor(1.1).item()]


def test_large_finite_values_are_not_mistaken_for_inf() -> None:
    base = torch.full((1000,), 3e35)
    finetune = base.clone()
    finetune[:500] = -3e35  # |tau| = 6e35; the sum of magnitudes overflows float32
    result = merge_tensors(base, [finetune], EPSILON)
    assert torch.isfinite(result.merged).all()
    assert torch.equal(result.merged, reference.merge(base, [finetune], EPSILON, [1.0]))
    assert torch.equal(result.merged, finetune)  # one model changed each element: its change at full strength
    assert count_overlaps(base, [finetune], EPSILON).histograms == ((500,),)


@pytest.mark.parametrize(("rule", "density"), [*RULES, ("ties", 0.6)])
def test_large_finite_updates_whose_sum_overflows_are_no_overflow(rule: SharedRule, density: float) -> None:
    """Updates of about 1e38, all finite, whose float32 sum over a chunk overflows (ram_ties' radix select read
    that as an overflowing update): each rule merges them as the reference does, and the pre-pass counts them."""
    generator = torch.Generator().manual_seed(1)
    base = torch.zeros(3000)
    signs = torch.randint(0, 2, (3, 3000), generator=generator) * 2.0 - 1.0
    active = torch.rand((3, 3000), generator=generator) < 0.6
    finetunes = [
        torch.where(active[t], signs[t] * torch.rand(3000, generator=generator) * 1e38, base) for t in range(3)
    ]
    expected = RULE_CASES[rule](base, finetunes, [1.0] * 3, density)
    for chunk_elements in (1000, CHUNK_ELEMENTS):
        result = merge_tensors(base, finetunes, EPSILON, shared=rule, density=density, chunk_elements=chunk_elements)
        assert torch.isfinite(result.merged).all()
        assert same_bits(result.merged, expected)
        counted = count_overlaps(base, finetunes, EPSILON, chunk_elements=chunk_elements)
        assert counted.histograms == reference_histograms(base, finetunes)


@pytest.mark.parametrize(("rule", "density"), RULES)
def test_an_overflowing_update_names_its_model(rule: SharedRule, density: float) -> None:
    """Model 1's update (3e38 - -3e38) overflows where it alone changed the base: the error names it; where only
    the merged values overflow (lambda times an update that fits), none."""
    base = torch.tensor([-3e38, 3e38, 0.0, 1.0])
    finetunes = [torch.tensor([-3e38, 3e38, 1.0, 1.0]), torch.tensor([3e38, 3e38, 0.0, 1.5])]
    with pytest.raises(MergeOverflowError) as error:
        merge_tensors(base, finetunes, EPSILON, shared=rule, density=density, chunk_elements=2)
    assert (error.value.index, str(error.value)) == (
        1,
        "the update of fine-tuned input 1 (minus the base) does not fit float32",
    )
    scaled = [torch.tensor([0.0, 3.3e38, 0.0, 1.0]), torch.tensor([0.0, 2e38, 0.0, 1.5])]  # model 0 alone at [1]
    with pytest.raises(MergeOverflowError) as error:  # its update fits, base + 1.2 times it does not
        merge_tensors(torch.tensor([0.0, 2e38, 0.0, 1.0]), scaled, EPSILON, [1.2, 1.0], shared=rule, density=density)
    assert (error.value.index, str(error.value)) == (None, "the merged values do not fit float32")


@pytest.mark.parametrize("n", [1, 2, 3, 5, 17])
@pytest.mark.parametrize("epsilon", [0.0, 1e-5, 1e-3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_the_tally_is_exact(n: int, epsilon: float, dtype: torch.dtype) -> None:
    """The pattern-code bincount (N <= 16) and the product (17 models) give the reference's histograms, in the
    pre-pass and in the merge's count, over one chunk and many."""
    base, finetunes, _ = designed_group(n, shape=(40, 30), dtype=dtype, seed=n)
    finetunes[0] = base + (torch.arange(1200).view(40, 30) % 3 - 1).to(dtype) * 1e-3  # at epsilon 1e-3
    expected = reference_histograms(base, finetunes, epsilon)
    for chunk_elements in (500, CHUNK_ELEMENTS):
        assert count_overlaps(base, finetunes, epsilon, chunk_elements=chunk_elements).histograms == expected
        counted = merge_tensors(base, finetunes, epsilon, count=True, chunk_elements=chunk_elements)
        assert counted.histograms == expected


class ThreadCounts(torch.overrides.TorchFunctionMode):
    """torch's intra-op thread count at every elementwise operation or bincount made inside the mode."""

    OPERATIONS = {"sub", "sub_", "abs_", "gt", "ge", "le", "add", "add_", "addcmul_", "mul", "bincount", "copy_"}

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[int] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if getattr(func, "__name__", "") in self.OPERATIONS:
            self.seen.add(torch.get_num_threads())
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    "call",
    [
        lambda base, fts: count_overlaps(base, fts, EPSILON),
        lambda base, fts: merge_tensors(base, fts, EPSILON, [1.2, 1.1, 1.0], count=True),
        lambda base, fts: merge_tensors(base, fts, EPSILON, shared="ties", density=0.3),
    ],
)
def test_the_chunk_loop_runs_on_one_thread_and_restores_torchs_setting(call: Callable) -> None:
    """On CPU every op of the chunk loop sees one intra-op thread; torch's setting is as it was after the call,
    and after one that fails inside the loop."""
    base, finetunes, _ = designed_group(3, shape=(3000,), dtype=torch.bfloat16)
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        with ThreadCounts() as counts:
            call(base, finetunes)
        assert counts.seen == {1}
        assert torch.get_num_threads() == 3
        finetunes[1][-1] = math.nan
        with pytest.raises(NonFiniteInputError):
            call(base, finetunes)
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


def test_an_accelerator_keeps_torchs_threads() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        with kernel._one_thread(torch.device("meta")):
            assert torch.get_num_threads() == 3
        with kernel._one_thread(torch.device("cpu")):
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize(("rule", "density"), RULES)
def test_non_finite_inputs_are_named(bad: float, rule: SharedRule, density: float) -> None:
    """Whichever rule, and where the other models changed the base (unique-only keeps the base there)."""
    base, finetunes, _ = designed_group(3)
    finetunes = [base + 0.01, finetunes[1].clone(), base - 0.01]
    finetunes[1][3, 4] = bad
    with pytest.raises(NonFiniteInputError) as error:
        merge_tensors(base, finetunes, EPSILON, [1.2, 1.0, 1.0], shared=rule, density=density, chunk_elements=1000)
    assert (error.value.index, error.value.value) == (1, "NaN" if math.isnan(bad) else "Inf")
    poisoned = base.clone()
    poisoned[0, 0] = bad
    for call in (count_overlaps, functools.partial(merge_tensors, shared=rule, density=density)):
        with pytest.raises(NonFiniteInputError) as error:
            call(poisoned, finetunes[:1], EPSILON)
        assert error.value.index is None
    with pytest.raises(NonFiniteInputError):
        merge_tensors(poisoned, [], EPSILON)


def test_a_non_finite_input_is_named_before_an_overflow_anywhere() -> None:
    """An overflow in the first chunk, a NaN input in the last: the input is named, chunked or under autograd."""
    base = torch.zeros(300)
    finetunes = [torch.zeros(300), torch.zeros(300)]
    finetunes[0][0], finetunes[1][0] = 3e38, 3e38  # their sum overflows float32
    finetunes[1][-1] = math.nan
    for leaves in (False, True):
        inputs = [tensor.clone().requires_grad_(leaves) for tensor in (base, *finetunes)]
        with pytest.raises(NonFiniteInputError) as error:
            merge_tensors(inputs[0], inputs[1:], EPSILON, chunk_elements=100)
        assert (error.value.index, error.value.value) == (1, "NaN")
    finetunes[1][-1] = 0.0
    with pytest.raises(MergeOverflowError):
        merge_tensors(base, finetunes, EPSILON, chunk_elements=100)


def test_finetune_equal_to_base_changes_nothing() -> None:
    base, finetunes, _ = designed_group(2)
    result = merge_tensors(base, [base.clone(), finetunes[1]], EPSILON, [1.2, 1.2], count=True)
    assert result.histograms[0] == (0, 0)
    assert torch.equal(result.merged, reference.merge(base, [base, finetunes[1]], EPSILON, [1.2, 1.2]))


def test_identical_finetunes_average_to_themselves_without_nan() -> None:
    base, finetunes, _ = designed_group(1)
    result = merge_tensors(base, [finetunes[0], finetunes[0].clone()], EPSILON, [1.2, 1.2], count=True)
    assert result.histograms[0][0] == 0  # nothing unique
    assert not torch.isnan(result.merged).any()
    changed = (finetunes[0] - base).abs() > EPSILON
    assert torch.equal(result.merged[changed], finetunes[0][changed])


def test_single_model_resets_subthreshold_changes() -> None:
    base, finetunes, active = designed_group(1)
    result = merge_tensors(base, finetunes, EPSILON, [1.0])
    assert torch.equal(result.merged[active[0]], finetunes[0][active[0]])
    assert torch.equal(result.merged[~active[0]], base[~active[0]])


def test_no_finetunes_and_empty_tensors() -> None:
    base = torch.randn(5, 3)
    result = merge_tensors(base, [], EPSILON, count=True)
    assert torch.equal(result.merged, base)
    assert result.histograms == ()
    assert count_overlaps(base, [], EPSILON).histograms == ()
    empty = torch.empty(0, 4, dtype=torch.bfloat16)
    merged = merge_tensors(empty, [empty, empty], EPSILON, count=True, shared="ties", density=0.1)
    assert merged.merged.shape == (0, 4) and merged.merged.dtype == torch.bfloat16
    assert merged.histograms == ((0, 0), (0, 0)) == count_overlaps(empty, [empty, empty], EPSILON).histograms


def test_chunk_boundaries_do_not_change_results() -> None:
    """Chunks of 1 element, a size dividing nothing, and one chunk: the same bits and counts."""
    base, finetunes, _ = designed_group(3, shape=(1000, 7), dtype=torch.bfloat16)
    whole = merge_tensors(base, finetunes, EPSILON, [1.2, 1.1, 1.0], count=True)
    for chunk in (1, 997, 4096):
        chunked = merge_tensors(base, finetunes, EPSILON, [1.2, 1.1, 1.0], count=True, chunk_elements=chunk)
        assert torch.equal(chunked.merged, whole.merged)
        assert chunked.histograms == whole.histograms
        assert count_overlaps(base, finetunes, EPSILON, chunk_elements=chunk).histograms == whole.histograms


def test_bad_calls_are_refused() -> None:
    base, finetunes, _ = designed_group(2)
    with pytest.raises(ValueError, match="expected 2 lambda values, got 1"):
        merge_tensors(base, finetunes, EPSILON, [1.2])
    for call in (count_overlaps, merge_tensors):
        with pytest.raises(ValueError, match="shape"):
            call(base, [finetunes[0].T], EPSILON)
    for density in (0.0, 1.5, -0.1, math.nan):
        with pytest.raises(ValueError, match=r"density must be in \(0, 1\]"):
            merge_tensors(base, finetunes, EPSILON, shared="ties", density=density)
    with pytest.raises(ValueError, match="shared must be one of mean, ties, base, got 'median'"):
        merge_tensors(base, finetunes, EPSILON, shared="median")  # type: ignore[arg-type]


def one_step_group(dtype: torch.dtype) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Base 1, A = 1 + 2**-7, B = 1 + 2**-6: the mean 1 + 1.5 * 2**-7 is halfway between two bfloat16 values."""
    base = torch.ones(3, dtype=dtype)
    a = torch.tensor([1 + 2**-7, 1 + 2**-7, 1.0], dtype=dtype)
    b = torch.tensor([1 + 2**-6, 1.0, 1.0], dtype=dtype)
    return base, [a, b]


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16, torch.float64])
def test_out_dtype_rounds_once(out_dtype: torch.dtype) -> None:
    """From the float32 result straight to out_dtype: 1.01171875, not bfloat16's 1.015625 cast again."""
    base, finetunes = one_step_group(torch.bfloat16)
    assert merge_tensors(base, finetunes, EPSILON).merged.tolist() == [1.015625, 1.0078125, 1.0]  # bfloat16
    result = merge_tensors(base, finetunes, EPSILON, [1.5, 1.0], out_dtype=out_dtype).merged
    assert result.dtype == out_dtype
    assert result.tolist() == [1.01171875, 1 + 1.5 * 2**-7, 1.0]
    base, finetunes, _ = designed_group(3, dtype=torch.bfloat16)
    merged = merge_tensors(base, finetunes, EPSILON, [1.2, 1.1, 1.0], out_dtype=out_dtype, chunk_elements=999).merged
    assert torch.equal(merged, reference.merge(base, finetunes, EPSILON, [1.2, 1.1, 1.0]).to(out_dtype))


def test_float64_inputs_are_merged_in_float64() -> None:
    """Unchanged elements come back exactly; changed ones equal the float64 reference."""
    base = torch.full((5, 300), 1.000000000001, dtype=torch.float64)
    a, b = base.clone(), base.clone()
    a[0], b[0] = 1.25, 1.5  # shared
    a[1] = 1.000030000001  # unique to a; float32 would round both ends
    b[2, :7] = 0.75
    result = merge_tensors(base, [a, b], EPSILON, [1.2, 1.1], count=True, chunk_elements=256)
    assert result.merged.dtype == torch.float64
    assert torch.equal(result.merged[3:], base[3:])
    expected = reference.merge(base, [a, b], EPSILON, [1.2, 1.1])
    assert expected.dtype == torch.float64
    assert torch.equal(result.merged, expected)
    assert result.merged[1, 0].item() == 1.000000000001 + 1.2 * (1.000030000001 - 1.000000000001)
    assert result.histograms == ((300, 300), (7, 300))
    as_float32 = merge_tensors(base, [a, b], EPSILON, [1.2, 1.1], out_dtype=torch.float32).merged
    assert torch.equal(as_float32, expected.float())  # one rounding, from float64


def peak_scratch_bytes(function: Callable[[], object]) -> int:
    """Torch's peak allocations during the call, on one thread."""
    return peak_allocated_bytes(function, threads=1)[0]


#: Scratch bytes per chunk element of a bfloat16 group of N models, by what the kernel is asked for: the call
#: (base, fine-tunes, N) and the bound: float32 buffers, each model's mask and k's indicator where counting.
SCRATCH_BOUNDS: dict[str, tuple[Callable[[torch.Tensor, list[torch.Tensor], int], object], Callable[[int], int]]] = {
    "ram without statistics": (lambda base, fts, n: merge_tensors(base, fts, EPSILON), lambda n: 20),
    "ram with statistics": (lambda base, fts, n: merge_tensors(base, fts, EPSILON, count=True), lambda n: 24 + 4 * n),
    "ram_plus merge after the pre-pass": (
        lambda base, fts, n: merge_tensors(base, fts, EPSILON, [1.1] * n),
        lambda n: 24,
    ),
    "pre-pass (count only)": (lambda base, fts, n: count_overlaps(base, fts, EPSILON), lambda n: 12 + 4 * n),
    "ram_ties merge pass": (
        lambda base, fts, n: merge_tensors(base, fts, EPSILON, shared="ties", density=1.0),
        lambda n: 36,
    ),
    "ram_unique": (lambda base, fts, n: merge_tensors(base, fts, EPSILON, [0.5] * n, shared="base"), lambda n: 20),
}


@pytest.mark.parametrize("mode", SCRATCH_BOUNDS)
def test_scratch_memory_is_bounded_by_the_chunk(mode: str) -> None:
    """Beyond the bfloat16 output, a few buffers of one chunk, whatever the tensor's size."""
    call, bytes_per_element = SCRATCH_BOUNDS[mode]
    for n in (2, 5):
        scratch = []
        for numel in (2 * CHUNK_ELEMENTS, 5 * CHUNK_ELEMENTS):
            base, finetunes, _ = designed_group(n, shape=(numel,), dtype=torch.bfloat16)
            output = 0 if mode.startswith("pre-pass") else 2 * numel
            scratch.append(peak_scratch_bytes(functools.partial(call, base, finetunes, n)) - output)
        bound = bytes_per_element(n) * CHUNK_ELEMENTS
        assert max(scratch) - min(scratch) < 4096, scratch
        assert bound - 2 * CHUNK_ELEMENTS < max(scratch) <= bound + 4096, (n, scratch, bound)  # the bound is tight


def test_ties_radix_scratch_memory_is_bounded() -> None:
    """The threshold search: 12 + 4 N bytes per chunk element and 2**16 + 2 counters per model and one more, whatever
    the size."""
    for numel in (2 * CHUNK_ELEMENTS, 5 * CHUNK_ELEMENTS):
        for n in (2, 5):
            base, finetunes, _ = designed_group(n, shape=(numel,), dtype=torch.bfloat16)
            threshold = functools.partial(
                _ties_thresholds, base, finetunes, EPSILON, 0.1, torch.float32, CHUNK_ELEMENTS
            )
            scratch = peak_scratch_bytes(threshold)
            expected = (12 + 4 * n) * CHUNK_ELEMENTS + (n + 1) * 8 * ((1 << 16) + 2)
            assert abs(scratch - expected) < 4096, (numel, n, scratch, expected)


def test_inputs_that_require_grad_merge_with_history() -> None:
    """Values bit-identical to the chunked kernel; gradients torch's autograd's, equal to the reference's."""
    base, finetunes, _ = designed_group(3, shape=(300, 7))
    lambdas = [1.2, 1.1, 1.0]
    leaves = [tensor.clone().requires_grad_(True) for tensor in (base, *finetunes)]
    result = merge_tensors(leaves[0], leaves[1:], EPSILON, lambdas, count=True, chunk_elements=500)
    plain = merge_tensors(base, finetunes, EPSILON, lambdas, count=True, chunk_elements=500)
    assert result.merged.grad_fn is not None
    assert same_bits(result.merged.detach(), plain.merged)
    assert result.histograms == plain.histograms
    weights = torch.randn(base.shape, generator=torch.Generator().manual_seed(1))
    (result.merged * weights).sum().backward()
    references = [tensor.clone().requires_grad_(True) for tensor in (base, *finetunes)]
    (reference.merge(references[0], references[1:], EPSILON, lambdas) * weights).sum().backward()
    for ours, theirs in zip(leaves[1:], references[1:]):
        assert torch.equal(ours.grad, theirs.grad)  # w_t * g: lambda_t * g or g / c
    # d/d base = 1 - sum_t w_t, each summed in its own order
    torch.testing.assert_close(leaves[0].grad, references[0].grad, rtol=0, atol=4e-7)
    with torch.no_grad():
        assert merge_tensors(leaves[0], leaves[1:], EPSILON, lambdas).merged.grad_fn is None


# --- The shared region's rules: "ties" (ram_ties) and "base" (ram_unique) -------------------------


def hand_group() -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Nine elements, three models; every value is dyadic, so base + tau and the sums are exact.

    element:   0  1 (only 0)  2 (only 2)  3     4    5    6     7     8
    tau_0:     0  2           0           1     1    1   -4     0     0.125
    tau_1:     0  0           0          -2     0.5  3    0    -0.5  -0.0625
    tau_2:     0  0          -0.5         0.25  0.5 -1    0.75  0.5   0
    Shared: 3..8 (P = 6). With density 0.5, k = 3: the thresholds are model 0's 1 (the 3rd
    smallest of 0, 0.125, 1, 1, 1, 4: three equal magnitudes straddle k, all kept), model 1's
    0.5 (of 0, 0.0625, 0.5, 0.5, 2, 3) and model 2's 0.5 (of 0, 0.25, 0.5, 0.5, 0.75, 1).
    """
    taus = torch.tensor(
        [
            [0.0, 2.0, 0.0, 1.0, 1.0, 1.0, -4.0, 0.0, 0.125],
            [0.0, 0.0, 0.0, -2.0, 0.5, 3.0, 0.0, -0.5, -0.0625],
            [0.0, 0.0, -0.5, 0.25, 0.5, -1.0, 0.75, 0.5, 0.0],
        ]
    )
    base = torch.tensor([0.5, -0.25, 1.5, 2.0, -1.0, 0.75, 3.0, -2.5, 1.25])
    return base, [base + tau for tau in taus]


HAND_LAMBDAS = [1.5, 1.0, 2.0]
#: tau_merged of hand_group by density: 3: kept 1 and -2 elect -, mean -2; 4: all kept, +, 2 / 3;
#: 5: 1 + 3 against 1 elects +, mean 2; 6: -4 against 0.75, -4; 7: 0.5 against 0.5, a sign tie:
#: none; 8: 0.125 and -0.0625 both trimmed at density 0.5 (none kept), + at density 1.
HAND_TIES = {
    0.5: [0.0, 3.0, -1.0, -2.0, 2 / 3, 2.0, -4.0, 0.0, 0.0],
    1.0: [0.0, 3.0, -1.0, -2.0, 2 / 3, 2.0, -4.0, 0.0, 0.125],
}


@pytest.mark.parametrize("density", HAND_TIES)
def test_ties_by_hand(density: float) -> None:
    """Trimming with equal magnitudes at the threshold, an elected sign, a sign tie, all trimmed, lambdas."""
    base, finetunes = hand_group()
    result = merge_tensors(base, finetunes, EPSILON, HAND_LAMBDAS, shared="ties", density=density)
    expected = base + torch.tensor(HAND_TIES[density])  # 2 / 3 rounded once to float32, then added
    assert same_bits(result.merged, expected)
    assert result.merged[7] == base[7] and result.merged[0] == base[0]  # a sign tie, and no change, keep the base
    assert same_bits(result.merged, reference.ties_merge(base, finetunes, EPSILON, density, HAND_LAMBDAS))
    many_chunks = merge_tensors(
        base, finetunes, EPSILON, HAND_LAMBDAS, shared="ties", density=density, chunk_elements=2
    )
    assert same_bits(many_chunks.merged, expected)


def test_unique_by_hand() -> None:
    """ram_unique: the scaled unique updates (scale 0 keeps the base), the base at every shared position."""
    base, finetunes = hand_group()
    for scales, unique in (([1.5, 1.0, 2.0], [3.0, -1.0]), ([0.0, 1 / 3, 1.0], [0.0, -0.5]), (None, [2.0, -0.5])):
        result = merge_tensors(base, finetunes, EPSILON, scales, shared="base").merged
        expected = base.clone()
        expected[1:3] += torch.tensor(unique)
        assert same_bits(result, expected)
        assert same_bits(result, reference.unique_merge(base, finetunes, EPSILON, scales or [1.0] * 3))


def test_ties_gradients_by_hand() -> None:
    """d merged / d theta_t: 1 / n where t's kept entry agrees with the elected sign, lambda_t where only t changed;
    d merged / d theta_pre: 1 minus their sum."""
    base, finetunes = hand_group()
    leaves = [tensor.clone().requires_grad_(True) for tensor in (base, *finetunes)]
    result = merge_tensors(leaves[0], leaves[1:], EPSILON, HAND_LAMBDAS, shared="ties", density=0.5)
    result.merged.sum().backward()
    third = (torch.tensor(1.0) / 3).item()
    assert leaves[1].grad.tolist() == [0.0, 1.5, 0.0, 0.0, third, 0.5, 1.0, 0.0, 0.0]
    assert leaves[2].grad.tolist() == [0.0, 0.0, 0.0, 1.0, third, 0.5, 0.0, 0.0, 0.0]
    assert leaves[3].grad.tolist() == [0.0, 0.0, 2.0, 0.0, third, 0.0, 0.0, 0.0, 0.0]
    assert leaves[0].grad.tolist() == pytest.approx([1.0, -0.5, -1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0], abs=2.5e-7)


def kth_magnitudes(base: torch.Tensor, finetunes: list[torch.Tensor], density: float) -> list[float]:
    """torch.kthvalue of each model's |tau_t| m_t over the shared positions (reference.ties_keep's threshold)."""
    dtype = reference.arithmetic_dtype(base, finetunes)
    masks = reference.masks(base, finetunes, EPSILON)
    shared = torch.stack(masks).sum(0) >= 2
    k = math.floor(int(shared.sum()) * (1 - density))
    entries = [((finetune.to(dtype) - base.to(dtype)) * mask)[shared].abs() for finetune, mask in zip(finetunes, masks)]
    return [entry.kthvalue(k).values.item() for entry in entries]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("density", [0.1, 0.5, 1e-4, 0.9])
def test_ties_thresholds_are_kthvalue_bit_for_bit(dtype: torch.dtype, density: float) -> None:
    """The radix select over many chunks gives torch.kthvalue's magnitude exactly.

    Four models each changing 80% of 3000 elements, by changes of different sizes, the others
    by noise under epsilon (float32, float64); the bfloat16 ones repeat magnitudes a lot, so
    many equal values straddle k. At density 0.9 the k-th smallest is an inactive entry's 0.
    """
    generator = torch.Generator().manual_seed(7)
    base = torch.randn(3000, generator=generator, dtype=torch.float64).to(dtype)
    scales = torch.tensor([[0.01], [0.03], [0.05], [0.1]])
    noise = (torch.rand(4, 3000, generator=generator) - 0.5) * EPSILON
    changes = torch.where(
        torch.rand(4, 3000, generator=generator) < 0.8, scales * torch.randn(4, 3000, generator=generator), noise
    )
    finetunes = [(base.double() + change).to(dtype) for change in changes]
    arithmetic = compute_dtype(dtype)
    above_epsilon = torch.nextafter(torch.tensor(EPSILON, dtype=arithmetic), torch.tensor(1.0, dtype=arithmetic))
    expected = [max(kth, above_epsilon.item()) for kth in kth_magnitudes(base, finetunes, density)]
    assert len(set(expected)) == (1 if density == 0.9 else 4)  # one threshold per model, or epsilon's
    assert _ties_thresholds(base, finetunes, EPSILON, density, arithmetic, 333) == tuple(expected)
    assert _ties_thresholds(base, finetunes, EPSILON, 1.0, arithmetic, 333) == (above_epsilon.item(),) * 4  # k == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_ties_passes(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """Radix passes over the chunks: 16 bits each (2 in float32, 4 in float64), none when k == 0, one when P == 0."""
    calls: list[int] = []
    digit_tables = kernel._digit_tables
    monkeypatch.setattr(kernel, "_digit_tables", lambda *args: calls.append(args[5]) or digit_tables(*args))
    base, finetunes, _ = designed_group(3, shape=(10, 10), dtype=dtype)
    for density, finetunes_, shifts in (
        (0.1, finetunes, {torch.float32: [16, 0], torch.float64: [48, 32, 16, 0]}[dtype]),
        (1.0, finetunes, []),
        (0.1, [finetunes[0], base], [16 if dtype == torch.float32 else 48]),
    ):
        calls.clear()
        merge_tensors(base, finetunes_, EPSILON, shared="ties", density=density, chunk_elements=50)
        assert calls == shifts


RULE_CASES = {
    "ties": lambda base, fts, lambdas, density: reference.ties_merge(base, fts, EPSILON, density, lambdas),
    "base": lambda base, fts, lambdas, density: reference.unique_merge(base, fts, EPSILON, lambdas),
    "mean": lambda base, fts, lambdas, density: reference.merge(base, fts, EPSILON, lambdas),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("n", [2, 3, 5])
@pytest.mark.parametrize("rule", RULE_CASES)
def test_rules_equal_the_reference_bit_for_bit(dtype: torch.dtype, n: int, rule: str) -> None:
    """Every density (tiny, 0.1, 0.5, 1: no trimming), with lambdas, one chunk or many."""
    base, finetunes, _ = designed_group(n, shape=(50, 41), dtype=dtype, seed=n)
    lambdas = [[1.0, 0.0, 1 / 3, 1.2, 0.9][index] for index in range(n)]
    for density in (1e-3, 0.1, 0.5, 1.0):
        expected = RULE_CASES[rule](base, finetunes, lambdas, density).to(dtype)
        whole = merge_tensors(base, finetunes, EPSILON, lambdas, shared=rule, density=density)
        chunked = merge_tensors(base, finetunes, EPSILON, lambdas, shared=rule, density=density, chunk_elements=97)
        assert same_bits(whole.merged, expected), (density, int((whole.merged != expected).sum()))
        assert same_bits(chunked.merged, expected)
        if rule != "ties":
            break


def test_ties_without_shared_positions_is_the_unique_rule() -> None:
    """P == 0: nothing to trim (no radix pass), the unique updates scaled, the rest the base."""
    base = torch.linspace(-1, 1, 12)
    first, second = base.clone(), base.clone()
    first[:4] += 0.25
    second[6:8] -= 0.5
    ties = merge_tensors(base, [first, second], EPSILON, [2.0, 3.0], shared="ties", density=0.1)
    unique = merge_tensors(base, [first, second], EPSILON, [2.0, 3.0], shared="base")
    expected = base.clone()
    expected[:4] += 0.5
    expected[6:8] -= 1.5
    assert same_bits(ties.merged, expected) and same_bits(unique.merged, expected)
    assert same_bits(ties.merged, reference.ties_merge(base, [first, second], EPSILON, 0.1, [2.0, 3.0]))


def test_histograms_are_the_same_for_every_rule() -> None:
    base, finetunes, _ = designed_group(3, shape=(1000, 7), dtype=torch.bfloat16)
    expected = reference_histograms(base, finetunes)
    for rule in RULE_CASES:
        for chunk in (CHUNK_ELEMENTS, 499):
            result = merge_tensors(
                base, finetunes, EPSILON, [1.2, 0.5, 1.0], count=True, shared=rule, chunk_elements=chunk
            )
            plain = merge_tensors(base, finetunes, EPSILON, [1.2, 0.5, 1.0], shared=rule)
            assert result.histograms == expected
            assert same_bits(result.merged, plain.merged)


@pytest.mark.parametrize("rule", RULE_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lambdas", [None, [1.2, 0.0, 1 / 3]])
def test_rule_gradients_equal_the_reference(rule: str, dtype: torch.dtype, lambdas: Optional[list[float]]) -> None:
    """The fine-tunes' gradients exactly the reference's, the base's 1 - their sum; the values the chunked ones."""
    base, finetunes, _ = designed_group(3, shape=(300, 7), dtype=dtype)
    leaves = [tensor.clone().requires_grad_(True) for tensor in (base, *finetunes)]
    result = merge_tensors(leaves[0], leaves[1:], EPSILON, lambdas, shared=rule, density=0.3)
    assert result.merged.grad_fn is not None
    plain = merge_tensors(base, finetunes, EPSILON, lambdas, shared=rule, density=0.3, chunk_elements=500)
    assert same_bits(result.merged.detach(), plain.merged)
    weights = torch.randn(base.shape, generator=torch.Generator().manual_seed(1))
    (result.merged.float() * weights).sum().backward()
    references = [tensor.clone().requires_grad_(True) for tensor in (base, *finetunes)]
    (
        RULE_CASES[rule](references[0], references[1:], lambdas or [1.0] * 3, 0.3).to(dtype).float() * weights
    ).sum().backward()
    for ours, theirs in zip(leaves[1:], references[1:]):
        assert torch.equal(ours.grad, theirs.grad)  # equal values; a zero's sign may differ
    torch.testing.assert_close(leaves[0].grad.float(), references[0].grad.float(), rtol=0, atol=2.5e-7)
