"""RAM / RAM+ tensor math (paper section 4, Algorithm 1). Knows torch only.

For one tensor with base ``theta_pre`` and fine-tunes ``theta_t``, ``t = 1..N``:

    tau_t = theta_t - theta_pre
    m_t   = |tau_t| > epsilon                   (strict, in the arithmetic dtype)
    c     = sum_t m_t                           (how many models changed an element)
    tau_merged = 0                 where c == 0
               = lambda_t * tau_t  where c == 1 and m_t
               = mean of active tau where c >= 2
    theta_merged = theta_pre + tau_merged

Two entry points: ``count_overlaps`` gives the overlap histograms (``OverlapCounts``: per
model, how many of its changed elements k models changed; the statistics pre-pass), and
``merge_tensors`` the merged tensor (``MergeResult``), with the same histograms in the same
pass when asked (``count=True``). The caller says how many worker threads run the chunks.

Arithmetic is in float32, or float64 when an input is float64 (the wider of float32 and
the inputs' precision); the result is written once, from that precision, in the output dtype
(the base's unless asked). Finite inputs never give NaN or Inf: an overflow is an error
(``MergeOverflowError``). Inputs that require grad get a merged tensor with autograd history.
The work runs over chunks of CHUNK_ELEMENTS elements: scratch is at most 26 bytes per
element of one chunk (3.25 MiB per worker thread; 30 bytes when RAM+ lambdas and statistics are
taken in one pass, as with pinned statistics; 14 when only counting), independent of the
tensor's size and, up to 15 models, of N (beyond, the statistics' integer codes widen from 2
to 4 bytes; beyond 24 models the pattern is int64, with an int64 copy of each mask), plus a
table of 2**N counters per worker when counting; beyond it only the output is allocated.
With float64 arithmetic each float buffer is twice as wide.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import math
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Literal, Optional, Sequence, TypeVar

import torch

#: Histograms are gathered from a bit pattern per element (bit t set when model t is
#: active): float32 patterns up to 24 models (int64 beyond), counted as int16 up to 15
#: models, a bincount over 2**N bins up to 20.
_FLOAT_PATTERN_MAX_MODELS = 24
_INT16_MAX_MODELS = 15
_BINCOUNT_MAX_MODELS = 20
_PATTERN_MAX_MODELS = 62


class NonFiniteInputError(ValueError):
    """An input holds NaN or Inf; ``index`` is the fine-tune's position, or None for the base."""

    def __init__(self, index: Optional[int], value: Literal["NaN", "Inf"] = "NaN"):
        self.index = index
        self.value = value
        where = "base" if index is None else f"fine-tuned input {index}"
        super().__init__(f"{where} contains {value}")


