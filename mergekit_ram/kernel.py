"""RAM / RAM+ tensor math (paper section 4, Algorithm 1) and its TIES and unique-only variants. Knows torch only.

For base ``theta_pre`` and fine-tunes ``theta_t``, t = 1..N, in ``compute_dtype`` of the inputs, the result
rounded once to the output dtype (finite inputs never give NaN or Inf: ``MergeOverflowError``):

    tau_t = theta_t - theta_pre,   m_t = |tau_t| > epsilon,   c = sum_t m_t
    tau_merged = 0 where c == 0,  lambda_t * tau_t where c == 1 and m_t,  the shared rule where c >= 2
    theta_merged = theta_pre + tau_merged

Shared rules: "mean" the mean of the active updates; "base" 0; "ties": per model, its updates at the P
shared positions (0 where inactive) are kept where their magnitude is at least the k-th smallest of them,
k = floor(P * (1 - density)); per position the sign of (sum of kept positive) - (sum of kept negative
magnitudes) is elected (none where 0), and tau_merged is the mean of the kept entries of that sign.

Mechanisms kept (``python -m benchmarks.kernel_rules --numel 8M --n 3 --alternatives``, a counting ``ram``
merge against each simplification, 2 shared cores, noisy): chunks, so that scratch per chunk element is
independent of the tensor's size (bfloat16 inputs: 20 B "mean", 36 B "ties", 6 B more counting); float32
activity patterns up to 24 models (int64: 1.49x / 1.39x / 1.72x slower); a bincount of 2**N bins up to 20
(torch.unique: 2.15x / 2.13x / 2.55x); int16 codes up to 15 (int32: 1.10x / 0.98x / 1.22x; one conditional
for 2 B per chunk element); the radix select of the TIES thresholds (exact; 0.75x torch.kthvalue's time,
16 B per chunk element against 22 B per tensor element). For what they guarantee: workers on one
intra-op thread (3-6x on a busy machine, docs/performance.md) by OpenMP's per-thread setter
(torch.set_num_threads also sets later threads' default); autograd (docs/method.md).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import ctypes
import itertools
import math
import threading
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Iterator, Literal, NamedTuple, Optional, Sequence, TypeVar, get_args

import torch
from torch import Tensor

#: The pattern tiers (module docstring): float32 bits, int16 codes, a dense bincount; int64 bits at most.
_FLOAT_PATTERN_MAX_MODELS = 24
_INT16_MAX_MODELS = 15
_BINCOUNT_MAX_MODELS = 20
_PATTERN_MAX_MODELS = 62
#: The radix select of the TIES thresholds reads 16 bits of the magnitudes per pass.
_DIGIT_BITS = 16
#: Elements per step: the scratch buffers stay in the CPU caches (2**17 measured fastest, 2**15 to 2**20 tried).
CHUNK_ELEMENTS = 1 << 17
#: On an accelerator each op is a kernel launch: larger chunks, still bounded scratch.
DEVICE_CHUNK_ELEMENTS = 1 << 24

#: The shared region's rule: the mean (ram, ram_plus), TIES (ram_ties), the base's value (ram_unique).
SharedRule = Literal["mean", "ties", "base"]
Histograms = tuple[tuple[int, ...], ...]
Scratch = TypeVar("Scratch")


class NonFiniteInputError(ValueError):
    """An input holds NaN or Inf; ``index`` is the fine-tune's position, or None for the base."""

    def __init__(self, index: Optional[int], value: Literal["NaN", "Inf"] = "NaN"):
        self.index, self.value = index, value
        where = "base" if index is None else f"fine-tuned input {index}"
        super().__init__(f"{where} contains {value}")


class MergeOverflowError(ValueError):
    """Finite inputs, a non-finite result; ``cause``, the first not to fit ``dtype`` where it overflowed: ``update``
    (fine-tune ``index``'s), ``lambda`` (its lambda, or base + lambda * update), ``sum`` (the merged update, or
    base + it), ``cast`` (the result, in the output dtype)."""

    def __init__(self, cause: Literal["update", "lambda", "sum", "cast"], index: Optional[int], dtype: torch.dtype):
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


