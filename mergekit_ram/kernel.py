"""RAM / RAM+ tensor math (paper section 4, Algorithm 1) and its TIES and unique-only variants. Knows torch only.

For one tensor with base ``theta_pre`` and fine-tunes ``theta_t``, ``t = 1..N``:

    tau_t = theta_t - theta_pre
    m_t   = |tau_t| > epsilon                   (strict, in the arithmetic dtype)
    c     = sum_t m_t                           (how many models changed an element)
    tau_merged = 0                 where c == 0
               = lambda_t * tau_t  where c == 1 and m_t   (the unique region)
               = shared rule       where c >= 2           (the shared region)
    theta_merged = theta_pre + tau_merged

The shared rule (``merge_tensors``' ``shared``):

    "mean" (ram, ram_plus): the mean of the active updates.
    "ties" (ram_ties): per model, its updates at the tensor's P shared positions (0 where it is
           inactive) are kept where their magnitude is at least the k-th smallest of them,
           k = floor(P * (1 - density)) (all kept when k == 0); per position the sign of
           (sum of kept positive entries) - (sum of kept negative magnitudes) is elected (none
           where it is 0), and tau_merged is the mean of the kept entries of that sign (0 if none).
    "base" (ram_unique): 0; the lambdas are then the scales of the unique updates.

Two entry points: ``count_overlaps`` gives the overlap histograms (``OverlapCounts``: per
model, how many of its changed elements k models changed; the statistics pre-pass), and
``merge_tensors`` the merged tensor (``MergeResult``), with the same histograms in the same
pass when asked (``count=True``). The caller says how many worker threads run the chunks.

Arithmetic is in float32, or float64 when an input is float64 (the wider of float32 and
the inputs' precision); the result is written once, from that precision, in the output dtype
(the base's unless asked). Finite inputs never give NaN or Inf: an overflow is an error
(``MergeOverflowError``). Inputs that require grad get a merged tensor with autograd history.
The work runs over chunks of CHUNK_ELEMENTS elements; scratch per element of one chunk, with a
bfloat16 base (4 bytes less for a float32 one), up to 15 models: 20 bytes for "mean" and "base"
(24 with lambdas != 1 and "mean"), 36 for "ties"; 6 more when the histograms are taken in the
same pass (14 when only counting). Beyond 15 models the statistics' integer codes widen from 2
to 4 bytes; beyond 24 the pattern is int64, with an int64 copy of each mask. "ties" with
density < 1 first finds each model's k-th smallest magnitude exactly, by a radix select over
the chunks (two passes of 16 bits in float32, four in float64; none when k == 0): 16 bytes per
chunk element and N + 1 tables of 2**16 counters (0.5 MiB each) per worker. Counting adds a
table of 2**N counters per worker. Beyond these only the output is allocated. With float64
arithmetic each float buffer is twice as wide.

Mechanisms kept, measured against their simplifications (``python -m benchmarks.kernel_rules
--numel 8M --n 3 --alternatives``, a counting ``ram`` merge, medians of three runs in one hour on 2
shared cores at load 4.6 to 9.7, so noisy): float32 activity patterns up to 24 models (int64:
1.49x / 1.39x / 1.72x slower, 10 B more per chunk element); a bincount of 2**N bins up to 20
(torch.unique: 2.15x / 2.13x / 2.55x); int16 codes up to 15 (int32: 1.10x / 0.98x / 1.22x, 2 B
more). The radix select of the TIES thresholds: exact, 0.75x the time of torch.kthvalue on the
gathered shared magnitudes and 0.5 against 22 B per element of the tensor. Kept for what they
guarantee, not for speed: workers each on one intra-op thread (1.22x / 0.49x / 0.88x here: no
verdict under this load; 3-6x on a busy machine in docs/performance.md), with OpenMP's
per-thread setter (torch.set_num_threads would also set the default of threads started later);
autograd (docs/method.md; nothing runs without grad).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import dataclasses
import functools
import math
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Literal, NamedTuple, Optional, Sequence, TypeVar, get_args

import torch

#: The pattern tiers (module docstring): float32 bits, int16 codes, a dense bincount; int64 bits at most.
_FLOAT_PATTERN_MAX_MODELS = 24
_INT16_MAX_MODELS = 15
_BINCOUNT_MAX_MODELS = 20
_PATTERN_MAX_MODELS = 62

#: What the shared region (c >= 2) gets: the mean of the active updates (ram, ram_plus), the
#: TIES-trimmed sign-elected mean (ram_ties), or nothing, the base's value (ram_unique).
SharedRule = Literal["mean", "ties", "base"]
#: ram_ties' default share of each model's shared updates kept.
#: The radix select of the TIES thresholds reads 16 bits of the magnitudes per pass.
_DIGIT_BITS = 16


class NonFiniteInputError(ValueError):
    """An input holds NaN or Inf; ``index`` is the fine-tune's position, or None for the base."""

    def __init__(self, index: Optional[int], value: Literal["NaN", "Inf"] = "NaN"):
        self.index = index
        self.value = value
        where = "base" if index is None else f"fine-tuned input {index}"
        super().__init__(f"{where} contains {value}")


OverflowCause = Literal["update", "lambda", "sum", "cast"]


class MergeOverflowError(ValueError):
    """Finite inputs whose merged result is not finite; the kernel never returns NaN or Inf.

    ``cause``, the first that applies where the result overflowed: ``update`` (fine-tune
    ``index``'s update theta_t - theta_pre itself does not fit the arithmetic dtype ``dtype``),
    ``lambda`` (fine-tune ``index``'s lambda, or the base plus lambda times its update where the
    update fits, does not fit ``dtype``), ``sum`` (the merged update, or the base plus it, does not
    fit ``dtype``), or ``cast`` (the result does not fit the output dtype ``dtype``).
    """

    def __init__(self, cause: OverflowCause, index: Optional[int], dtype: torch.dtype):
        self.cause, self.index, self.dtype = cause, index, dtype
        what = {
            "update": f"the update of fine-tuned input {index} (minus the base)",
            "lambda": f"lambda of fine-tuned input {index} times its update",
            "sum": "the merged update",
            "cast": "the result",
        }[cause]
        super().__init__(f"{what} does not fit {str(dtype).removeprefix('torch.')}")


def compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """The arithmetic dtype: float32, or the inputs' precision where wider (float64)."""
    return torch.float64 if torch.float64 in dtypes else torch.float32


Histograms = tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class OverlapCounts:
    """The overlap histograms of one tensor group (``count_overlaps``).

    ``histograms[t][k - 1]`` is the number of elements model t changed that exactly k
    models changed (k = 1 is unique, k >= 2 shared).
    """

    histograms: Histograms


@dataclass(frozen=True)
class MergeResult:
    """The merged tensor of one group (``merge_tensors``), with its histograms when counted.

    ``histograms`` is set exactly when the merge was asked to count (``count=True``); it reads
    as ``OverlapCounts.histograms``.
    """

    merged: torch.Tensor
    histograms: Optional[Histograms]


#: Elements per step: the scratch buffers (at most 42 bytes per element) stay in the CPU caches and
#: are independent of the tensor's size (2**17 measured fastest, 2**15 to 2**20 tried).
CHUNK_ELEMENTS = 1 << 17
#: On an accelerator each op is a kernel launch: larger chunks, still bounded scratch.
DEVICE_CHUNK_ELEMENTS = 1 << 24


def count_overlaps(
    base: torch.Tensor,
    finetunes: Sequence[torch.Tensor],
    epsilon: float,
    *,
    workers: int,
    chunk_elements: int = CHUNK_ELEMENTS,
) -> OverlapCounts:
    """The overlap histograms of one tensor group, without merging (the statistics pre-pass).

    The masks are the merge's: ``m_t = |theta_t - theta_pre| > epsilon`` in ``compute_dtype``
    of the inputs. The work runs over ``chunk_elements`` elements at a time on ``workers``
    threads (the caller's choice, e.g. its own torch thread count).
    """
    _check_group(base, finetunes, workers)
    _check_countable(len(finetunes))
    detached = [finetune.detach() for finetune in finetunes]

    def work(scratch: _CountScratch, chunk: slice, base_chunk: torch.Tensor, chunks: list[torch.Tensor]) -> None:
        scratch.run(base_chunk, chunks, epsilon)

    scratches = _for_each_chunk(base.detach(), detached, chunk_elements, workers, _CountScratch, work)
    return OverlapCounts(histograms=_histograms([scratch.pattern for scratch in scratches]))


def merge_tensors(
    base: torch.Tensor,
    finetunes: Sequence[torch.Tensor],
    epsilon: float,
    lambdas: Optional[Sequence[float]] = None,
    *,
    workers: int,
    count: bool = False,
    out_dtype: Optional[torch.dtype] = None,
    chunk_elements: int = CHUNK_ELEMENTS,
    shared: SharedRule = "mean",
    density: float = 1.0,
) -> MergeResult:
    """Merge one tensor group; with ``count``, its histograms in the same pass.

    ``lambdas`` scales each model's unique updates (None or all ones: none; ram_unique's
    scales). ``shared`` is the shared region's rule (``SharedRule``: "mean" for ram and
    ram_plus, "ties" for ram_ties with the share ``density`` in (0, 1] of each model's shared
    updates kept, "base" for ram_unique). Arithmetic is in ``compute_dtype`` of the inputs; the
    result is written once, in ``out_dtype`` (default: the base's dtype). The work runs over
    ``chunk_elements`` elements at a time on ``workers`` threads (the caller's choice, e.g. its
    own torch thread count). Inputs that require grad give a result with autograd history (see
    ``_RamFunction``).
    """
    n = len(finetunes)
    if lambdas is not None and len(lambdas) != n:
        raise ValueError(f"expected {n} lambda values, got {len(lambdas)}")
    if shared not in get_args(SharedRule):
        raise ValueError(f"shared must be one of {', '.join(get_args(SharedRule))}, got {shared!r}")
    if not 0.0 < density <= 1.0:
        raise ValueError(f"density must be in (0, 1], got {density}")
    _check_group(base, finetunes, workers)
    if count:
        _check_countable(n)
    detached = [finetune.detach() for finetune in finetunes]
    plan = _MergePlan(
        epsilon=epsilon,
        lambdas=_unique_scale(lambdas, compute_dtype(base.dtype, *(finetune.dtype for finetune in finetunes))),
        shared=shared,
        kept_from=_kept_from(base.detach(), detached, epsilon, density, chunk_elements, workers)
        if shared == "ties"
        else (),
        count=count,
        out_dtype=out_dtype,
        chunk_elements=chunk_elements,
        workers=workers,
    )
    inputs = (base, *finetunes)
    if torch.is_grad_enabled() and any(tensor.requires_grad for tensor in inputs):
        histograms: list[Optional[Histograms]] = []
        merged = _RamFunction.apply(plan, histograms, *inputs)
        return MergeResult(merged=merged, histograms=histograms[0])
    return _merge(plan, base.detach(), detached)


def _check_group(base: torch.Tensor, finetunes: Sequence[torch.Tensor], workers: int) -> None:
    """Every fine-tune has the base's shape; at least one worker."""
    for finetune in finetunes:
        if finetune.shape != base.shape:
            raise ValueError(f"shape {tuple(finetune.shape)} differs from the base's {tuple(base.shape)}")
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")


def _check_countable(n: int) -> None:
    """The activity pattern has one bit per model in an int64."""
    if n > _PATTERN_MAX_MODELS:
        raise ValueError(f"overlap statistics support at most {_PATTERN_MAX_MODELS} fine-tuned models, got {n}")


