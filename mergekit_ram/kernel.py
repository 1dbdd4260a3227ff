"""RAM / RAM+ tensor math (paper section 4, Algorithm 1). Knows torch only.

For one tensor with base ``theta_pre`` and fine-tunes ``theta_t``, ``t = 1..N``:

    tau_t = theta_t - theta_pre
    m_t   = |tau_t| > epsilon                   (strict, compared in float32)
    c     = sum_t m_t                           (how many models changed an element)
    tau_merged = 0                 where c == 0
               = lambda_t * tau_t  where c == 1 and m_t
               = mean of active tau where c >= 2
    theta_merged = theta_pre + tau_merged

All arithmetic is float32 whatever the input dtype; the result has the base's dtype.
The work runs over chunks of CHUNK_ELEMENTS elements: scratch is at most 24 bytes per
element of one chunk (3 MiB per worker thread; 28 bytes when RAM+ lambdas and statistics are
taken in one pass, as with pinned statistics), independent of the tensor's size and, up to 24
models, of N (beyond, the statistics pattern widens to 8 bytes); beyond it only the output is
allocated.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import math
import threading
from dataclasses import dataclass
from typing import Callable, Iterator, Literal, Optional, Sequence

import torch

Rule = Literal["clip", "soft"]

#: Histograms are gathered from a bit pattern per element (bit t set when model t is
#: active): float32 patterns up to 24 models (int64 beyond), counted as int16 up to 15
#: models, a bincount over 2**N bins up to 20.
_FLOAT_PATTERN_MAX_MODELS = 24
_INT16_MAX_MODELS = 15
_BINCOUNT_MAX_MODELS = 20
_PATTERN_MAX_MODELS = 62


def overlap_ratio(shared: int, unique: int) -> float:
    """rho_t = shared_t / unique_t.

    A model that changed nothing has rho = 0 (no unique update to scale); one whose
    every change is shared has rho = inf (lambda is then never used).
    """
    if unique == 0:
        return 0.0 if shared == 0 else math.inf
    return shared / unique


def rescale_factor(rho: float, r: float, alpha: float, rule: Rule) -> float:
    """lambda_t from rho_t.

    clip (RAM+, eq. 4):           1 + r * clip(rho, 0, alpha)
    soft (RAM+s, appendix E):     1 + r * rho / (1 + rho)
    """
    if rule == "clip":
        return 1.0 + r * min(max(rho, 0.0), alpha)
    if rule == "soft":
        return 1.0 + r * (1.0 if math.isinf(rho) else rho / (1.0 + rho))
    raise ValueError(f"unknown rescaling rule {rule!r}; expected 'clip' or 'soft'")


class NonFiniteInputError(ValueError):
    """An input holds NaN or Inf; ``index`` is the fine-tune's position, or None for the base."""

    def __init__(self, index: Optional[int]):
        self.index = index
        where = "base" if index is None else f"fine-tuned input {index}"
        super().__init__(f"{where} contains NaN or Inf")


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


def ram_merge(
    base: torch.Tensor,
    finetunes: Sequence[torch.Tensor],
    epsilon: float,
    lambdas: Optional[Sequence[float]] = None,
    *,
    merge: bool = True,
    count: bool = False,
    chunk_elements: int = CHUNK_ELEMENTS,
) -> KernelResult:
    """Merge one tensor group with the RAM rule, and/or count its overlap histograms.

    ``lambdas`` scales each model's unique updates (None or all ones: plain RAM).
    ``merge=False, count=True`` is the statistics pre-pass: same masks, no merge.
    The work runs over ``chunk_elements`` elements at a time.
    """
    n = len(finetunes)
    if lambdas is not None and len(lambdas) != n:
        raise ValueError(f"expected {n} lambda values, got {len(lambdas)}")
    for finetune in finetunes:
        if finetune.shape != base.shape:
            raise ValueError(f"shape {tuple(finetune.shape)} differs from the base's {tuple(base.shape)}")
    if count and n > _PATTERN_MAX_MODELS:
        raise ValueError(f"overlap statistics support at most {_PATTERN_MAX_MODELS} fine-tuned models, got {n}")

    if base.device.type != "cpu":
        chunk_elements = max(chunk_elements, DEVICE_CHUNK_ELEMENTS)
    flat_base = base.reshape(-1)
    flat_finetunes = [finetune.reshape(-1) for finetune in finetunes]
    numel = flat_base.numel()
    scale = list(lambdas) if merge and lambdas is not None and any(lam != 1.0 for lam in lambdas) else None
    merged = torch.empty_like(flat_base) if merge else None
    size = min(chunk_elements, max(numel, 1))

    def worker() -> tuple[_Scratch, Optional[_PatternCounts]]:
        scratch = _Scratch(size, n, flat_base, merge=merge, count=count, scale=scale)
        return scratch, _PatternCounts(n, base.device) if count else None

    def run(start: int, state: tuple[_Scratch, Optional[_PatternCounts]]) -> None:
        stop = min(start + chunk_elements, numel)
        pattern = state[0].run(
            flat_base[start:stop],
            [finetune[start:stop] for finetune in flat_finetunes],
            epsilon,
            merged[start:stop] if merged is not None else None,
        )
        if state[1] is not None:
            state[1].add(pattern)

    starts = range(0, numel, chunk_elements)
    with _chunk_workers(base.device, len(starts)) as workers:
        states = _map_chunks(run, worker, starts, workers)
    patterns = [counts for _, counts in states if counts is not None]
    return KernelResult(
        merged=merged.view(base.shape) if merged is not None else None,
        histograms=_PatternCounts.combined(patterns).histograms() if count else None,
    )