@dataclass(frozen=True)
class OverlapCounts:
    """``histograms[t][k - 1]``: how many elements model t changed that exactly k models changed."""

    histograms: Histograms


@dataclass(frozen=True)
class MergeResult:
    """The merged tensor of one group, with its ``OverlapCounts.histograms`` exactly when asked to count."""

    merged: Tensor
    histograms: Optional[Histograms]


def count_overlaps(
    base: Tensor,
    finetunes: Sequence[Tensor],
    epsilon: float,
    *,
    workers: Optional[int] = None,
    chunk_elements: int = CHUNK_ELEMENTS,
) -> OverlapCounts:
    """The overlap histograms of one tensor group with the merge's masks, without merging (the pre-pass)."""
    workers = workers or torch.get_num_threads()
    _check_group(base, finetunes, workers, count=True)
    detached = [finetune.detach() for finetune in finetunes]
    work = partial(_CountScratch.run, epsilon=epsilon)
    scratches = _for_each_chunk(base.detach(), detached, chunk_elements, workers, _CountScratch, work)
    return OverlapCounts(histograms=_histograms([scratch.pattern for scratch in scratches]))


def merge_tensors(
    base: Tensor,
    finetunes: Sequence[Tensor],
    epsilon: float,
    lambdas: Optional[Sequence[float]] = None,
    *,
    workers: Optional[int] = None,
    count: bool = False,
    out_dtype: Optional[torch.dtype] = None,
    chunk_elements: int = CHUNK_ELEMENTS,
    shared: SharedRule = "mean",
    density: float = 1.0,
) -> MergeResult:
    """Merge one tensor group (``lambdas`` None: all 1; ``density``: the share "ties" keeps), counting if asked;
    ``out_dtype`` defaults to the base's; inputs that require grad give a result with autograd history."""
    n = len(finetunes)
    if lambdas is not None and len(lambdas) != n:
        raise ValueError(f"expected {n} lambda values, got {len(lambdas)}")
    if shared not in get_args(SharedRule):
        raise ValueError(f"shared must be one of {', '.join(get_args(SharedRule))}, got {shared!r}")
    if not 0.0 < density <= 1.0:
        raise ValueError(f"density must be in (0, 1], got {density}")
    workers = workers or torch.get_num_threads()
    _check_group(base, finetunes, workers, count)
    detached = [finetune.detach() for finetune in finetunes]
    scale = _unique_scale(lambdas, compute_dtype(base.dtype, *(finetune.dtype for finetune in finetunes)))
    kept = _kept_from(base.detach(), detached, epsilon, density, chunk_elements, workers) if shared == "ties" else ()
    plan = _MergePlan(epsilon, scale, shared, kept, count, out_dtype, chunk_elements, workers)
    inputs = (base, *finetunes)
    if torch.is_grad_enabled() and any(tensor.requires_grad for tensor in inputs):
        histograms: list[Optional[Histograms]] = []
        merged = _RamFunction.apply(plan, histograms, *inputs)
        return MergeResult(merged=merged, histograms=histograms[0])
    return _merge(plan, base.detach(), detached)


def _check_group(base: Tensor, finetunes: Sequence[Tensor], workers: int, count: bool) -> None:
    """Every fine-tune has the base's shape; at least one worker; counting, one bit per model in an int64."""
    for finetune in finetunes:
        if finetune.shape != base.shape:
            raise ValueError(f"shape {tuple(finetune.shape)} differs from the base's {tuple(base.shape)}")
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    if count and len(finetunes) > _PATTERN_MAX_MODELS:
        n = len(finetunes)
        raise ValueError(f"overlap statistics support at most {_PATTERN_MAX_MODELS} fine-tuned models, got {n}")