def _unique_scale(lambdas: Optional[Sequence[float]], dtype: torch.dtype) -> Optional[tuple[float, ...]]:
    """The lambdas to apply to unique updates; None for none (no lambdas, or all ones)."""
    if lambdas is None or all(lam == 1.0 for lam in lambdas):
        return None
    for index, lam in enumerate(lambdas):
        if not abs(lam) <= torch.finfo(dtype).max:  # would scale every update to inf (and 0 * inf = NaN)
            raise MergeOverflowError("lambda", index, dtype)
    return tuple(lambdas)


@dataclass(frozen=True)
class _MergePlan:
    """What one merge computes; shared by the forward pass and the gradient."""

    epsilon: float
    lambdas: Optional[tuple[float, ...]]  # None: unique updates unscaled
    shared: SharedRule
    kept_from: tuple[float, ...]  # "ties": per model, the smallest kept magnitude at shared positions (> epsilon)
    count: bool
    out_dtype: Optional[torch.dtype]
    chunk_elements: int
    workers: int


def _merge(plan: _MergePlan, base: torch.Tensor, finetunes: Sequence[torch.Tensor]) -> MergeResult:
    """The chunked merge on inputs without autograd history."""
    merged = torch.empty(base.numel(), dtype=plan.out_dtype or base.dtype, device=base.device)

    def work(scratch: _MergeScratch, chunk: slice, base_chunk: torch.Tensor, chunks: list[torch.Tensor]) -> None:
        scratch.run(base_chunk, chunks, merged[chunk])

    scratch = functools.partial(_MergeScratch, plan=plan)
    scratches = _for_each_chunk(base, finetunes, plan.chunk_elements, plan.workers, scratch, work)
    patterns = [scratch.pattern for scratch in scratches if scratch.pattern is not None]
    return MergeResult(merged=merged.view(base.shape), histograms=_histograms(patterns) if plan.count else None)


class _RamFunction(torch.autograd.Function):
    """The merge as an autograd function: values from the kernel itself, bit for bit.

    The masks, the kept entries and the elected signs are step functions of the inputs
    (derivative 0 almost everywhere), so with w_t the coefficient of tau_t in tau_merged
    (lambda_t where only model t changed an element; 1 / n where it is one of the n averaged
    entries: the c active ones for "mean", the kept ones of the elected sign for "ties"; else 0):
        d merged / d theta_t   = w_t
        d merged / d theta_pre = 1 - sum_t w_t
    computed chunk by chunk by the merge's own rule (``_MergeScratch.gradient``).
    """

    @staticmethod
    def forward(
        ctx: Any, plan: _MergePlan, histograms: list, base: torch.Tensor, *finetunes: torch.Tensor
    ) -> torch.Tensor:
        result = _merge(plan, base.detach(), [finetune.detach() for finetune in finetunes])
        histograms.append(result.histograms)
        ctx.plan = plan
        ctx.save_for_backward(base, *finetunes)
        return result.merged

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        inputs = [tensor.detach() for tensor in ctx.saved_tensors]
        grads = [
            torch.empty(tensor.numel(), dtype=tensor.dtype, device=tensor.device) if needed else None
            for tensor, needed in zip(inputs, ctx.needs_input_grad[2:])
        ]
        flat_grad = grad.reshape(-1)

        def work(scratch: _MergeScratch, chunk: slice, base_chunk: torch.Tensor, chunks: list[torch.Tensor]) -> None:
            scratch.gradient(
                base_chunk, chunks, flat_grad[chunk], [out if out is None else out[chunk] for out in grads]
            )

        scratch = functools.partial(_MergeScratch, plan=dataclasses.replace(ctx.plan, count=False))
        _for_each_chunk(inputs[0], inputs[1:], ctx.plan.chunk_elements, ctx.plan.workers, scratch, work)
        return None, None, *(out if out is None else out.view(inputs[0].shape) for out in grads)


Scratch = TypeVar("Scratch")


def _for_each_chunk(
    base: torch.Tensor,
    finetunes: Sequence[torch.Tensor],
    chunk_elements: int,
    workers: int,
    make_scratch: Callable[[int, int, torch.Tensor, torch.dtype], Scratch],
    work: Callable[[Scratch, slice, torch.Tensor, list[torch.Tensor]], None],
) -> list[Scratch]:
    """Cut the flattened group into chunks and ``work`` on each; the workers' scratches.

    ``make_scratch(size, n, base, dtype)`` gives one worker its buffers of ``size`` elements for
    n fine-tunes in the arithmetic dtype; ``work(scratch, chunk, base_chunk, finetune_chunks)``
    handles the elements ``chunk`` of the flat tensors.
    """
    dtype = compute_dtype(base.dtype, *(finetune.dtype for finetune in finetunes))
    flat_base = base.reshape(-1)
    flat_finetunes = [finetune.reshape(-1) for finetune in finetunes]
    numel = flat_base.numel()
    if base.device.type != "cpu":
        chunk_elements = max(chunk_elements, DEVICE_CHUNK_ELEMENTS)
        workers = 0  # the calling thread: on an accelerator every op is a launch
    size = min(chunk_elements, max(numel, 1))

    def run(start: int, scratch: Scratch) -> None:
        chunk = slice(start, min(start + chunk_elements, numel))
        work(scratch, chunk, flat_base[chunk], [finetune[chunk] for finetune in flat_finetunes])

    def scratch() -> Scratch:
        return make_scratch(size, len(finetunes), base, dtype)

    return _map_chunks(run, scratch, range(0, numel, chunk_elements), workers)


def _omp_set_num_threads() -> Optional[Callable[[int], None]]:
    """OpenMP's setter for the calling thread's team size, or None where torch does not use OpenMP."""
    try:
        setter = ctypes.CDLL(None).omp_set_num_threads
    except (OSError, AttributeError, TypeError):
        return None
    setter.argtypes = [ctypes.c_int]
    return setter