_THREADS_LOCK = threading.Lock()
_THREADS_HELD = 0
_THREADS_SAVED = 1


@contextlib.contextmanager
def _chunk_workers(device: torch.device, chunks: int) -> Iterator[int]:
    """How many threads should take chunks; torch's own intra-op threads are off meanwhile.

    Each chunk is a few dozen small elementwise ops. Under torch's intra-op parallelism
    every op is a fork and a join; on a busy machine a descheduled thread stalls each of
    them (measured 3-6x slower than one thread). So the kernel runs torch single-threaded
    and hands whole chunks to as many threads as torch was allowed (``--num-threads``).
    """
    global _THREADS_HELD, _THREADS_SAVED
    if device.type != "cpu" or chunks < 2:
        yield 1
        return
    with _THREADS_LOCK:
        if _THREADS_HELD == 0:
            _THREADS_SAVED = torch.get_num_threads()
            torch.set_num_threads(1)
        _THREADS_HELD += 1
        workers = _THREADS_SAVED
    try:
        yield min(workers, chunks)
    finally:
        with _THREADS_LOCK:
            _THREADS_HELD -= 1
            if _THREADS_HELD == 0:
                torch.set_num_threads(_THREADS_SAVED)


_POOLS: dict[int, concurrent.futures.ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def _pool(workers: int) -> concurrent.futures.ThreadPoolExecutor:
    """One long-lived pool per worker count: a merge calls the kernel once per tensor."""
    with _POOLS_LOCK:
        if workers not in _POOLS:
            _POOLS[workers] = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="mergekit-ram")
        return _POOLS[workers]


def _map_chunks(run: Callable, make_state: Callable, starts: Sequence[int], workers: int) -> list:
    """Run every chunk, each worker thread with its own scratch; the per-worker states."""
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

    futures = [_pool(workers).submit(task, start) for start in starts]
    try:
        for future in futures:
            future.result()
    finally:
        concurrent.futures.wait(futures)  # no chunk may still write once this returns or raises
    return states


class _Scratch:
    """Buffers for one chunk, reused across chunks; ``run`` applies the rule to one chunk.

    Masks, counts and patterns are float32 0/1 and small integers (exact below 2**24): this
    torch's CPU kernels for bool outputs and bool operands are several times slower than
    the float32 ones (measured per 2**17-element chunk: ``gt`` 57 vs 16 us, masking ``mul``
    94 vs 17 us, ``where`` 290 us vs ``lerp`` 23 us).
    """

    def __init__(
        self, size: int, n: int, like: torch.Tensor, *, merge: bool, count: bool, scale: Optional[list[float]]
    ) -> None:
        device = like.device
        self.n, self.merge, self.count, self.scale = n, merge, count, scale
        self.base32 = None if like.dtype == torch.float32 else torch.empty(size, device=device)
        self.tau = torch.empty(size, device=device)
        self.active = torch.empty(size, device=device)  # m_t as 0.0 / 1.0
        if merge:
            self.total = torch.empty(size, device=device)  # sum of active deltas
            self.counts = torch.empty(size, device=device)  # c
            # sum of lambda_t * active delta: where c == 1, the scaled unique update
            self.scaled = torch.empty(size, device=device) if scale else None
        if count:
            # bit t set when model t is active; float32 holds 24 bits exactly
            dtype = torch.float32 if n <= _FLOAT_PATTERN_MAX_MODELS else torch.int64
            self.pattern = torch.empty(size, dtype=dtype, device=device)

    def run(
        self, base: torch.Tensor, finetunes: Sequence[torch.Tensor], epsilon: float, out: Optional[torch.Tensor]
    ) -> Optional[torch.Tensor]:
        """Merge one chunk into ``out``; the chunk's integer activity pattern if counting."""
        length = base.numel()
        if self.base32 is None:
            base32 = base
        else:
            base32 = self.base32[:length]
            base32.copy_(base)
        tau, active = self.tau[:length], self.active[:length]
        if self.merge:
            total, counts = self.total[:length], self.counts[:length]
            scaled = self.scaled[:length] if self.scaled is not None else None
        pattern = self.pattern[:length] if self.count else None
        if pattern is not None and not finetunes:
            pattern.zero_()

        for index, finetune in enumerate(finetunes):
            torch.sub(finetune, base32, out=tau)
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
            finite = not finetunes or math.isfinite(total.sum().item())
            if not finite:
                _check_finite(base, finetunes)  # raises for NaN / Inf inputs; else an overflow
            if not finetunes:
                total.zero_()
                counts.zero_()
            # Mean over active models; c == 1 divides by one, c == 0 leaves total at zero.
            total.div_(counts.clamp_(min=1))
            if scaled is not None:
                # c == 1 (or 0, where both are zero) takes the scaled update
                torch.eq(counts, 1, out=active)
                if finite and math.isfinite(scaled.sum().item()):
                    # lerp with a weight of exactly 0 or 1 returns one of its ends unchanged
                    torch.lerp(total, scaled, active, out=total)
                else:  # an overflow to inf: lerp would make inf - inf = NaN of it
                    torch.where(active.bool(), scaled, total, out=total)
            if out.dtype == torch.float32:
                torch.add(total, base32, out=out)
            else:
                out.copy_(total.add_(base32))
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
    if not bool(torch.isfinite(base).all()):
        raise NonFiniteInputError(None)
    for index, finetune in enumerate(finetunes):
        if not bool(torch.isfinite(finetune).all()):
            raise NonFiniteInputError(index)