def _unique_scale(lambdas: Optional[Sequence[float]], dtype: torch.dtype) -> Optional[tuple[float, ...]]:
    """The lambdas to apply to unique updates; None for none (no lambdas, or all ones)."""
    if lambdas is None or all(lam == 1.0 for lam in lambdas):
        return None
    for index, lam in enumerate(lambdas):
        if not abs(lam) <= torch.finfo(dtype).max:  # would scale every update to inf (and 0 * inf = NaN)
            raise MergeOverflowError("lambda", index, dtype)
    return tuple(lambdas)


class _MergePlan(NamedTuple):
    """What one merge computes; shared by the forward pass and the gradient."""

    epsilon: float
    lambdas: Optional[tuple[float, ...]]  # None: unique updates unscaled
    shared: SharedRule
    kept_from: tuple[float, ...]  # "ties": per model, the smallest kept magnitude at shared positions (> epsilon)
    counting: bool
    out_dtype: Optional[torch.dtype]
    chunk_elements: int
    workers: int


def _merge(plan: _MergePlan, base: Tensor, finetunes: Sequence[Tensor]) -> MergeResult:
    """The chunked merge on inputs without autograd history."""
    merged = torch.empty(base.numel(), dtype=plan.out_dtype or base.dtype, device=base.device)

    def work(scratch: _MergeScratch, chunk: slice, base_chunk: Tensor, chunks: list[Tensor]) -> None:
        scratch.run(base_chunk, chunks, merged[chunk])

    scratches = _for_each_chunk(base, finetunes, plan.chunk_elements, plan.workers, partial(_MergeScratch, plan), work)
    patterns = [scratch.pattern for scratch in scratches if scratch.pattern is not None]
    return MergeResult(merged=merged.view(base.shape), histograms=_histograms(patterns) if plan.counting else None)


class _RamFunction(torch.autograd.Function):
    """The merge with autograd history, values bit for bit the kernel's. Masks, kept entries and signs are step
    functions, so with w_t the coefficient of tau_t in tau_merged (lambda_t where only t changed an element, 1 / n
    where one of n averaged entries, else 0): d merged / d theta_t = w_t, d merged / d theta_pre = 1 - sum_t w_t."""

    @staticmethod
    def forward(ctx: Any, plan: _MergePlan, histograms: list, base: Tensor, *finetunes: Tensor) -> Tensor:
        result = _merge(plan, base.detach(), [finetune.detach() for finetune in finetunes])
        histograms.append(result.histograms)
        ctx.plan = plan
        ctx.save_for_backward(base, *finetunes)
        return result.merged

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], ...]:
        inputs = [tensor.detach() for tensor in ctx.saved_tensors]
        grads = [
            torch.empty(tensor.numel(), dtype=tensor.dtype, device=tensor.device) if needed else None
            for tensor, needed in zip(inputs, ctx.needs_input_grad[2:])
        ]
        flat_grad = grad.reshape(-1)

        def work(scratch: _MergeScratch, chunk: slice, base_chunk: Tensor, chunks: list[Tensor]) -> None:
            scratch.gradient(
                base_chunk, chunks, flat_grad[chunk], [out if out is None else out[chunk] for out in grads]
            )

        plan = ctx.plan._replace(counting=False)
        _for_each_chunk(inputs[0], inputs[1:], plan.chunk_elements, plan.workers, partial(_MergeScratch, plan), work)
        return None, None, *(out if out is None else out.view(inputs[0].shape) for out in grads)


def _for_each_chunk(
    base: Tensor,
    finetunes: Sequence[Tensor],
    chunk_elements: int,
    workers: int,
    make_scratch: Callable[[int, int, Tensor, torch.dtype], Scratch],
    work: Callable[[Scratch, slice, Tensor, list[Tensor]], None],
) -> list[Scratch]:
    """``work(scratch, chunk, base_chunk, finetune_chunks)`` on each chunk of the flat group; the workers' scratches
    (``make_scratch(size, n, base, dtype)``: a worker's buffers of ``size`` elements in the arithmetic dtype)."""
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

    scratch = partial(make_scratch, size, len(finetunes), base, dtype)
    return _map_chunks(run, scratch, range(0, numel, chunk_elements), workers)