@contextlib.contextmanager
def _one_intra_op_thread() -> Iterator[None]:
    """This thread runs its ops on one thread meanwhile; no other thread's setting changes.

    torch.set_num_threads also stores the default for threads that start later (one value
    for the process), so where torch uses OpenMP only this thread's OpenMP count is set.
    """
    saved = torch.get_num_threads()  # torch initialises this thread's count first
    set_threads = _omp_set_num_threads()
    if set_threads is None:
        torch.set_num_threads(1)
    else:
        set_threads(1)
    try:
        yield
    finally:
        if set_threads is None:
            torch.set_num_threads(saved)
        else:
            set_threads(saved)


def _map_chunks(
    run: Callable[[int, Scratch], None], make_state: Callable[[], Scratch], starts: Sequence[int], workers: int
) -> list[Scratch]:
    """Run every chunk, each worker thread with its own scratch; the per-worker states.

    Each chunk is a few dozen small elementwise ops. Under torch's intra-op parallelism every
    op is a fork and a join; on a busy machine a descheduled thread stalls each of them
    (measured 3-6x slower than one thread). So whole chunks go to ``workers`` threads, each
    running torch on one thread: the calling thread and ``workers - 1`` threads started for
    this call (a thread's start and first ops cost about a millisecond, paid per call: the
    caller takes part so that half as many start). ``workers`` 1 runs the chunks in the
    calling thread on one intra-op thread; 0 runs them there as it is (accelerators: every
    op is a launch there).
    """
    if workers == 0:
        state = make_state()
        for start in starts:
            run(start, state)
        return [state]
    workers = min(workers, len(starts))
    pending = iter(starts)
    taking = threading.Lock()
    failed = threading.Event()
    states: list[Scratch] = []

    def drain() -> None:
        """Take chunks until none are left (or another worker failed), on one intra-op thread."""
        with _one_intra_op_thread():
            state = make_state()
            states.append(state)
            while not failed.is_set():
                with taking:
                    start = next(pending, None)
                if start is None:
                    return
                try:
                    run(start, state)
                except BaseException:
                    failed.set()
                    raise

    if workers <= 1:
        drain()
        return states
    pool = concurrent.futures.ThreadPoolExecutor(workers - 1, thread_name_prefix="mergekit-ram")
    try:
        futures = [pool.submit(drain) for _ in range(workers - 1)]
        drain()
        for future in futures:
            future.result()
    finally:
        failed.set()
        pool.shutdown(wait=True, cancel_futures=True)  # no chunk may still write once this returns or raises
    return states


# Scratch buffers are in the arithmetic dtype (float32, or float64 for float64 inputs). Masks,
# counts and patterns are 0/1 and small integers in it (exact below 2**24): this torch's CPU
# kernels for bool outputs and bool operands are several times slower than the float32 ones
# (measured per 2**17-element chunk: ``gt`` 57 vs 16 us, masking ``mul`` 94 vs 17 us, ``where``
# 290 us vs ``lerp`` 23 us).


class _ArithmeticBase:
    """The base of a chunk in the arithmetic dtype: the input itself, or a copy in a buffer."""

    def __init__(self, size: int, like: torch.Tensor, dtype: torch.dtype) -> None:
        self.buffer = None if like.dtype == dtype else torch.empty(size, dtype=dtype, device=like.device)

    def load(self, base: torch.Tensor) -> torch.Tensor:
        """``base`` (one chunk) in the arithmetic dtype."""
        if self.buffer is None:
            return base
        converted = self.buffer[: base.numel()]
        converted.copy_(base)
        return converted


class _ActivityPattern:
    """Per element, bit t set when model t is active; tallied chunk by chunk.

    The bits add up in float32 (24 bits exactly, and float adds are fast) up to 24 models, in
    int64 beyond; the tally needs integers, so float32 bits are copied into ``codes`` (int16 up
    to 15 models, int32 beyond) first.
    """

    def __init__(self, size: int, n: int, device: torch.device) -> None:
        narrow = n <= _FLOAT_PATTERN_MAX_MODELS
        self.bits = torch.empty(size, dtype=torch.float32 if narrow else torch.int64, device=device)
        code_dtype = torch.int16 if n <= _INT16_MAX_MODELS else torch.int32
        self.codes = torch.empty(size, dtype=code_dtype, device=device) if narrow else None
        self.tally = _PatternCounts(n, device)

    @staticmethod
    def mark(bits: torch.Tensor, index: int, active: torch.Tensor) -> None:
        """Set bit ``index`` where ``active`` (0.0 / 1.0) is 1; model 0 starts the chunk's pattern."""
        if index == 0:
            bits.copy_(active)
        elif bits.dtype == torch.int64:
            bits.add_(active.to(torch.int64), alpha=1 << index)
        else:
            bits.add_(active, alpha=1 << index)

    def tally_chunk(self, bits: torch.Tensor) -> None:
        """Count the chunk's patterns (no models: nothing to count)."""
        if self.tally.n == 0:
            return
        if self.codes is None:
            self.tally.add(bits)
            return
        codes = self.codes[: bits.numel()]
        codes.copy_(bits)
        self.tally.add(codes)


def _histograms(patterns: Sequence[_ActivityPattern]) -> Histograms:
    """The per-model histograms of every worker's tally together."""
    return _PatternCounts.combined([pattern.tally for pattern in patterns]).histograms()


