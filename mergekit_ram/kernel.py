"""RAM / RAM+ tensor math (paper section 4, Algorithm 1). Knows torch only.

For one tensor with base ``theta_pre`` and fine-tunes ``theta_t``, ``t = 1..N``:

    tau_t = theta_t - theta_pre
    m_t   = |tau_t| > epsilon                   (strict, in the arithmetic dtype)
    c     = sum_t m_t                           (how many models changed an element)
    tau_merged = 0                 where c == 0
               = lambda_t * tau_t  where c == 1 and m_t
               = mean of active tau where c >= 2
    theta_merged = theta_pre + tau_merged

Arithmetic is in float32, or float64 when an input is float64 (the wider of float32 and
the inputs' precision); the result is written once, from that precision, in the output dtype
(the base's unless asked). Finite inputs never give NaN or Inf: an overflow is an error
(``MergeOverflowError``). Inputs that require grad get a result with autograd history.
The work runs over chunks of CHUNK_ELEMENTS elements: scratch is at most 24 bytes per
element of one chunk (3 MiB per worker thread; 28 bytes when RAM+ lambdas and statistics are
taken in one pass, as with pinned statistics), independent of the tensor's size and, up to 24
models, of N (beyond, the statistics pattern widens to 8 bytes); beyond it only the output is
allocated. With float64 arithmetic each buffer is twice as wide.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import math
import threading
from dataclasses import dataclass
from typing import Any, Callable, Literal, Optional, Sequence

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


@dataclass(frozen=True)
class KernelResult:
    """The merged tensor (None when only counting) and, if asked, per-model histograms.

    ``histograms[t][k - 1]`` is the number of elements model t changed that exactly k
    models changed (k = 1 is unique, k >= 2 shared).
    """

    merged: Optional[torch.Tensor]
    histograms: Optional[tuple[tuple[int, ...], ...]]


#: Elements per step: the scratch buffers (at most 28 bytes each) stay in the CPU caches and
#: are independent of the tensor's size (2**17 measured fastest, 2**15 to 2**20 tried).
CHUNK_ELEMENTS = 1 << 17
#: On an accelerator each op is a kernel launch: larger chunks, still bounded scratch.
DEVICE_CHUNK_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class _Plan:
    """What one kernel call computes; shared by the forward pass and the gradient."""

    epsilon: float
    lambdas: Optional[tuple[float, ...]]
    merge: bool
    count: bool
    chunk_elements: int
    out_dtype: Optional[torch.dtype]
    workers: int


def ram_merge(
    base: torch.Tensor,
    finetunes: Sequence[torch.Tensor],
    epsilon: float,
    lambdas: Optional[Sequence[float]] = None,
    *,
    merge: bool = True,
    count: bool = False,
    chunk_elements: int = CHUNK_ELEMENTS,
    out_dtype: Optional[torch.dtype] = None,
    workers: Optional[int] = None,
) -> KernelResult:
    """Merge one tensor group with the RAM rule, and/or count its overlap histograms.

    ``lambdas`` scales each model's unique updates (None or all ones: plain RAM).
    ``merge=False, count=True`` is the statistics pre-pass: same masks, no merge.
    Arithmetic is in ``compute_dtype`` of the inputs; the result is written once, in
    ``out_dtype`` (default: the base's dtype). The work runs over ``chunk_elements``
    elements at a time on ``workers`` threads (default: the caller's torch thread count).
    Inputs that require grad give a result with autograd history (see ``_RamFunction``).
    """
    n = len(finetunes)
    if lambdas is not None and len(lambdas) != n:
        raise ValueError(f"expected {n} lambda values, got {len(lambdas)}")
    for finetune in finetunes:
        if finetune.shape != base.shape:
            raise ValueError(f"shape {tuple(finetune.shape)} differs from the base's {tuple(base.shape)}")
    if count and n > _PATTERN_MAX_MODELS:
        raise ValueError(f"overlap statistics support at most {_PATTERN_MAX_MODELS} fine-tuned models, got {n}")
    dtype = compute_dtype(base.dtype, *(finetune.dtype for finetune in finetunes))
    scale = tuple(lambdas) if merge and lambdas is not None and any(lam != 1.0 for lam in lambdas) else None
    for index, lam in enumerate(scale or ()):
        if not abs(lam) <= torch.finfo(dtype).max:  # would scale every update to inf (and 0 * inf = NaN)
            raise MergeOverflowError("lambda", index, dtype)
    if base.device.type != "cpu":
        chunk_elements = max(chunk_elements, DEVICE_CHUNK_ELEMENTS)
    plan = _Plan(
        epsilon=epsilon,
        lambdas=scale,
        merge=merge,
        count=count,
        chunk_elements=chunk_elements,
        out_dtype=out_dtype,
        workers=torch.get_num_threads() if workers is None else workers,
    )
    inputs = (base, *finetunes)
    if merge and torch.is_grad_enabled() and any(tensor.requires_grad for tensor in inputs):
        histograms: list = []
        merged = _RamFunction.apply(plan, histograms, *inputs)
        return KernelResult(merged=merged, histograms=histograms[0])
    return _run(plan, base.detach(), [finetune.detach() for finetune in finetunes])


def _run(plan: _Plan, base: torch.Tensor, finetunes: Sequence[torch.Tensor]) -> KernelResult:
    """The chunked kernel on inputs without autograd history."""
    n = len(finetunes)
    chunk_elements = plan.chunk_elements
    flat_base = base.reshape(-1)
    flat_finetunes = [finetune.reshape(-1) for finetune in finetunes]
    numel = flat_base.numel()
    dtype = compute_dtype(base.dtype, *(finetune.dtype for finetune in finetunes))
    merged = torch.empty(numel, dtype=plan.out_dtype or base.dtype, device=base.device) if plan.merge else None
    size = min(chunk_elements, max(numel, 1))

    def worker() -> tuple[_Scratch, Optional[_PatternCounts]]:
        scratch = _Scratch(size, n, flat_base, dtype, merge=plan.merge, count=plan.count, scale=plan.lambdas)
        return scratch, _PatternCounts(n, base.device) if plan.count else None

    def run(start: int, state: tuple[_Scratch, Optional[_PatternCounts]]) -> None:
        stop = min(start + chunk_elements, numel)
        pattern = state[0].run(
            flat_base[start:stop],
            [finetune[start:stop] for finetune in flat_finetunes],
            plan.epsilon,
            merged[start:stop] if merged is not None else None,
        )
        if state[1] is not None:
            state[1].add(pattern)

    starts = range(0, numel, chunk_elements)
    workers = plan.workers if base.device.type == "cpu" else 0  # 0: the calling thread
    states = _map_chunks(run, worker, starts, workers)
    patterns = [counts for _, counts in states if counts is not None]
    return KernelResult(
        merged=merged.view(base.shape) if merged is not None else None,
        histograms=_PatternCounts.combined(patterns).histograms() if plan.count else None,
    )


class _RamFunction(torch.autograd.Function):
    """The kernel as an autograd function: values from the kernel itself, bit for bit.

    The masks are step functions of the inputs (derivative 0 almost everywhere), so with
    w_t = m_t * (lambda_t where c == 1, 1 / c where c >= 2):
        d merged / d theta_t   = w_t
        d merged / d theta_pre = 1 - sum_t w_t
    """

    @staticmethod
    def forward(ctx: Any, plan: _Plan, histograms: list, base: torch.Tensor, *finetunes: torch.Tensor) -> torch.Tensor:
        result = _run(plan, base.detach(), [finetune.detach() for finetune in finetunes])
        histograms.append(result.histograms)
        ctx.plan = plan
        ctx.save_for_backward(base, *finetunes)
        return result.merged

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        base, *finetunes = ctx.saved_tensors
        plan: _Plan = ctx.plan
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


def _one_intra_op_thread() -> None:
    """Pool threads run their ops on one thread each; no other thread's setting changes.

    torch.set_num_threads also stores the default for threads that start later (one value
    for the process), so where torch uses OpenMP only this thread's OpenMP count is set.
    """
    torch.get_num_threads()  # torch initialises this thread's count first
    try:
        set_threads = ctypes.CDLL(None).omp_set_num_threads
    except (OSError, AttributeError, TypeError):
        torch.set_num_threads(1)
        return
    set_threads.argtypes = [ctypes.c_int]
    set_threads(1)


def _map_chunks(run: Callable, make_state: Callable, starts: Sequence[int], workers: int) -> list:
    """Run every chunk, each worker thread with its own scratch; the per-worker states.

    Each chunk is a few dozen small elementwise ops. Under torch's intra-op parallelism every
    op is a fork and a join; on a busy machine a descheduled thread stalls each of them
    (measured 3-6x slower than one thread). So whole chunks go to ``workers`` threads of a
    pool owned by this call, each running torch on one thread; the caller waits. A caller
    that is itself single-threaded runs the chunks itself when ``workers`` is 1; ``workers``
    0 runs them in the calling thread as it is (accelerators: every op is a launch there).
    """
    workers = min(workers, len(starts))
    if workers <= 1:
        state = make_state()
        for start in starts:
            run(start, state)
        return [state]
    local = threading.local()
    states = []

    def task(start: int) -> None:
        if not hasattr(local, "state"):
            local.state = make_state()
            states.append(local.state)
        run(start, local.state)

    pool = concurrent.futures.ThreadPoolExecutor(
        workers, thread_name_prefix="mergekit-ram", initializer=_one_intra_op_thread
    )
    try:
        futures = [pool.submit(task, start) for start in starts]
        for future in futures:
            future.result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # no chunk may still write once this returns or raises
    return states


class _Scratch:
    """Buffers for one chunk, reused across chunks; ``run`` applies the rule to one chunk.

    Buffers are in the arithmetic dtype (float32, or float64 for float64 inputs). Masks,
    counts and patterns are 0/1 and small integers in it (exact below 2**24): this torch's
    CPU kernels for bool outputs and bool operands are several times slower than the float32
    ones (measured per 2**17-element chunk: ``gt`` 57 vs 16 us, masking ``mul`` 94 vs 17 us,
    ``where`` 290 us vs ``lerp`` 23 us).
    """

    def __init__(
        self,
        size: int,
        n: int,
        like: torch.Tensor,
        dtype: torch.dtype,
        *,
        merge: bool,
        count: bool,
        scale: Optional[Sequence[float]],
    ) -> None:
        device = like.device
        self.n, self.merge, self.count, self.scale, self.dtype = n, merge, count, scale, dtype
        self.base_c = None if like.dtype == dtype else torch.empty(size, dtype=dtype, device=device)
        self.tau = torch.empty(size, dtype=dtype, device=device)
        self.active = torch.empty(size, dtype=dtype, device=device)  # m_t as 0.0 / 1.0
        if merge:
            self.total = torch.empty(size, dtype=dtype, device=device)  # sum of active deltas
            self.counts = torch.empty(size, dtype=dtype, device=device)  # c
            # sum of lambda_t * active delta: where c == 1, the scaled unique update
            self.scaled = torch.empty(size, dtype=dtype, device=device) if scale else None
        if count:
            # bit t set when model t is active; float32 holds 24 bits exactly
            pattern_dtype = torch.float32 if n <= _FLOAT_PATTERN_MAX_MODELS else torch.int64
            self.pattern = torch.empty(size, dtype=pattern_dtype, device=device)

    def run(
        self, base: torch.Tensor, finetunes: Sequence[torch.Tensor], epsilon: float, out: Optional[torch.Tensor]
    ) -> Optional[torch.Tensor]:
        """Merge one chunk into ``out``; the chunk's integer activity pattern if counting."""
        length = base.numel()
        if self.base_c is None:
            base_c = base
        else:
            base_c = self.base_c[:length]
            base_c.copy_(base)
        tau, active = self.tau[:length], self.active[:length]
        if self.merge:
            total, counts = self.total[:length], self.counts[:length]
            scaled = self.scaled[:length] if self.scaled is not None else None
        pattern = self.pattern[:length] if self.count else None
        if pattern is not None and not finetunes:
            pattern.zero_()

        for index, finetune in enumerate(finetunes):
            torch.sub(finetune, base_c, out=tau)
            torch.abs(tau, out=active)
            if not self.merge and not math.isfinite(active.sum().item()):
                _check_finite(base, finetunes)
            torch.gt(active, epsilon, out=active)  # NaN compares false: masked to NaN * 0 below
            first = index == 0  # the first model initialises the accumulators
            if self.merge:
                # NaN * 0 is NaN: masking keeps a non-finite input visible in the total.
                if first:
                    torch.mul(tau, active, out=total)
                    counts.copy_(active)
                else:
                    total.addcmul_(tau, active)
                    counts.add_(active)
                if scaled is not None:
                    if first:
                        torch.mul(total, self.scale[index], out=scaled)
                    else:
                        scaled.addcmul_(tau, active, value=self.scale[index])
            if pattern is not None:
                if first:
                    pattern.copy_(active)
                elif pattern.dtype == torch.float32:
                    pattern.add_(active, alpha=1 << index)
                else:
                    pattern.add_(active.to(torch.int64), alpha=1 << index)

        if self.merge:
            if not finetunes:
                total.zero_()
                counts.zero_()
            # Mean over active models; c == 1 divides by one, c == 0 leaves total at zero.
            total.div_(counts.clamp_(min=1))
            if scaled is not None:
                # c == 1 (or 0, where both are zero) takes the scaled update
                torch.eq(counts, 1, out=active)
                if math.isfinite(scaled.sum().item()):
                    # lerp with a weight of exactly 0 or 1 returns one of its ends unchanged
                    torch.lerp(total, scaled, active, out=total)
                else:  # an overflow where c >= 2: lerp would make inf - inf = NaN of it
                    torch.where(active.bool(), scaled, total, out=total)
            if out.dtype == self.dtype:
                torch.add(total, base_c, out=out)
            else:
                out.copy_(total.add_(base_c))  # the one rounding to the output dtype
            if not math.isfinite(out.sum(dtype=self.dtype).item()):
                _check_result(base, finetunes, epsilon, self.scale, self.dtype, out)
        if pattern is None or pattern.dtype != torch.float32:
            return pattern
        # bincount needs integers: reuse tau's storage (free now) for them
        integers = tau.view(torch.int32 if self.n > _INT16_MAX_MODELS else torch.int16)[:length]
        return integers.copy_(pattern)


class _PatternCounts:
    """How many elements have each activity pattern (bit t: model t changed it)."""

    def __init__(self, n: int, device: torch.device) -> None:
        self.n = n
        self.dense = torch.zeros(1 << n, dtype=torch.int64, device=device) if n <= _BINCOUNT_MAX_MODELS else None
        self.sparse: dict[int, int] = {}

    def add(self, pattern: torch.Tensor) -> None:
        if self.dense is not None:
            self.dense += torch.bincount(pattern, minlength=1 << self.n)
        else:
            codes, frequencies = torch.unique(pattern, return_counts=True)
            for code, frequency in zip(codes.tolist(), frequencies.tolist()):
                self.sparse[code] = self.sparse.get(code, 0) + frequency

    @classmethod
    def combined(cls, parts: Sequence[_PatternCounts]) -> _PatternCounts:
        total = parts[0]
        for part in parts[1:]:
            if total.dense is not None:
                total.dense += part.dense
            for code, frequency in part.sparse.items():
                total.sparse[code] = total.sparse.get(code, 0) + frequency
        return total

    def histograms(self) -> tuple[tuple[int, ...], ...]:
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


# PROVISIONAL: the two entry points of the kernel branch, over ram_merge, until it lands.
@dataclass(frozen=True)
class OverlapCounts:
    histograms: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class MergeResult:
    merged: torch.Tensor
    histograms: Optional[tuple[tuple[int, ...], ...]]


def count_overlaps(base, finetunes, epsilon, *, workers, chunk_elements=CHUNK_ELEMENTS):  # type: ignore[no-untyped-def]
    result = ram_merge(
        base, finetunes, epsilon, merge=False, count=True, workers=workers, chunk_elements=chunk_elements
    )
    return OverlapCounts(result.histograms or ())


def merge_tensors(
    base, finetunes, epsilon, lambdas=None, *, workers, count=False, out_dtype=None, chunk_elements=CHUNK_ELEMENTS
):  # type: ignore[no-untyped-def]
    result = ram_merge(
        base,
        finetunes,
        epsilon,
        lambdas,
        count=count,
        out_dtype=out_dtype,
        workers=workers,
        chunk_elements=chunk_elements,
    )
    return MergeResult(result.merged, result.histograms)
