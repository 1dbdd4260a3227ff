"""The tensor math against the independent reference, on active sets built per element.

Both entry points: ``count_overlaps`` (the pre-pass) and ``merge_tensors`` (with or without
counts). Tensors below one chunk run on one worker; the chunking and worker tests cut them.
"""

from __future__ import annotations

import functools
import math
import threading
import time
from typing import Callable

import pytest
import torch

from benchmarks.memory import peak_allocated_bytes
from mergekit_ram.kernel import (
    CHUNK_ELEMENTS,
    MergeOverflowError,
    NonFiniteInputError,
    _map_chunks,
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


@pytest.mark.parametrize("n", [1, 2, 3, 5])
@pytest.mark.parametrize("lambdas_kind", ["ram", "ram_plus"])
def test_float32_merge_equals_reference(n: int, lambdas_kind: str) -> None:
    base, finetunes, _ = designed_group(n)
    lambdas = [1.0] * n if lambdas_kind == "ram" else [1.0 + 0.07 * (i + 1) for i in range(n)]
    result = merge_tensors(base, finetunes, EPSILON, lambdas, workers=1)
    expected = reference.merge(base, finetunes, EPSILON, lambdas)
    assert result.histograms is None
    assert result.merged.dtype == torch.float32
    torch.testing.assert_close(result.merged, expected, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_output_is_reference_rounded(dtype: torch.dtype) -> None:
    base, finetunes, _ = designed_group(3, dtype=dtype)
    lambdas = [1.2, 1.145, 1.11]
    result = merge_tensors(base, finetunes, EPSILON, lambdas, workers=1)
    expected = reference.merge(base, finetunes, EPSILON, lambdas).to(dtype)
    assert result.merged.dtype == dtype
    assert torch.equal(result.merged, expected)


def test_counts_match_design_and_reference() -> None:
    base, finetunes, active = designed_group(4)
    result = count_overlaps(base, finetunes, EPSILON, workers=1)
    ref = reference.counts(base, finetunes, EPSILON)
    assert [list(row) for row in result.histograms] == ref.histograms
    overlap = active.sum(0)
    for index in range(4):
        assert sum(result.histograms[index]) == int(active[index].sum())  # the design, exactly
        assert result.histograms[index][0] == int((active[index] & (overlap == 1)).sum())


@pytest.mark.parametrize("n", [1, 2, 3, 5])
@pytest.mark.parametrize("lambdas_kind", ["ram", "ram_plus"])
def test_merge_with_counts_equals_merge_and_count_overlaps(n: int, lambdas_kind: str) -> None:
    """count=True adds the histograms of count_overlaps (the reference's) and changes no merged bit."""
    base, finetunes, _ = designed_group(n, dtype=torch.bfloat16, seed=n)
    lambdas = None if lambdas_kind == "ram" else [1.0 + 0.1 * (i + 1) for i in range(n)]
    both = merge_tensors(base, finetunes, EPSILON, lambdas, workers=1, count=True)
    merged_only = merge_tensors(base, finetunes, EPSILON, lambdas, workers=1)
    counted_only = count_overlaps(base, finetunes, EPSILON, workers=1)
    expected = reference.counts(base, finetunes, EPSILON).histograms
    assert [list(row) for row in counted_only.histograms] == expected
    assert both.histograms == counted_only.histograms
    assert merged_only.histograms is None
    assert torch.equal(both.merged, merged_only.merged)
    assert torch.equal(both.merged, reference.merge(base, finetunes, EPSILON, lambdas or [1.0] * n).to(base.dtype))


@pytest.mark.parametrize("n", [15, 17, 22, 26])
def test_many_models_use_the_wider_pattern_paths(n: int) -> None:
    """int16 and int32 bincounts (15, 17), the sparse table (22), the int64 pattern (26)."""
    base, finetunes, _ = designed_group(n, shape=(40, 30))
    expected = reference.counts(base, finetunes, EPSILON).histograms
    result = count_overlaps(base, finetunes, EPSILON, workers=1)
    assert [list(row) for row in result.histograms] == expected
    merged = merge_tensors(base, finetunes, EPSILON, [1.1] * n, workers=1, count=True)
    assert [list(row) for row in merged.histograms] == expected
    assert torch.equal(merged.merged, reference.merge(base, finetunes, EPSILON, [1.1] * n))


def test_epsilon_is_strict_and_compared_in_float32() -> None:
    base = torch.zeros(4)
    finetune = torch.tensor([1e-5, 2e-5, -1e-5, -3e-5])
    result = merge_tensors(base, [finetune], 1e-5, workers=1, count=True)
    assert result.histograms == ((2,),)
    assert torch.equal(result.merged, torch.tensor([0.0, 2e-5, 0.0, -3e-5]))


def test_epsilon_zero_counts_every_change() -> None:
    base, finetunes, _ = designed_group(2)
    result = merge_tensors(base, finetunes, 0.0, workers=1, count=True)
    assert [sum(row) for row in result.histograms] == [int((f != base).sum()) for f in finetunes]
    torch.testing.assert_close(result.merged, reference.merge(base, finetunes, 0.0, [1.0, 1.0]), rtol=0, atol=0)


def test_sum_overflow_is_an_error_never_nan_or_inf() -> None:
    """Finite inputs whose float32 sum overflows: an error naming the cause, in float64 the exact result."""
    big = 3.0e38
    base = torch.zeros(6)
    finetunes = [
        torch.tensor([big, big, 0.0, big, 1.0, -big]),
        torch.tensor([big, 0.0, big, 0.0, 1.0, -big]),
    ]
    with pytest.raises(MergeOverflowError) as error:
        merge_tensors(base, finetunes, EPSILON, [1.0, 1.0], workers=1, count=True)
    assert (error.value.cause, error.value.dtype) == ("sum", torch.float32)
    wide = merge_tensors(base.double(), [f.double() for f in finetunes], EPSILON, workers=1)
    big32 = torch.tensor(big).item()  # 3e38 as float32
    assert wide.merged.tolist() == [big32, big32, big32, big32, 1.0, -big32]


@pytest.mark.parametrize("lam", [1e300, 1e38])
def test_lambda_overflow_names_the_model(lam: float) -> None:
    """lambda beyond float32 (1e300) or lambda * tau beyond it (1e38 * 5): an error naming the model."""
    base = torch.zeros(4)
    finetunes = [torch.tensor([5.0, 0.0, 1.0, 0.0]), torch.tensor([0.0, 2.0, 1.0, 0.0])]  # unique: 5 and 2
    with pytest.raises(MergeOverflowError) as error:
        merge_tensors(base, finetunes, EPSILON, [lam, 1.2], workers=1)
    assert (error.value.cause, error.value.index, error.value.dtype) == ("lambda", 0, torch.float32)
    if lam == 1e300:  # refused before any work, whichever model
        with pytest.raises(MergeOverflowError) as error:
            merge_tensors(base, finetunes, EPSILON, [1.2, lam], workers=1)
        assert (error.value.cause, error.value.index) == ("lambda", 1)
    else:  # 1e38 * 2 fits: applied exactly, and no NaN from 0 * lambda on inactive elements
        fits = merge_tensors(base, finetunes, EPSILON, [1.2, lam], workers=1)
        assert fits.merged.tolist() == [6.0, (torch.tensor(lam) * 2).item(), 1.0, 0.0]
        assert torch.equal(fits.merged, reference.merge(base, finetunes, EPSILON, [1.2, lam]))


def test_cast_overflow_is_an_error() -> None:
    base = torch.tensor([60000.0, 1.0])
    finetune = torch.tensor([70000.0, 1.5])
    with pytest.raises(MergeOverflowError) as error:
        merge_tensors(base, [finetune], EPSILON, workers=1, out_dtype=torch.float16)
    assert (error.value.cause, error.value.dtype) == ("cast", torch.float16)


def test_finetune_equal_to_base_changes_nothing() -> None:
    base, finetunes, _ = designed_group(2)
    result = merge_tensors(base, [base.clone(), finetunes[1]], EPSILON, [1.2, 1.2], workers=1, count=True)
    assert result.histograms[0] == (0, 0)
    assert not torch.isnan(result.merged).any()
    torch.testing.assert_close(
        result.merged, reference.merge(base, [base, finetunes[1]], EPSILON, [1.2, 1.2]), rtol=0, atol=0
    )


def test_identical_finetunes_average_to_themselves_without_nan() -> None:
    base, finetunes, _ = designed_group(1)
    result = merge_tensors(base, [finetunes[0], finetunes[0].clone()], EPSILON, [1.2, 1.2], workers=1, count=True)
    assert result.histograms[0][0] == 0  # nothing unique
    assert not torch.isnan(result.merged).any()
    changed = (finetunes[0] - base).abs() > EPSILON
    assert torch.equal(result.merged[changed], finetunes[0][changed])


def test_single_model_resets_subthreshold_changes() -> None:
    base, finetunes, active = designed_group(1)
    result = merge_tensors(base, finetunes, EPSILON, [1.0], workers=1)
    assert torch.equal(result.merged[active[0]], finetunes[0][active[0]])
    assert torch.equal(result.merged[~active[0]], base[~active[0]])


def test_no_finetunes_returns_the_base() -> None:
    base = torch.randn(5, 3)
    result = merge_tensors(base, [], EPSILON, workers=1, count=True)
    assert torch.equal(result.merged, base)
    assert result.histograms == ()
    assert count_overlaps(base, [], EPSILON, workers=1).histograms == ()


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_inputs_are_named(bad: float) -> None:
    base, finetunes, _ = designed_group(3)
    finetunes[2] = finetunes[2].clone()
    finetunes[2][3, 4] = bad
    with pytest.raises(NonFiniteInputError) as error:
        merge_tensors(base, finetunes, EPSILON, workers=1)
    assert error.value.index == 2
    poisoned = base.clone()
    poisoned[0, 0] = bad
    with pytest.raises(NonFiniteInputError) as error:
        count_overlaps(poisoned, finetunes[:2], EPSILON, workers=1)
    assert error.value.index is None


def test_large_finite_values_are_not_mistaken_for_inf() -> None:
    base = torch.full((1000,), 3e35)
    finetune = base.clone()
    finetune[:500] = -3e35  # |tau| = 6e35; the sum of magnitudes overflows float32
    result = merge_tensors(base, [finetune], EPSILON, workers=1)
    assert torch.isfinite(result.merged).all()
    assert torch.equal(result.merged, reference.merge(base, [finetune], EPSILON, [1.0]))
    assert torch.equal(result.merged, finetune)  # one model changed each element: its change at full strength


def peak_scratch_bytes(function) -> int:
    """Measured with one thread: the profiler sees the calling thread's allocations only."""
    return peak_allocated_bytes(function, threads=1)[0]


#: Scratch bytes per chunk element of a bfloat16 group, by what the kernel is asked for: the
#: call on one worker (base, fine-tunes, N), whether it returns a bfloat16 output, the bound.
SCRATCH_BOUNDS: dict[str, tuple[Callable[[torch.Tensor, list[torch.Tensor], int], object], bool, int]] = {
    "ram without statistics": (lambda base, fts, n: merge_tensors(base, fts, EPSILON, workers=1), True, 20),
    "ram with statistics": (lambda base, fts, n: merge_tensors(base, fts, EPSILON, workers=1, count=True), True, 26),
    "ram_plus merge after the pre-pass": (
        lambda base, fts, n: merge_tensors(base, fts, EPSILON, [1.1] * n, workers=1),
        True,
        24,
    ),
    "ram_plus with pinned statistics": (
        lambda base, fts, n: merge_tensors(base, fts, EPSILON, [1.1] * n, workers=1, count=True),
        True,
        30,
    ),
    "pre-pass (count only)": (lambda base, fts, n: count_overlaps(base, fts, EPSILON, workers=1), False, 14),
}


@pytest.mark.parametrize("mode", SCRATCH_BOUNDS)
def test_scratch_memory_is_bounded_and_independent_of_n(mode: str) -> None:
    """Beyond the output, a few float32 buffers of one chunk, whatever N and the tensor size.

    Measured with one worker thread (the profiler sees the calling thread's allocations);
    each further worker has its own scratch of the same size.
    """
    call, has_output, bytes_per_element = SCRATCH_BOUNDS[mode]
    scratch = {}
    for numel in (2 * CHUNK_ELEMENTS, 5 * CHUNK_ELEMENTS):
        for n in (2, 3, 5):
            base, finetunes, _ = designed_group(n, shape=(numel,), dtype=torch.bfloat16)
            peak = peak_scratch_bytes(functools.partial(call, base, finetunes, n))
            scratch[numel, n] = peak - (2 * numel if has_output else 0)  # minus the bfloat16 output
    assert max(scratch.values()) - min(scratch.values()) < 4096, scratch  # a bincount of 2**N counters at most
    assert max(scratch.values()) <= bytes_per_element * CHUNK_ELEMENTS + 4096, scratch
    assert max(scratch.values()) > (bytes_per_element - 2) * CHUNK_ELEMENTS, scratch  # the bound is tight


def test_chunk_boundaries_do_not_change_results() -> None:
    base, finetunes, _ = designed_group(3, shape=(1000, 7), dtype=torch.bfloat16)
    whole = merge_tensors(base, finetunes, EPSILON, [1.2, 1.1, 1.0], workers=1, count=True)
    for chunk in (1, 997, 4096):
        chunked = merge_tensors(base, finetunes, EPSILON, [1.2, 1.1, 1.0], workers=1, count=True, chunk_elements=chunk)
        assert torch.equal(chunked.merged, whole.merged)
        assert chunked.histograms == whole.histograms
        assert count_overlaps(base, finetunes, EPSILON, workers=1, chunk_elements=chunk).histograms == whole.histograms


@pytest.mark.parametrize("lambdas", [None, [1.2, 1.1, 1.0]])
def test_two_workers_are_bit_identical_to_one(lambdas: list[float] | None) -> None:
    """Chunks shared out to a pool of two threads: the same merged bits and histograms as one worker."""
    base, finetunes, _ = designed_group(3, shape=(1000, 7), dtype=torch.bfloat16)
    one = merge_tensors(base, finetunes, EPSILON, lambdas, workers=1, count=True, chunk_elements=499)
    two = merge_tensors(base, finetunes, EPSILON, lambdas, workers=2, count=True, chunk_elements=499)
    assert torch.equal(two.merged, one.merged)
    assert two.histograms == one.histograms
    assert [list(row) for row in one.histograms] == reference.counts(base, finetunes, EPSILON).histograms
    counted = count_overlaps(base, finetunes, EPSILON, workers=2, chunk_elements=499)
    assert counted.histograms == count_overlaps(base, finetunes, EPSILON, workers=1, chunk_elements=499).histograms
    assert counted.histograms == one.histograms


def test_bad_calls_are_refused() -> None:
    """No worker, a lambda per model missing, more models than the pattern's bits when counting."""
    base, finetunes, _ = designed_group(2)
    for call in (count_overlaps, merge_tensors):
        with pytest.raises(ValueError, match="workers must be at least 1, got 0"):
            call(base, finetunes, EPSILON, workers=0)
    with pytest.raises(ValueError, match="expected 2 lambda values, got 1"):
        merge_tensors(base, finetunes, EPSILON, [1.2], workers=1)
    with pytest.raises(ValueError, match="shape"):
        count_overlaps(base, [finetunes[0].T], EPSILON, workers=1)
    many = [finetunes[index % 2] for index in range(63)]
    with pytest.raises(ValueError, match="at most 62 fine-tuned models, got 63"):
        count_overlaps(base, many, EPSILON, workers=1)
    with pytest.raises(ValueError, match="at most 62 fine-tuned models, got 63"):
        merge_tensors(base, many, EPSILON, workers=1, count=True)
    merged = merge_tensors(base, many, EPSILON, workers=1).merged  # merging needs no pattern
    assert torch.equal(merged, reference.merge(base, many, EPSILON, [1.0] * 63))


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
    assert merge_tensors(base, finetunes, EPSILON, workers=1).merged.tolist() == [1.015625, 1.0078125, 1.0]  # bfloat16
    result = merge_tensors(base, finetunes, EPSILON, [1.5, 1.0], workers=1, out_dtype=out_dtype).merged
    assert result.dtype == out_dtype
    assert result.tolist() == [1.01171875, 1 + 1.5 * 2**-7, 1.0]
    base, finetunes, _ = designed_group(3, dtype=torch.bfloat16)
    merged = merge_tensors(
        base, finetunes, EPSILON, [1.2, 1.1, 1.0], workers=1, out_dtype=out_dtype, chunk_elements=999
    ).merged
    assert torch.equal(merged, reference.merge(base, finetunes, EPSILON, [1.2, 1.1, 1.0]).to(out_dtype))


def test_float64_inputs_are_merged_in_float64() -> None:
    """Unchanged elements come back exactly; changed ones equal the float64 reference."""
    base = torch.full((5, 300), 1.000000000001, dtype=torch.float64)
    a, b = base.clone(), base.clone()
    a[0], b[0] = 1.25, 1.5  # shared
    a[1] = 1.000030000001  # unique to a; float32 would round both ends
    b[2, :7] = 0.75
    result = merge_tensors(base, [a, b], EPSILON, [1.2, 1.1], workers=1, count=True, chunk_elements=256)
    assert result.merged.dtype == torch.float64
    assert torch.equal(result.merged[3:], base[3:])
    assert result.merged[3, 0].item() == 1.000000000001
    expected = reference.merge(base, [a, b], EPSILON, [1.2, 1.1])
    assert expected.dtype == torch.float64
    assert torch.equal(result.merged, expected)
    assert result.merged[1, 0].item() == 1.000000000001 + 1.2 * (1.000030000001 - 1.000000000001)
    assert result.histograms == ((300, 300), (7, 300))
    as_float32 = merge_tensors(base, [a, b], EPSILON, [1.2, 1.1], workers=1, out_dtype=torch.float32).merged
    assert torch.equal(as_float32, expected.float())  # one rounding, from float64


def test_inputs_that_require_grad_merge_with_history() -> None:
    """Values bit-identical to the kernel without autograd; gradients equal the reference's."""
    base, finetunes, _ = designed_group(3, shape=(300, 7))
    lambdas = [1.2, 1.1, 1.0]
    leaves = [tensor.clone().requires_grad_(True) for tensor in (base, *finetunes)]
    result = merge_tensors(leaves[0], leaves[1:], EPSILON, lambdas, workers=2, count=True, chunk_elements=500)
    plain = merge_tensors(base, finetunes, EPSILON, lambdas, workers=1, count=True)
    assert result.merged.grad_fn is not None
    assert torch.equal(result.merged.detach(), plain.merged)
    assert result.histograms == plain.histograms
    weights = torch.randn(base.shape, generator=torch.Generator().manual_seed(1))
    (result.merged * weights).sum().backward()
    references = [tensor.clone().requires_grad_(True) for tensor in (base, *finetunes)]
    (reference.merge(references[0], references[1:], EPSILON, lambdas) * weights).sum().backward()
    for ours, theirs in zip(leaves[1:], references[1:]):
        assert torch.equal(ours.grad, theirs.grad)  # w_t * g: lambda_t * g or g / c
    # d/d base = 1 - sum_t w_t: exactly 0 where c >= 2 here; the reference sums c rounded terms g / c
    torch.testing.assert_close(leaves[0].grad, references[0].grad, rtol=0, atol=4e-7)
    with torch.no_grad():
        assert merge_tensors(leaves[0], leaves[1:], EPSILON, lambdas, workers=1).merged.grad_fn is None


def test_concurrent_callers_keep_their_thread_counts() -> None:
    """Each caller's torch thread count is its own before, during and after merging."""
    base, finetunes, _ = designed_group(3, shape=(6 * CHUNK_ELEMENTS,), dtype=torch.bfloat16)
    saved = torch.get_num_threads()
    seen: dict[int, set[int]] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def caller(threads: int) -> None:
        try:
            torch.get_num_threads()  # torch initialises a new thread's count on first use, then keeps a set one
            torch.set_num_threads(threads)
            start.wait()
            counts = set()
            for _ in range(4):
                merge_tensors(base, finetunes, EPSILON, [1.1, 1.2, 1.3], workers=2)
                counts.add(torch.get_num_threads())
            seen[threads] = counts
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    try:
        callers = [threading.Thread(target=caller, args=(threads,)) for threads in (3, 5)]
        for thread in callers:
            thread.start()
        for thread in callers:
            thread.join()
    finally:
        torch.set_num_threads(saved)
    assert not errors, errors
    assert seen == {3: {3}, 5: {5}}


def test_the_caller_takes_chunks_and_every_worker_runs_on_one_intra_op_thread() -> None:
    """Half the threads start per call: the caller is one of the workers, on one thread meanwhile."""
    caller = threading.current_thread()
    saved = torch.get_num_threads()
    ran: list[tuple[bool, int]] = []

    def run(start: int, state: object) -> None:
        ran.append((threading.current_thread() is caller, torch.get_num_threads()))
        time.sleep(0.002)  # long enough for both workers to take chunks

    try:
        torch.set_num_threads(3)
        states = _map_chunks(run, object, range(40), workers=2)
        assert torch.get_num_threads() == 3  # the caller's own count is back
    finally:
        torch.set_num_threads(saved)
    assert len(ran) == 40 and len(states) == 2
    assert {threads for _, threads in ran} == {1}
    assert {on_caller for on_caller, _ in ran} == {True, False}


def test_a_failing_chunk_stops_every_worker() -> None:
    ran: list[int] = []

    def run(start: int, state: object) -> None:
        if start == 3:
            raise RuntimeError("chunk 3")
        ran.append(start)
        time.sleep(0.002)

    with pytest.raises(RuntimeError, match="chunk 3"):
        _map_chunks(run, object, range(1000), workers=2)
    assert len(ran) < 10  # the other worker took at most the chunk it held


def test_pool_threads_leave_the_process_default_alone() -> None:
    """A thread started after a merge gets torch's default, not the pool threads' single thread."""
    base, finetunes, _ = designed_group(2, shape=(4 * CHUNK_ELEMENTS,))
    saved = torch.get_num_threads()
    merge_tensors(base, finetunes, EPSILON, workers=2)
    count_overlaps(base, finetunes, EPSILON, workers=2)
    assert torch.get_num_threads() == saved
    later: list[int] = []
    thread = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    assert later == [saved]