def _update_and_mask(
    finetune: torch.Tensor,
    base: torch.Tensor,
    epsilon: float,
    tau: torch.Tensor,
    active: torch.Tensor,
    inputs: Optional[tuple[torch.Tensor, Sequence[torch.Tensor]]] = None,
    update_of: Optional[int] = None,
) -> None:
    """tau_t = theta_t - theta_pre into ``tau``, m_t = |tau_t| > epsilon (0.0 / 1.0) into ``active``.

    ``tau`` may be ``active`` when only the mask is wanted. With ``inputs`` (the chunk's base and
    fine-tunes), a NaN or Inf input is named first; then, with ``update_of`` (this fine-tune's
    index), an update that overflowed from finite inputs is a ``MergeOverflowError`` (a rule
    whose every non-finite update reaches the result: found before it breaks anything else).
    """
    torch.sub(finetune, base, out=tau)
    torch.abs(tau, out=active)
    if inputs is not None and not math.isfinite(active.sum().item()):
        _check_finite(*inputs)
        if update_of is not None and not bool(torch.isfinite(active).all()):
            raise MergeOverflowError("update", update_of, active.dtype)
    torch.gt(active, epsilon, out=active)  # NaN compares false: masked to NaN * 0 by the sums


class _CountScratch:
    """One counting worker's buffers, reused across chunks: the base, |tau_t| then m_t, the pattern."""

    def __init__(self, size: int, n: int, like: torch.Tensor, dtype: torch.dtype) -> None:
        self.base = _ArithmeticBase(size, like, dtype)
        self.active = torch.empty(size, dtype=dtype, device=like.device)
        self.pattern = _ActivityPattern(size, n, like.device)

    def run(self, base: torch.Tensor, finetunes: Sequence[torch.Tensor], epsilon: float) -> None:
        """Tally one chunk's activity patterns; a NaN or Inf input is named."""
        base_c = self.base.load(base)
        active = self.active[: base.numel()]
        bits = self.pattern.bits[: base.numel()]  # sliced once per chunk, not per model
        for index, finetune in enumerate(finetunes):
            _update_and_mask(finetune, base_c, epsilon, active, active, (base, finetunes))
            _ActivityPattern.mark(bits, index, active)
        self.pattern.tally_chunk(bits)


def _add(
    target: torch.Tensor, first: bool, value: torch.Tensor, mask: Optional[torch.Tensor] = None, scale: float = 1.0
) -> None:
    """target = scale * value * mask for the first model, target += scale * value * mask after it."""
    if first:
        if mask is None:
            target.copy_(value)
        else:
            torch.mul(value, mask, out=target)
        if scale != 1.0:
            target.mul_(scale)
    elif mask is None:
        target.add_(value)
    else:
        target.addcmul_(value, mask, value=scale)


@dataclass(frozen=True)
class _RuleSums:
    """One chunk's sums over the models of masked values v_t (the updates, or the gradient), which the rule combines.

    ``count`` c = sum_t m_t; ``unique`` sum_t lambda_t m_t v_t (the scaled update where c == 1);
    ``total`` sum_t m_t v_t ("mean"; ``unique`` itself without lambdas); ``kept`` ("ties") the
    sums of v_t and the counts over the kept entries of each sign.
    """

    plan: _MergePlan
    count: torch.Tensor
    unique: torch.Tensor
    total: torch.Tensor
    kept: Optional[_KeptSums]

    @classmethod
    def allocate(cls, size: int, plan: _MergePlan, dtype: torch.dtype, device: torch.device) -> _RuleSums:
        def buffer() -> torch.Tensor:
            return torch.empty(size, dtype=dtype, device=device)

        unique = buffer()
        kept = _KeptSums(buffer(), buffer(), buffer(), buffer()) if plan.shared == "ties" else None
        return cls(plan, buffer(), unique, buffer() if plan.shared == "mean" and plan.lambdas else unique, kept)

    def prefix(self, length: int) -> _RuleSums:
        """The sums of a chunk of ``length`` elements (views; itself for a whole one)."""
        if length == self.count.numel():
            return self
        unique = self.unique[:length]
        total = unique if self.total is self.unique else self.total[:length]
        kept = _KeptSums(*(buffer[:length] for buffer in self.kept)) if self.kept is not None else None
        return _RuleSums(self.plan, self.count[:length], unique, total, kept)

    def add(
        self, first: bool, index: int, tau: torch.Tensor, active: torch.Tensor, value: torch.Tensor, counting: bool
    ) -> None:
        """Model ``index`` (update ``tau``, mask m_t in ``active``, which this overwrites) adds ``value``.

        The first model initialises every sum; ``counting`` adds to the counts too. NaN * 0 is
        NaN: masking keeps a non-finite value visible in the sums.
        """
        plan = self.plan
        if counting:
            _add(self.count, first, active)
        if self.total is not self.unique:
            _add(self.total, first, value, active)
        _add(self.unique, first, value, active, plan.lambdas[index] if plan.lambdas else 1.0)
        if self.kept is not None:
            kept_from = plan.kept_from[index]  # > epsilon and > 0: kept entries are active and signed
            torch.ge(tau, kept_from, out=active)
            self._add_kept(first, value, active, self.kept.positive, self.kept.positive_count, counting)
            torch.le(tau, -kept_from, out=active)
            self._add_kept(first, value, active, self.kept.negative, self.kept.negative_count, counting)

    @staticmethod
    def _add_kept(
        first: bool, value: torch.Tensor, kept: torch.Tensor, sums: torch.Tensor, counts: torch.Tensor, counting: bool
    ) -> None:
        """The kept entries of one sign: their values to ``sums``, and (``counting``) one each to ``counts``."""
        _add(sums, first, value, kept)
        if counting:
            _add(counts, first, kept)

    def elect(self, out: torch.Tensor) -> Optional[torch.Tensor]:
        """For "ties": (sum of kept positive) - (sum of kept negative magnitudes) into ``out``; its sign is elected."""
        return None if self.kept is None else torch.add(self.kept.positive, self.kept.negative, out=out)

    def combine(
        self,
        elected: Optional[torch.Tensor],
        weight: torch.Tensor,
        counts: Optional[_RuleSums] = None,
        inputs: Optional[tuple[torch.Tensor, Sequence[torch.Tensor]]] = None,
    ) -> torch.Tensor:
        """tau_merged of these sums: the unique update where c == 1, the shared rule where c >= 2, 0 where c == 0.

        With one model's sums and another's ``counts`` (and ``elected``), the model's
        coefficient times its value. Overwrites the sums; ``weight`` is a free buffer. With
        ``inputs``, a NaN or Inf input is named when the unique sums are not finite.
        """
        counts = counts or self
        count = counts.count.clamp_(min=1)  # c == 0 leaves every sum at 0 below
        shared: Optional[torch.Tensor] = None
        if self.plan.shared == "mean":
            shared = self.total.div_(count)
            if self.total is self.unique:  # c == 1 divides the unique update by one
                return shared
        elif self.kept is not None and counts.kept is not None and elected is not None:
            shared = self.kept.elected_mean(counts.kept, elected, weight)
        torch.eq(count, 1, out=weight)
        return _take_unique(shared, self.unique, weight, inputs)