class MergeOverflowError(ValueError):
    """Finite inputs whose merged result is not finite; the kernel never returns NaN or Inf.

    ``cause``: ``lambda`` (fine-tune ``index``'s lambda, or lambda times its update, does not
    fit ``dtype``), ``sum`` (the updates overflow the arithmetic dtype ``dtype``), or ``cast``
    (the result does not fit the output dtype ``dtype``).
    """

    def __init__(self, cause: Literal["lambda", "sum", "cast"], index: Optional[int], dtype: torch.dtype):
        self.cause, self.index, self.dtype = cause, index, dtype
        what = {
            "lambda": f"lambda of fine-tuned input {index} times its update",
            "sum": "the sum of the updates",
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


#: Elements per step: the scratch buffers (at most 30 bytes per element) stay in the CPU caches and
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
    base = base.detach()
    finetunes = [finetune.detach() for finetune in finetunes]
    dtype = compute_dtype(base.dtype, *(finetune.dtype for finetune in finetunes))

    def work(scratch: _CountScratch, chunk: slice, base_chunk: torch.Tensor, chunks: list[torch.Tensor]) -> None:
        scratch.run(base_chunk, chunks, epsilon)

    scratches = _for_each_chunk(
        base,
        finetunes,
        chunk_elements,
        workers,
        lambda size: _CountScratch(size, len(finetunes), base, dtype),
        work,
    )
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
) -> MergeResult:
    """Merge one tensor group with the RAM rule; with ``count``, its histograms in the same pass.

    ``lambdas`` scales each model's unique updates (None or all ones: plain RAM). Arithmetic
    is in ``compute_dtype`` of the inputs; the result is written once, in ``out_dtype``
    (default: the base's dtype). The work runs over ``chunk_elements`` elements at a time on
    ``workers`` threads (the caller's choice, e.g. its own torch thread count). Inputs that
    require grad give a result with autograd history (see ``_RamFunction``).
    """
    n = len(finetunes)
    if lambdas is not None and len(lambdas) != n:
        raise ValueError(f"expected {n} lambda values, got {len(lambdas)}")
    _check_group(base, finetunes, workers)
    if count:
        _check_countable(n)
    dtype = compute_dtype(base.dtype, *(finetune.dtype for finetune in finetunes))
    plan = _MergePlan(
        epsilon=epsilon,
        lambdas=_unique_scale(lambdas, dtype),
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
    return _merge(plan, base.detach(), [finetune.detach() for finetune in finetunes])


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
    """The lambdas to apply to unique updates; None for plain RAM (no lambdas, or all ones)."""
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
    lambdas: Optional[tuple[float, ...]]  # None: plain RAM
    count: bool
    out_dtype: Optional[torch.dtype]
    chunk_elements: int
    workers: int


def _merge(plan: _MergePlan, base: torch.Tensor, finetunes: Sequence[torch.Tensor]) -> MergeResult:
    """The chunked merge on inputs without autograd history."""
    dtype = compute_dtype(base.dtype, *(finetune.dtype for finetune in finetunes))
    merged = torch.empty(base.numel(), dtype=plan.out_dtype or base.dtype, device=base.device)

    def make_scratch(size: int) -> _MergeScratch:
        return _MergeScratch(size, len(finetunes), base, dtype, plan.lambdas, count=plan.count)

    def work(scratch: _MergeScratch, chunk: slice, base_chunk: torch.Tensor, chunks: list[torch.Tensor]) -> None:
        scratch.run(base_chunk, chunks, plan.epsilon, merged[chunk])

    scratches = _for_each_chunk(base, finetunes, plan.chunk_elements, plan.workers, make_scratch, work)
    patterns = [scratch.pattern for scratch in scratches if scratch.pattern is not None]
    return MergeResult(merged=merged.view(base.shape), histograms=_histograms(patterns) if plan.count else None)


class _RamFunction(torch.autograd.Function):
    """The merge as an autograd function: values from the kernel itself, bit for bit.

    The masks are step functions of the inputs (derivative 0 almost everywhere), so with
    w_t = m_t * (lambda_t where c == 1, 1 / c where c >= 2):
        d merged / d theta_t   = w_t
        d merged / d theta_pre = 1 - sum_t w_t
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
        base, *finetunes = ctx.saved_tensors
        plan: _MergePlan = ctx.plan
        dtype = compute_dtype(base.dtype, *(finetune.dtype for finetune in finetunes))
        grad = grad.to(dtype)
        base_c = base.detach().to(dtype)
        masks = [(finetune.detach().to(dtype) - base_c).abs() > plan.epsilon for finetune in finetunes]
        counts = torch.zeros_like(base_c)
        for mask in masks:
            counts += mask
        lambdas = plan.lambdas or (1.0,) * len(finetunes)
        shared = grad / counts.clamp(min=1)  # g / c
        unique = counts == 1
        base_weight = (counts == 0).to(dtype)
        grads: list[Optional[torch.Tensor]] = []
        for mask, lam, finetune in zip(masks, lambdas, finetunes):
            grads.append((torch.where(unique, grad * lam, shared) * mask).to(finetune.dtype))
            base_weight += torch.where(unique & mask, 1.0 - lam, 0.0)
        return None, None, (grad * base_weight).to(base.dtype), *grads


Scratch = TypeVar("Scratch")


def _for_each_chunk(
    base: torch.Tensor,
    finetunes: Sequence[torch.Tensor],
    chunk_elements: int,
    workers: int,
    make_scratch: Callable[[int], Scratch],
    work: Callable[[Scratch, slice, torch.Tensor, list[torch.Tensor]], None],
) -> list[Scratch]:
    """Cut the flattened group into chunks and ``work`` on each; the workers' scratches.

    ``make_scratch(size)`` gives one worker its buffers of ``size`` elements; ``work(scratch,
    chunk, base_chunk, finetune_chunks)`` handles the elements ``chunk`` of the flat tensors.
    """
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

    return _map_chunks(run, lambda: make_scratch(size), range(0, numel, chunk_elements), workers)


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

    def chunk(self, length: int) -> torch.Tensor:
        """The bits of a chunk of ``length`` elements, for ``mark`` and ``tally_chunk``.

        Taken once per chunk: a slice costs microseconds, a few percent of a chunk if per model.
        """
        return self.bits[:length]

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
        bits = self.pattern.chunk(base.numel())
        for index, finetune in enumerate(finetunes):
            torch.sub(finetune, base_c, out=active)
            active.abs_()
            if not math.isfinite(active.sum().item()):
                _check_finite(base, finetunes)
            torch.gt(active, epsilon, out=active)  # m_t
            _ActivityPattern.mark(bits, index, active)
        self.pattern.tally_chunk(bits)


class _MergeScratch:
    """One merging worker's buffers, reused across chunks; ``run`` merges one chunk.

    ``total`` holds sum_t m_t tau_t, then tau_merged; ``counts`` c; ``scaled`` (RAM+ only)
    sum_t lambda_t m_t tau_t, which is the scaled unique update where c == 1; ``pattern``
    only when counting.
    """

    def __init__(
        self,
        size: int,
        n: int,
        like: torch.Tensor,
        dtype: torch.dtype,
        lambdas: Optional[tuple[float, ...]],
        *,
        count: bool,
    ) -> None:
        device = like.device
        self.dtype = dtype
        self.lambdas: tuple[float, ...] = lambdas or ()  # empty: plain RAM
        self.base = _ArithmeticBase(size, like, dtype)
        self.tau, self.active, self.total, self.counts = (
            torch.empty(size, dtype=dtype, device=device) for _ in range(4)
        )
        self.scaled = torch.empty(size, dtype=dtype, device=device) if lambdas else None
        self.pattern = _ActivityPattern(size, n, device) if count else None

    def run(self, base: torch.Tensor, finetunes: Sequence[torch.Tensor], epsilon: float, out: torch.Tensor) -> None:
        """theta_pre + tau_merged of one chunk into ``out``; its patterns tallied if counting."""
        length = base.numel()
        base_c = self.base.load(base)
        tau, active, total, counts = self.tau[:length], self.active[:length], self.total[:length], self.counts[:length]
        scaled = self.scaled[:length] if self.scaled is not None else None
        bits = self.pattern.chunk(length) if self.pattern is not None else None
        for index, finetune in enumerate(finetunes):
            torch.sub(finetune, base_c, out=tau)
            torch.abs(tau, out=active)
            torch.gt(active, epsilon, out=active)  # m_t; NaN compares false: masked to NaN * 0 below
            self._accumulate(index, tau, active, total, counts, scaled)
            if bits is not None:
                _ActivityPattern.mark(bits, index, active)
        if finetunes:
            self._merged_update(total, counts, scaled, unique=active)
        else:
            total.zero_()
        self._write(total, base_c, out)
        if not math.isfinite(out.sum(dtype=self.dtype).item()):
            _check_result(base, finetunes, epsilon, self.lambdas or None, self.dtype, out)
        if self.pattern is not None and bits is not None:
            self.pattern.tally_chunk(bits)

    def _accumulate(
        self,
        index: int,
        tau: torch.Tensor,
        active: torch.Tensor,
        total: torch.Tensor,
        counts: torch.Tensor,
        scaled: Optional[torch.Tensor],
    ) -> None:
        """Add model ``index``: total += m_t tau_t, counts += m_t, scaled += lambda_t m_t tau_t.

        The first model initialises them. NaN * 0 is NaN: masking keeps a non-finite input
        visible in the total.
        """
        if index == 0:
            torch.mul(tau, active, out=total)
            counts.copy_(active)
            if scaled is not None:
                torch.mul(total, self.lambdas[0], out=scaled)
            return
        total.addcmul_(tau, active)
        counts.add_(active)
        if scaled is not None:
            scaled.addcmul_(tau, active, value=self.lambdas[index])

    @staticmethod
    def _merged_update(
        total: torch.Tensor, counts: torch.Tensor, scaled: Optional[torch.Tensor], unique: torch.Tensor
    ) -> None:
        """tau_merged into ``total``: the mean of the active updates, the scaled one where c == 1.

        c == 1 divides by one and c == 0 leaves the total at zero. ``unique`` is a free buffer
        (the last model's mask) for the 0.0 / 1.0 weight of ``scaled``.
        """
        total.div_(counts.clamp_(min=1))
        if scaled is None:
            return
        torch.eq(counts, 1, out=unique)  # c == 1 (or 0, where both are zero)
        if math.isfinite(scaled.sum().item()):
            torch.lerp(total, scaled, unique, out=total)  # a weight of exactly 0 or 1 returns one end unchanged
        else:  # an overflow where c >= 2: lerp would make inf - inf = NaN of it
            torch.where(unique.bool(), scaled, total, out=total)

    def _write(self, total: torch.Tensor, base_c: torch.Tensor, out: torch.Tensor) -> None:
        """out = theta_pre + tau_merged, rounded once to the output dtype."""
        if out.dtype == self.dtype:
            torch.add(total, base_c, out=out)
        else:
            out.copy_(total.add_(base_c))


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


def _check_result(
    base: torch.Tensor,
    finetunes: Sequence[torch.Tensor],
    epsilon: float,
    scale: Optional[Sequence[float]],
    dtype: torch.dtype,
    out: torch.Tensor,
) -> None:
    """A chunk whose result sums to NaN or Inf: raise for the input or the overflow that made it.

    The slow path: recomputes the chunk with whole-chunk ops to tell the causes apart.
    """
    _check_finite(base, finetunes)
    if bool(torch.isfinite(out).all()):
        return  # only the sum overflowed
    base_c = base.to(dtype)
    taus = [finetune.to(dtype) - base_c for finetune in finetunes]
    masks = [tau.abs() > epsilon for tau in taus]
    counts = torch.stack(masks).sum(0)
    for index, (tau, mask) in enumerate(zip(taus, masks)):
        unique = mask & (counts == 1)
        if scale is not None and not bool(torch.isfinite(base_c[unique] + scale[index] * tau[unique]).all()):
            raise MergeOverflowError("lambda", index, dtype)
    mean = torch.stack([tau * mask for tau, mask in zip(taus, masks)]).sum(0) / counts.clamp(min=1)
    if not bool(torch.isfinite(base_c + mean).all()):
        raise MergeOverflowError("sum", None, dtype)
    raise MergeOverflowError("cast", None, out.dtype)