def _intra_op_setter() -> Callable[[int], Any]:
    """OpenMP's setter of this thread's team size (torch.set_num_threads would also set later threads' default)."""
    try:
        setter = ctypes.CDLL(None).omp_set_num_threads
    except (OSError, AttributeError, TypeError):
        return torch.set_num_threads
    setter.argtypes = [ctypes.c_int]
    return setter


@contextlib.contextmanager
def _one_intra_op_thread() -> Iterator[None]:
    """This thread runs its ops on one thread meanwhile; no other thread's setting changes."""
    saved = torch.get_num_threads()  # torch initialises this thread's count first
    set_threads = _intra_op_setter()
    set_threads(1)
    try:
        yield
    finally:
        set_threads(saved)


def _map_chunks(
    run: Callable[[int, Scratch], None], make_state: Callable[[], Scratch], starts: Sequence[int], workers: int
) -> list[Scratch]:
    """Run every chunk, each worker thread with its own state; the states. Intra-op parallelism makes each small op
    a fork and a join that a descheduled thread stalls (3-6x on a busy machine): whole chunks go to the caller and
    ``workers - 1`` threads, each on one intra-op thread; ``workers`` 0: the caller alone, as it is (accelerators)."""
    threads = _one_intra_op_thread if workers else contextlib.nullcontext
    workers = min(workers, len(starts))
    pending = iter(starts)
    taking = threading.Lock()
    failed = threading.Event()
    states: list[Scratch] = []

    def drain() -> None:
        """Take chunks until none are left (or another worker failed), on one intra-op thread."""
        with threads():
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


def _load(buffer: Optional[Tensor], base: Tensor) -> Tensor:
    """``base`` (one chunk) in the arithmetic dtype: itself, or its copy in ``buffer`` (None where it already is)."""
    return base if buffer is None else buffer[: base.numel()].copy_(base)


class _Patterns:
    """One worker's activity patterns (bit t: model t is active) and their tally: float32 bits (exact to 24 bits),
    else int64; bincount takes integers, so float32 bits go through ``codes`` (int16 up to 15 models, else int32)."""

    def __init__(self, size: int, n: int, device: torch.device) -> None:
        narrow = n <= _FLOAT_PATTERN_MAX_MODELS
        self.n = n
        self.bits = torch.empty(size, dtype=torch.float32 if narrow else torch.int64, device=device)
        code_dtype = torch.int16 if n <= _INT16_MAX_MODELS else torch.int32
        self.codes = torch.empty(size, dtype=code_dtype, device=device) if narrow else None
        self.dense = torch.zeros(1 << n if n <= _BINCOUNT_MAX_MODELS else 0, dtype=torch.int64, device=device)
        self.sparse: collections.Counter[int] = collections.Counter()

    @staticmethod
    def mark(bits: Tensor, index: int, active: Tensor) -> None:
        """Set bit ``index`` where ``active`` (0.0 / 1.0) is 1; model 0 starts the chunk's pattern."""
        if index == 0:
            bits.copy_(active)
        else:
            bits.add_(active if bits.is_floating_point() else active.to(torch.int64), alpha=1 << index)

    def tally(self, bits: Tensor) -> None:
        """Count the chunk's patterns (no models: nothing to count)."""
        if self.n == 0:
            return
        if self.codes is not None:
            bits = self.codes[: bits.numel()].copy_(bits)
        if self.dense.numel():
            self.dense += torch.bincount(bits, minlength=1 << self.n)
        else:
            codes, frequencies = torch.unique(bits, return_counts=True)
            self.sparse.update(dict(zip(codes.tolist(), frequencies.tolist())))


def _histograms(patterns: Sequence[_Patterns]) -> Histograms:
    """The per-model histograms of every worker's tally together."""
    n, dense, sparse = patterns[0].n, patterns[0].dense, patterns[0].sparse
    for pattern in patterns[1:]:
        dense += pattern.dense
        sparse.update(pattern.sparse)
    histograms = [[0] * n for _ in range(n)]
    for code, frequency in itertools.chain(enumerate(dense.tolist()), sparse.items()):
        if frequency:
            for index in range(n):
                if code >> index & 1:
                    histograms[index][code.bit_count() - 1] += frequency
    return tuple(tuple(row) for row in histograms)