class _KeptSums(NamedTuple):
    """For "ties": per sign, the sum of v_t over the kept entries, and their count.

    An entry is kept where the model is active and its magnitude is at least the model's threshold.
    """

    positive: torch.Tensor
    negative: torch.Tensor
    positive_count: torch.Tensor
    negative_count: torch.Tensor

    def elected_mean(self, counts: _KeptSums, elected: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The mean of the kept positive entries where ``elected`` > 0, of the negative ones where < 0, else 0.

        Weights of exactly 0 and 1 select exactly; an overflowed sum makes NaN (an error).
        """
        positive = self.positive.div_(counts.positive_count.clamp_(min=1))
        negative = self.negative.div_(counts.negative_count.clamp_(min=1))
        positive.mul_(torch.gt(elected, 0, out=weight))
        return positive.addcmul_(negative, torch.lt(elected, 0, out=weight))


def _take_unique(
    shared: Optional[torch.Tensor],
    unique: torch.Tensor,
    weight: torch.Tensor,
    inputs: Optional[tuple[torch.Tensor, Sequence[torch.Tensor]]],
) -> torch.Tensor:
    """``unique`` where ``weight`` is 1, ``shared`` (None: 0) where it is 0.

    Blended as shared - shared * w + unique * w: exact for weights 0 and 1, and never inf - inf
    from finite operands. Unique sums that are not finite (an overflow where c >= 2, or a NaN or
    Inf input, named when ``inputs`` are given) are selected instead.
    """
    if math.isfinite(unique.sum().item()):
        if shared is None:
            return unique.mul_(weight)
        return shared.addcmul_(shared, weight, value=-1.0).addcmul_(unique, weight)
    if inputs is not None:
        _check_finite(*inputs)
    chosen = weight.bool()
    if shared is None:
        return unique.masked_fill_(~chosen, 0.0)
    return torch.where(chosen, unique, shared, out=shared)


class _MergeScratch:
    """One merging worker's buffers, reused across chunks: ``run`` merges a chunk, ``gradient`` differentiates one.

    ``tau`` holds each model's update (then the elected sign's sum), ``active`` its mask (then a
    weight), ``sums`` what the rule combines; ``pattern`` only when counting. The gradient and the
    overflow diagnosis put other values through the same rule (``_rule_of_values``).
    """

    def __init__(self, size: int, n: int, like: torch.Tensor, dtype: torch.dtype, plan: _MergePlan) -> None:
        device = like.device
        self.plan, self.dtype = plan, dtype
        self.base = _ArithmeticBase(size, like, dtype)
        self.tau, self.active = (torch.empty(size, dtype=dtype, device=device) for _ in range(2))
        self.sums = _RuleSums.allocate(size, plan, dtype, device)
        self.pattern = _ActivityPattern(size, n, device) if plan.count else None

    def run(self, base: torch.Tensor, finetunes: Sequence[torch.Tensor], out: torch.Tensor) -> None:
        """theta_pre + tau_merged of one chunk into ``out``; its patterns tallied if counting."""
        length = base.numel()
        base_c = self.base.load(base)
        bits = self.pattern.bits[:length] if self.pattern is not None else None
        sums, elected = self._sums_of_updates(base_c, finetunes, self.tau[:length], bits)
        active = self.active[:length]
        update = sums.combine(elected, active, inputs=(base, finetunes)) if finetunes else active.zero_()
        result = self._write(update, base_c, out)
        if not math.isfinite(out.sum(dtype=self.dtype).item()):
            self._diagnose(base, finetunes, out, result)
        if self.pattern is not None and bits is not None:
            self.pattern.tally_chunk(bits)

    def _write(self, update: torch.Tensor, base_c: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out = theta_pre + tau_merged, rounded once to the output dtype; the result in the arithmetic dtype."""
        if out.dtype == self.dtype:
            return torch.add(update, base_c, out=out)
        out.copy_(update.add_(base_c))
        return update

    def _sums_of_updates(
        self,
        base_c: torch.Tensor,
        finetunes: Sequence[torch.Tensor],
        elected: torch.Tensor,
        bits: Optional[torch.Tensor] = None,
    ) -> tuple[_RuleSums, Optional[torch.Tensor]]:
        """The sums of the models' updates with their counts, and the elected signs into ``elected``.

        ``elected`` may be ``self.tau``, which holds each update meanwhile; the patterns go to
        ``bits`` if counting.
        """
        length = base_c.numel()
        tau, active, sums = self.tau[:length], self.active[:length], self.sums.prefix(length)
        for index, finetune in enumerate(finetunes):
            _update_and_mask(finetune, base_c, self.plan.epsilon, tau, active)
            if bits is not None:
                _ActivityPattern.mark(bits, index, active)
            sums.add(index == 0, index, tau, active, tau, counting=True)
        return sums, sums.elect(elected)

    def _rule_of_values(
        self,
        base_c: torch.Tensor,
        finetunes: Sequence[torch.Tensor],
        models: Sequence[int],
        value: Optional[torch.Tensor],
        counts: _RuleSums,
        elected: Optional[torch.Tensor],
    ) -> torch.Tensor:
        """sum over ``models`` of w_t * ``value`` (None: each one's update): the rule applied to their masked values.

        The counts and the elected signs are the updates' (``_sums_of_updates``); one model's
        ``value`` gives its coefficient w_t times it, ``d merged / d theta_t``.
        """
        length = base_c.numel()
        tau, active = self.tau[:length], self.active[:length]
        values = _RuleSums.allocate(length, self.plan, self.dtype, base_c.device)
        for position, index in enumerate(models):
            _update_and_mask(finetunes[index], base_c, self.plan.epsilon, tau, active)
            values.add(position == 0, index, tau, active, tau if value is None else value, counting=False)
        return values.combine(elected, active, counts=counts)

    def gradient(
        self,
        base: torch.Tensor,
        finetunes: Sequence[torch.Tensor],
        grad: torch.Tensor,
        outs: Sequence[Optional[torch.Tensor]],
    ) -> None:
        """d merged / d input times ``grad`` for one chunk into ``outs`` (the base's first; None: not wanted).

        w_t * g for model t; (1 - sum_t w_t) * g for the base, sum_t w_t being the rule applied
        to masked ones (exactly 1 where entries are averaged).
        """
        base_out, *finetune_outs = outs
        if not finetunes:
            if base_out is not None:
                base_out.copy_(grad)
            return
        base_c = self.base.load(base)
        g = grad.to(self.dtype)
        counts, elected = self._sums_of_updates(base_c, finetunes, torch.empty_like(base_c))
        for index, out in enumerate(finetune_outs):
            if out is not None:
                out.copy_(self._rule_of_values(base_c, finetunes, [index], g, counts, elected))
        if base_out is not None:
            models = range(len(finetunes))
            weights = self._rule_of_values(base_c, finetunes, models, torch.ones_like(g), counts, elected)
            base_out.copy_(weights.neg_().add_(1.0).mul_(g))

    def _diagnose(
        self, base: torch.Tensor, finetunes: Sequence[torch.Tensor], out: torch.Tensor, result: torch.Tensor
    ) -> None:
        """A chunk whose output sums to NaN or Inf: raise for the input or the overflow that made it.

        A NaN or Inf input is named; a finite output whose sum overflowed is no error; a result
        finite in the arithmetic dtype did not fit the output dtype. Else, where the result
        overflowed: the first model whose update itself overflowed (finite inputs, the difference
        not), or the first whose lambda makes the base plus its scaled update overflow (its update
        fits, and with a lambda of 1 that sum is the model's own value), or else the merged update.
        """
        _check_finite(base, finetunes)
        if bool(torch.isfinite(out).all()):
            return
        if result is not out and bool(torch.isfinite(result).all()):
            raise MergeOverflowError("cast", None, out.dtype)
        overflowed = ~torch.isfinite(result)  # taken before the diagnosis reuses the buffer ``result`` may be
        base_c = self.base.load(base)
        for index, finetune in enumerate(finetunes):
            if not bool(torch.isfinite(torch.sub(finetune, base_c)[overflowed]).all()):
                raise MergeOverflowError("update", index, self.dtype)
        if self.plan.lambdas:
            counts, elected = self._sums_of_updates(base_c, finetunes, torch.empty_like(base_c))
            for index in range(len(finetunes)):
                alone = self._rule_of_values(base_c, finetunes, [index], None, counts, elected)
                if not bool(torch.isfinite(alone.add_(base_c)).all()):
                    raise MergeOverflowError("lambda", index, self.dtype)
        raise MergeOverflowError("sum", None, self.dtype)


def _kept_from(
    base: torch.Tensor,
    finetunes: Sequence[torch.Tensor],
    epsilon: float,
    density: float,
    chunk_elements: int,
    workers: int,
) -> tuple[float, ...]:
    """For "ties": per model, the smallest magnitude of its kept entries at the shared positions (c >= 2).

    The k-th smallest of |tau_t| m_t over the P shared positions, k = floor(P * (1 - density)) (0
    when k == 0), exactly: non-negative floats order as their bit patterns, so a radix select
    finds its bits 16 at a time, one pass over the chunks per digit (``_RadixScratch``); then
    raised above epsilon (and 0), so that the kept entries are active ones.
    """
    n = len(finetunes)
    dtype = compute_dtype(base.dtype, *(finetune.dtype for finetune in finetunes))
    width = torch.finfo(dtype).bits
    prefixes, ranks = [0] * n, [0] * n
    for shift in range(width - _DIGIT_BITS, -1, -_DIGIT_BITS) if density < 1.0 and n else ():
        tables, shared = _radix_pass(base, finetunes, epsilon, chunk_elements, workers, shift, prefixes)
        if shift == width - _DIGIT_BITS:
            ranks = [math.floor(shared * (1.0 - density))] * n
            if ranks[0] == 0:  # P == 0 or k == 0: nothing trimmed
                break
        for index in range(n):
            if prefixes[index] == 0:  # the unshared positions are zeros there: not entries
                tables[index, 0] -= base.numel() - shared
            prefixes[index], ranks[index] = _select_digit(tables[index], prefixes[index], ranks[index])
        del tables  # freed before the next pass allocates its own
    bits_dtype = torch.int32 if width == 32 else torch.int64
    above = torch.nextafter(torch.tensor(max(epsilon, 0.0), dtype=dtype), torch.tensor(math.inf, dtype=dtype)).item()
    return tuple(max(torch.tensor(bits, dtype=bits_dtype).view(dtype).item(), above) for bits in prefixes)