def _update_and_mask(
    finetune: Tensor,
    base: Tensor,
    epsilon: float,
    tau: Tensor,
    active: Tensor,
    inputs: Optional[tuple[Tensor, Sequence[Tensor]]] = None,
    update_of: Optional[int] = None,
) -> None:
    """tau_t into ``tau`` (or ``active``), m_t (0.0 / 1.0) into ``active``; with ``inputs``, non-finite ones named,
    then with ``update_of`` (the fine-tune's index), an update that overflowed from finite inputs refused."""
    torch.sub(finetune, base, out=tau)
    torch.abs(tau, out=active)
    if inputs is not None and not math.isfinite(active.sum().item()):
        _check_finite(*inputs)
        if update_of is not None and not bool(torch.isfinite(active).all()):
            raise MergeOverflowError("update", update_of, active.dtype)
    torch.gt(active, epsilon, out=active)  # NaN compares false: masked to NaN * 0 by the sums


def _check_finite(base: Tensor, finetunes: Sequence[Tensor]) -> None:
    """Name the input holding NaN or Inf; a finite sum that overflowed is not an error."""
    for index, tensor in [(None, base), *enumerate(finetunes)]:
        if not bool(torch.isfinite(tensor).all()):
            raise NonFiniteInputError(index, "NaN" if bool(torch.isnan(tensor).any()) else "Inf")


class _CountScratch:
    """One counting worker's buffers, reused across chunks: the base, |tau_t| then m_t, the pattern."""

    def __init__(self, size: int, n: int, like: Tensor, dtype: torch.dtype) -> None:
        self.base = None if like.dtype == dtype else torch.empty(size, dtype=dtype, device=like.device)
        self.active = torch.empty(size, dtype=dtype, device=like.device)
        self.pattern = _Patterns(size, n, like.device)

    def run(self, chunk: slice, base: Tensor, finetunes: Sequence[Tensor], *, epsilon: float) -> None:
        """Tally one chunk's activity patterns; a NaN or Inf input is named."""
        base_c = _load(self.base, base)
        active, bits = self.active[: base.numel()], self.pattern.bits[: base.numel()]
        for index, finetune in enumerate(finetunes):
            _update_and_mask(finetune, base_c, epsilon, active, active, (base, finetunes))
            _Patterns.mark(bits, index, active)
        self.pattern.tally(bits)


def _add(target: Tensor, first: bool, value: Tensor, mask: Optional[Tensor] = None, scale: float = 1.0) -> None:
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


class _RuleSums(NamedTuple):
    """A chunk's sums over the models of masked values v_t (updates, or the gradient): c, sum_t lambda_t m_t v_t,
    sum_t m_t v_t ("mean" with lambdas, else None: ``unique``), and ("ties") over the kept entries (magnitude at
    least the model's threshold) the sums of v_t by sign, then their counts."""

    c: Tensor
    unique: Tensor
    total: Optional[Tensor]
    kept: tuple[Tensor, ...]  # positive, negative, positive count, negative count; () but for "ties"

    @classmethod
    def allocate(cls, plan: _MergePlan, like: Tensor) -> _RuleSums:
        """New buffers shaped like ``like``."""
        total = torch.empty_like(like) if plan.shared == "mean" and plan.lambdas else None
        kept = tuple(torch.empty_like(like) for _ in range(4)) if plan.shared == "ties" else ()
        return cls(torch.empty_like(like), torch.empty_like(like), total, kept)

    def prefix(self, length: int) -> _RuleSums:
        """The sums of a chunk of ``length`` elements (views; these for a whole chunk)."""
        if length == self.c.numel():
            return self
        total = None if self.total is None else self.total[:length]
        return _RuleSums(self.c[:length], self.unique[:length], total, tuple(kept[:length] for kept in self.kept))

    def add(
        self, plan: _MergePlan, first: bool, index: int, tau: Tensor, active: Tensor, value: Tensor, counting: bool
    ) -> None:
        """Model ``index`` (update ``tau``, mask ``active``, overwritten) adds ``value``; ``first`` sets the sums
        (NaN * 0 is NaN: masking keeps a non-finite value visible)."""
        if counting:
            _add(self.c, first, active)
        if self.total is not None:
            _add(self.total, first, value, active)
        _add(self.unique, first, value, active, plan.lambdas[index] if plan.lambdas else 1.0)
        kept_from = plan.kept_from[index] if self.kept else 0.0  # > epsilon and > 0: kept entries are active
        for compare, bound, kept, counts in zip(
            (torch.ge, torch.le), (kept_from, -kept_from), self.kept, self.kept[2:]
        ):
            compare(tau, bound, out=active)
            _add(kept, first, value, active)
            if counting:
                _add(counts, first, active)

    def combine(
        self,
        plan: _MergePlan,
        weight: Tensor,
        spare: Tensor,
        counts: Optional[_RuleSums] = None,
        inputs: Optional[tuple[Tensor, Sequence[Tensor]]] = None,
    ) -> Tensor:
        """tau_merged of these sums (of one model's, with the updates' ``counts``: w_t times its values); overwrites
        them, ``weight`` and ``spare``. Blended as shared - shared * w + unique * w: exact for w 0 and 1, never
        inf - inf from finite operands; else selected (a NaN or Inf input named, given ``inputs``)."""
        counts = self if counts is None else counts
        count = counts.c.clamp_(min=1)  # c == 0 leaves every sum at 0 below
        shared: Optional[Tensor] = None
        if plan.shared == "mean":
            shared = (self.unique if self.total is None else self.total).div_(count)
            if self.total is None:  # c == 1 divides the unique update by one
                return shared
        elif self.kept:  # the mean of the kept entries of the elected sign, else 0
            elected = torch.add(counts.kept[0], counts.kept[1], out=spare)
            positive = self.kept[0].div_(counts.kept[2].clamp_(min=1))
            negative = self.kept[1].div_(counts.kept[3].clamp_(min=1))
            positive.mul_(torch.gt(elected, 0, out=weight))
            shared = positive.addcmul_(negative, torch.lt(elected, 0, out=weight))
        torch.eq(count, 1, out=weight)
        if math.isfinite(self.unique.sum().item()):
            if shared is None:
                return self.unique.mul_(weight)
            return shared.addcmul_(shared, weight, value=-1.0).addcmul_(self.unique, weight)
        if inputs is not None:
            _check_finite(*inputs)
        chosen = weight.bool()
        if shared is None:
            return self.unique.masked_fill_(~chosen, 0.0)
        return torch.where(chosen, self.unique, shared, out=shared)