def _radix_pass(
    base: torch.Tensor,
    finetunes: Sequence[torch.Tensor],
    epsilon: float,
    chunk_elements: int,
    workers: int,
    shift: int,
    prefixes: list[int],
) -> tuple[torch.Tensor, int]:
    """One pass over the chunks (``_RadixScratch``): every worker's digit tables summed, and P."""
    count_digits = functools.partial(_RadixScratch.run_chunk, epsilon=epsilon, shift=shift, prefixes=prefixes)
    scratches = _for_each_chunk(base, finetunes, chunk_elements, workers, _RadixScratch, count_digits)
    tables = scratches[0].tables
    for scratch in scratches[1:]:
        tables += scratch.tables
    return tables, sum(scratch.shared for scratch in scratches)


def _select_digit(table: torch.Tensor, prefix: int, rank: int) -> tuple[int, int]:
    """The prefix grown by the digit of the ``rank``-th smallest entry (1-based), and its rank within the digit."""
    below = table.cumsum(0)
    digit = int(torch.searchsorted(below, rank))
    return prefix << _DIGIT_BITS | digit, rank - (int(below[digit - 1]) if digit else 0)


class _RadixScratch:
    """One worker's buffers for one radix-select pass: per model, a histogram of one 16-bit digit.

    The entries are |tau_t| at the shared positions, inactive ones included: they are at most
    epsilon, below every active entry, so the k-th smallest is the same as with zeros for them
    wherever it exceeds epsilon, and at most epsilon where zeros would give 0 (``_kept_from``
    raises it above epsilon either way). A digit is counted where the higher bits equal the
    model's prefix so far. Unshared positions read as 0 (``_kept_from`` takes them off);
    ``shared`` counts the shared positions.
    """

    def __init__(self, size: int, n: int, like: torch.Tensor, dtype: torch.dtype) -> None:
        device = like.device
        self.first_shift = torch.finfo(dtype).bits - _DIGIT_BITS
        self.base = _ArithmeticBase(size, like, dtype)
        self.tau, self.mask = (torch.empty(size, dtype=dtype, device=device) for _ in range(2))
        self.keys = torch.empty(size, dtype=torch.int32 if dtype == torch.float32 else torch.int64, device=device)
        self.tables = torch.zeros((n, 1 << _DIGIT_BITS), dtype=torch.int64, device=device)
        self.shared = 0

    def run_chunk(
        self,
        chunk: slice,
        base: torch.Tensor,
        finetunes: Sequence[torch.Tensor],
        *,
        epsilon: float,
        shift: int,
        prefixes: list[int],
    ) -> None:
        """Count one chunk's digits ``(bits >> shift) & 0xFFFF`` of the entries under each model's prefix."""
        length = base.numel()
        base_c = self.base.load(base)
        tau, shared, keys = self.tau[:length], self.mask[:length], self.keys[:length]
        first = shift == self.first_shift
        for index, finetune in enumerate(finetunes):
            # an overflowed update would read as a NaN key (inf * 0 at unshared positions): refused first
            _update_and_mask(finetune, base_c, epsilon, tau, tau, (base, finetunes) if first else None, index)
            _add(shared, index == 0, tau)
        torch.ge(shared, 2, out=shared)  # c >= 2
        self.shared += int(shared.sum().item())
        for index, finetune in enumerate(finetunes):
            torch.sub(finetune, base_c, out=tau)
            torch.bitwise_right_shift(tau.abs_().mul_(shared).view(keys.dtype), shift, out=keys)
            if first:  # every entry's top digit
                self.tables[index] += torch.bincount(keys, minlength=1 << _DIGIT_BITS)
                continue
            # the digit + 1 under the prefix; 0 below it, 2**16 + 1 above
            keys.sub_((prefixes[index] << _DIGIT_BITS) - 1).clamp_(0, (1 << _DIGIT_BITS) + 1)
            self.tables[index] += torch.bincount(keys, minlength=(1 << _DIGIT_BITS) + 2)[1:-1]


class _PatternCounts:
    """How many elements have each activity pattern (bit t: model t changed it)."""

    def __init__(self, n: int, device: torch.device) -> None:
        self.n = n
        self.dense = torch.zeros(1 << n, dtype=torch.int64, device=device) if n <= _BINCOUNT_MAX_MODELS else None
        self.sparse: dict[int, int] = {}

    def add(self, pattern: torch.Tensor) -> None:
        """Count one chunk's integer patterns."""
        if self.dense is not None:
            self.dense += torch.bincount(pattern, minlength=1 << self.n)
        else:
            codes, frequencies = torch.unique(pattern, return_counts=True)
            for code, frequency in zip(codes.tolist(), frequencies.tolist()):
                self.sparse[code] = self.sparse.get(code, 0) + frequency

    @classmethod
    def combined(cls, parts: Sequence[_PatternCounts]) -> _PatternCounts:
        """The sum of every part's counts (into the first part)."""
        total = parts[0]
        for part in parts[1:]:
            if total.dense is not None and part.dense is not None:
                total.dense += part.dense
            for code, frequency in part.sparse.items():
                total.sparse[code] = total.sparse.get(code, 0) + frequency
        return total

    def histograms(self) -> Histograms:
        """Per-model histograms by overlap count."""
        items = enumerate(self.dense.tolist()) if self.dense is not None else self.sparse.items()
        histograms = [[0] * self.n for _ in range(self.n)]
        for code, frequency in items:
            if not code or not frequency:
                continue
            overlap = code.bit_count()
            for index in range(self.n):
                if code >> index & 1:
                    histograms[index][overlap - 1] += frequency
        return tuple(tuple(row) for row in histograms)


def _check_finite(base: torch.Tensor, finetunes: Sequence[torch.Tensor]) -> None:
    """Name the input holding NaN or Inf; a finite sum that overflowed is not an error."""
    for index, tensor in [(None, base), *enumerate(finetunes)]:
        if not bool(torch.isfinite(tensor).all()):
            raise NonFiniteInputError(index, "NaN" if bool(torch.isnan(tensor).any()) else "Inf")