class _MergeScratch:
    """One merging worker's buffers: ``run`` merges a chunk, ``gradient`` differentiates one. Masks and counts are
    0.0 / 1.0 and small integers in the arithmetic dtype: bool kernels are several times slower here (per 2**17
    elements: ``gt`` 57 vs 16 us, ``mul`` 94 vs 17, ``where`` 290 vs 23)."""

    def __init__(self, plan: _MergePlan, size: int, n: int, like: Tensor, dtype: torch.dtype) -> None:
        self.plan, self.dtype = plan, dtype
        self.base = None if like.dtype == dtype else torch.empty(size, dtype=dtype, device=like.device)
        self.tau, self.active = (torch.empty(size, dtype=dtype, device=like.device) for _ in range(2))
        self.sums = _RuleSums.allocate(plan, self.tau)
        self.pattern = _Patterns(size, n, like.device) if plan.counting else None

    def run(self, base: Tensor, finetunes: Sequence[Tensor], out: Tensor) -> None:
        """theta_pre + tau_merged of one chunk into ``out``, rounded once; its patterns tallied if counting."""
        length = base.numel()
        base_c = _load(self.base, base)
        bits = self.pattern.bits[:length] if self.pattern is not None else None
        sums = self._sums(base_c, finetunes, range(len(finetunes)), bits=bits)
        tau, active = self.tau[:length], self.active[:length]
        update = sums.combine(self.plan, active, tau, inputs=(base, finetunes)) if finetunes else active.zero_()
        if out.dtype == self.dtype:
            result = torch.add(update, base_c, out=out)
        else:
            result = update.add_(base_c)
            out.copy_(result)
        if not math.isfinite(out.sum(dtype=self.dtype).item()):
            self._diagnose(base, finetunes, out, result)
        if self.pattern is not None and bits is not None:
            self.pattern.tally(bits)

    def _sums(
        self,
        base_c: Tensor,
        finetunes: Sequence[Tensor],
        models: Sequence[int],
        value: Optional[Tensor] = None,
        counts: Optional[_RuleSums] = None,
        bits: Optional[Tensor] = None,
    ) -> _RuleSums:
        """The sums over ``models`` of their masked ``value`` (None: update), counted in ``sums`` without ``counts``."""
        length = base_c.numel()
        tau, active = self.tau[:length], self.active[:length]
        sums = self.sums.prefix(length) if counts is None else _RuleSums.allocate(self.plan, tau)
        for position, index in enumerate(models):
            _update_and_mask(finetunes[index], base_c, self.plan.epsilon, tau, active)
            if bits is not None:
                _Patterns.mark(bits, index, active)
            sums.add(self.plan, position == 0, index, tau, active, tau if value is None else value, counts is None)
        return sums

    def gradient(
        self, base: Tensor, finetunes: Sequence[Tensor], grad: Tensor, outs: Sequence[Optional[Tensor]]
    ) -> None:
        """w_t * g for model t, (1 - sum_t w_t) * g for the base, of one chunk into ``outs`` (the base's first)."""
        base_out, *finetune_outs = outs
        if not finetunes:
            if base_out is not None:
                base_out.copy_(grad)
            return
        base_c = _load(self.base, base)
        g, models = grad.to(self.dtype), range(len(finetunes))
        counts = self._sums(base_c, finetunes, models)
        for index, out in enumerate(finetune_outs):
            if out is not None:
                out.copy_(self._rule(base_c, finetunes, [index], g, counts))
        if base_out is not None:
            weights = self._rule(base_c, finetunes, models, torch.ones_like(g), counts)
            base_out.copy_(weights.neg_().add_(1.0).mul_(g))

    def _rule(
        self, base_c: Tensor, finetunes: Sequence[Tensor], models: Sequence[int], value: Optional[Tensor], counts: Any
    ) -> Tensor:
        """The rule applied to the sums over ``models`` of ``value`` where the updates' ``counts`` are (as ``run``
        does, the update buffer, free once summed, takes the elected sign)."""
        length = base_c.numel()
        sums = self._sums(base_c, finetunes, models, value, counts)
        return sums.combine(self.plan, self.active[:length], self.tau[:length], counts)

    def _diagnose(self, base: Tensor, finetunes: Sequence[Tensor], out: Tensor, result: Tensor) -> None:
        """Raise for a NaN or Inf input, else for the first cause of a non-finite ``out`` (a lambda where the base plus
        its scaled update overflows; with lambda 1 that is the model's own value)."""
        _check_finite(base, finetunes)
        if bool(torch.isfinite(out).all()):
            return
        if result is not out and bool(torch.isfinite(result).all()):
            raise MergeOverflowError("cast", None, out.dtype)
        overflowed = ~torch.isfinite(result)  # taken before the diagnosis reuses the buffer ``result`` may be
        base_c = _load(self.base, base)
        for index, finetune in enumerate(finetunes):
            if not bool(torch.isfinite(torch.sub(finetune, base_c)[overflowed]).all()):
                raise MergeOverflowError("update", index, self.dtype)
        if self.plan.lambdas:
            counts = self._sums(base_c, finetunes, range(len(finetunes)))
            for index in range(len(finetunes)):
                alone = self._rule(base_c, finetunes, [index], None, counts)
                if not bool(torch.isfinite(alone.add_(base_c)).all()):
                    raise MergeOverflowError("lambda", index, self.dtype)
        raise MergeOverflowError("sum", None, self.dtype)


def _kept_from(
    base: Tensor, finetunes: Sequence[Tensor], epsilon: float, density: float, chunk_elements: int, workers: int
) -> tuple[float, ...]:
    """For "ties": per model, the k-th smallest of |tau_t| m_t at the P shared positions (0 when k == 0), above
    epsilon; exact: non-negative floats order as their bits, found 16 at a time by a radix select, a pass per digit."""
    n = len(finetunes)
    dtype = compute_dtype(base.dtype, *(finetune.dtype for finetune in finetunes))
    width = torch.finfo(dtype).bits
    prefixes, ranks = [0] * n, [0] * n
    for shift in range(width - _DIGIT_BITS, -1, -_DIGIT_BITS) if density < 1.0 and n else ():
        count_digits = partial(_RadixScratch.run_chunk, epsilon=epsilon, shift=shift, prefixes=prefixes)
        scratches = _for_each_chunk(base, finetunes, chunk_elements, workers, _RadixScratch, count_digits)
        tables = scratches[0].tables
        for scratch in scratches[1:]:
            tables += scratch.tables
        if shift == width - _DIGIT_BITS:
            shared = sum(scratch.shared for scratch in scratches)
            ranks = [math.floor(shared * (1.0 - density))] * n
            if ranks[0] == 0:  # P == 0 or k == 0: nothing trimmed
                break
        for index in range(n):
            if prefixes[index] == 0:  # the unshared positions are zeros there: not entries
                tables[index, 0] -= base.numel() - shared
            below = tables[index].cumsum(0)  # the digit of the ranks[index]-th smallest entry (1-based)
            digit = int(torch.searchsorted(below, ranks[index]))
            ranks[index] -= int(below[digit - 1]) if digit else 0
            prefixes[index] = prefixes[index] << _DIGIT_BITS | digit
            del below  # one table at a time
        del scratches, tables  # freed before the next pass allocates its own
    bits_dtype = torch.int32 if width == 32 else torch.int64
    above = torch.nextafter(torch.tensor(max(epsilon, 0.0), dtype=dtype), torch.tensor(math.inf, dtype=dtype)).item()
    return tuple(max(torch.tensor(bits, dtype=bits_dtype).view(dtype).item(), above) for bits in prefixes)


class _RadixScratch:
    """One worker's buffers for a radix pass: per model, a histogram of a 16-bit digit under the prefix so far, of
    |tau_t| at shared positions (``shared``: P). Inactive entries are counted too: at most epsilon, they change the
    k-th smallest only where it is raised above epsilon anyway. Unshared positions read as 0."""

    def __init__(self, size: int, n: int, like: Tensor, dtype: torch.dtype) -> None:
        device = like.device
        self.first_shift = torch.finfo(dtype).bits - _DIGIT_BITS
        self.base = None if like.dtype == dtype else torch.empty(size, dtype=dtype, device=like.device)
        self.tau, self.mask = (torch.empty(size, dtype=dtype, device=device) for _ in range(2))
        self.keys = torch.empty(size, dtype=torch.int32 if dtype == torch.float32 else torch.int64, device=device)
        self.tables = torch.zeros((n, 1 << _DIGIT_BITS), dtype=torch.int64, device=device)
        self.shared = 0

    def run_chunk(
        self,
        chunk: slice,
        base: Tensor,
        finetunes: Sequence[Tensor],
        *,
        epsilon: float,
        shift: int,
        prefixes: list[int],
    ) -> None:
        """Count one chunk's digits ``(bits >> shift) & 0xFFFF`` of the entries under each model's prefix."""
        length = base.numel()
        base_c = _load(self.base, base)
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
