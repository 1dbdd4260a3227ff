"""RAM / RAM+ tensor math (paper section 4, Algorithm 1) and its TIES and unique-only variants. Knows torch only.

For base ``theta_pre`` and fine-tunes ``theta_t``, t = 1..N, in ``compute_dtype`` of the inputs, the result
rounded once to the output dtype (finite inputs that give NaN or Inf: ``MergeOverflowError``):

    tau_t = theta_t - theta_pre,   m_t = |tau_t| > epsilon,   c = sum_t m_t
    tau_merged = 0 where c == 0,  lambda_t * tau_t where c == 1 and m_t,  the shared rule where c >= 2
    theta_merged = theta_pre + tau_merged

Shared rules: "mean" the mean of the active updates; "base" 0; "ties": per model, its updates at the P
shared positions (0 where inactive) are kept where their magnitude is at least the k-th smallest of them,
k = floor(P * (1 - density)); per position the sign of (sum of kept positive) - (sum of kept negative
magnitudes) is elected (none where 0), and tau_merged is the mean of the kept entries of that sign.

The same torch operations run on chunks of the flat tensors, into buffers reused from chunk to chunk (scratch
bounded by the chunk, not the tensor: peak memory 2.14x -> 0.55x of ``task_arithmetic``'s, docs/performance.md),
on one intra-op thread on CPU (``_one_thread``); or, where an input requires grad, once on the whole tensors, so that
torch's autograd differentiates them. Masks and counts are 0.0 / 1.0 and small integers in the arithmetic dtype, which
multiply exactly; sums masked by multiplication keep a NaN input visible (NaN * 0 is NaN).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Literal, NamedTuple, Optional, Sequence, get_args

import torch
from torch import Tensor

#: Elements per step: the scratch of the two 2**17-element workers before; ``ram`` alone on 16M elements, 2 loaded
#: cores: 12.4 / 7.7 / 6.2 / 6.2 / 9.1 ns per element for chunks of 2**16 to 2**20 (docs/performance.md).
CHUNK_ELEMENTS = 1 << 18
#: On an accelerator each op is a kernel launch: larger chunks, still bounded scratch.
_DEVICE_CHUNK_ELEMENTS = 1 << 24
#: The radix select of the TIES thresholds reads 16 bits of the magnitudes per pass.
_DIGIT_BITS = 16
#: Up to this many models the tally is one bincount of the activity patterns (2**N of them), above it a product.
_PATTERN_MODELS = 16

#: The shared region's rule: the mean (ram, ram_plus), TIES (ram_ties), the base's value (ram_unique).
SharedRule = Literal["mean", "ties", "base"]
Histograms = tuple[tuple[int, ...], ...]


class NonFiniteInputError(ValueError):
    """An input holds NaN or Inf; ``index`` is the fine-tune's position, or None for the base."""

    def __init__(self, index: Optional[int], value: Literal["NaN", "Inf"] = "NaN"):
        self.index, self.value = index, value
        where = "base" if index is None else f"fine-tuned input {index}"
        super().__init__(f"{where} contains {value}")


class MergeOverflowError(ValueError):
    """Finite inputs, a NaN or Inf result: ``dtype`` is where it overflowed, the arithmetic dtype, or the output
    dtype where only the rounding to it did; ``index``: the fine-tune whose update itself overflows, if one does."""

    def __init__(self, dtype: torch.dtype, index: Optional[int] = None):
        self.dtype, self.index = dtype, index
        name = str(dtype).removeprefix("torch.")
        if index is None:
            super().__init__(f"the merged values do not fit {name}")
        else:
            super().__init__(f"the update of fine-tuned input {index} (minus the base) does not fit {name}")


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


class _Plan(NamedTuple):
    """What one merge computes, beside the inputs."""

    epsilon: float
    dtype: torch.dtype  # the arithmetic dtype
    scales: Optional[tuple[float, ...]]  # lambda_t of the unique updates; None: all 1
    shared: SharedRule
    kept_from: tuple[float, ...]  # "ties": per model, the smallest kept magnitude (> epsilon)
    counting: bool
    chunk_elements: int


class _Scratch:
    """Buffers of one chunk by name, allocated on first use and reused by every chunk; or, ``reuse`` False (whole
    tensors under autograd, which needs every value it saved), None for every name: each op allocates."""

    def __init__(self, size: int, dtype: torch.dtype, device: torch.device, reuse: bool = True):
        self.size, self.dtype, self.device, self.reuse = size, dtype, device, reuse
        self.start, self.length = 0, size
        self._buffers: dict[str, Tensor] = {}

    def __call__(self, name: str, rows: int = 0, dtype: Optional[torch.dtype] = None) -> Optional[Tensor]:
        """The buffer ``name`` for the chunk's length (``rows`` > 0: that many rows of it, contiguous), in ``dtype``
        (default the scratch's)."""
        if not self.reuse:
            return None
        buffer = self._buffers.get(name)
        if buffer is None:
            size, dtype = max(rows, 1) * self.size, dtype or self.dtype
            buffer = self._buffers[name] = torch.empty(size, dtype=dtype, device=self.device)
        return buffer[: rows * self.length].view(rows, self.length) if rows else buffer[: self.length]


def count_overlaps(
    base: Tensor, finetunes: Sequence[Tensor], epsilon: float, *, chunk_elements: int = CHUNK_ELEMENTS
) -> OverlapCounts:
    """The overlap histograms of one tensor group with the merge's masks, without merging (the pre-pass)."""
    _check_shapes(base, finetunes)
    n = len(finetunes)
    dtype = compute_dtype(base.dtype, *(finetune.dtype for finetune in finetunes))
    with torch.no_grad(), _one_thread(base.device):
        tally = _zero_tally(n, base.device)
        for scratch, base_chunk, chunks in _chunks(base, finetunes, dtype, chunk_elements) if n else ():
            magnitudes = _magnitudes(scratch, base_chunk, chunks, dtype)
            if not math.isfinite(magnitudes.sum().item()):  # a NaN or Inf input; a finite sum may overflow
                _check_finite(base_chunk, chunks, chunk_elements)
            tally += _tally(torch.gt(magnitudes, epsilon, out=magnitudes), scratch)
        return OverlapCounts(histograms=_histograms(tally, n))


def merge_tensors(
    base: Tensor,
    finetunes: Sequence[Tensor],
    epsilon: float,
    lambdas: Optional[Sequence[float]] = None,
    *,
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
    _check_shapes(base, finetunes)
    dtype = compute_dtype(base.dtype, *(finetune.dtype for finetune in finetunes))
    scales = None if lambdas is None or all(lam == 1.0 for lam in lambdas) else tuple(lambdas)
    if scales is not None and not all(abs(lam) <= torch.finfo(dtype).max for lam in scales):
        raise MergeOverflowError(dtype)  # every update scaled to Inf
    detached = [finetune.detach() for finetune in finetunes]
    with _one_thread(base.device):
        ties = shared == "ties"
        kept_from = _ties_thresholds(base.detach(), detached, epsilon, density, dtype, chunk_elements) if ties else ()
    plan = _Plan(epsilon, dtype, scales, shared, kept_from, count, chunk_elements)
    out_dtype = out_dtype or base.dtype
    if torch.is_grad_enabled() and any(tensor.requires_grad for tensor in (base, *finetunes)):
        scratch = _Scratch(base.numel(), dtype, base.device, reuse=False)
        result, _ = _merge_chunk(base, finetunes, plan._replace(counting=False), scratch)
        merged = result.to(out_dtype)
        _check_result(merged, result, base.detach(), detached, chunk_elements)
        histograms = count_overlaps(base.detach(), detached, epsilon).histograms if count else None
        return MergeResult(merged=merged.view(base.shape), histograms=histograms)
    with torch.no_grad(), _one_thread(base.device):
        merged = torch.empty(base.numel(), dtype=out_dtype, device=base.device)
        tally = _zero_tally(n, base.device)
        for scratch, base_chunk, chunks in _chunks(base.detach(), detached, dtype, chunk_elements):
            result, counted = _merge_chunk(base_chunk, chunks, plan, scratch)
            out = merged[scratch.start : scratch.start + scratch.length]
            out.copy_(result)
            if not math.isfinite(out.sum(dtype=dtype).item()):  # a finite sum may overflow
                _check_result(out, result, base.detach(), detached, chunk_elements)
            if counted is not None:
                tally += counted
        return MergeResult(merged=merged.view(base.shape), histograms=_histograms(tally, n) if count else None)


def _check_shapes(base: Tensor, finetunes: Sequence[Tensor]) -> None:
    """Every fine-tune has the base's shape."""
    for finetune in finetunes:
        if finetune.shape != base.shape:
            raise ValueError(f"shape {tuple(finetune.shape)} differs from the base's {tuple(base.shape)}")


@contextmanager
def _one_thread(device: torch.device) -> Iterator[None]:
    """On CPU, the chunk loop on one intra-op thread: a chunk is a dozen small operations, and torch would fork and
    join its threads for each, which on a busy machine waits a time slice per operation (docs/performance.md).
    torch's setting, which is the calling thread's, is restored after; an accelerator keeps it."""
    threads = torch.get_num_threads()
    if device.type != "cpu" or threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _chunks(
    base: Tensor, finetunes: Sequence[Tensor], dtype: torch.dtype, chunk_elements: int
) -> Iterator[tuple[_Scratch, Tensor, list[Tensor]]]:
    """The flat group chunk by chunk, with one scratch for all (``scratch.start``, ``.length``: the chunk's)."""
    flat_base = base.reshape(-1)
    flat_finetunes = [finetune.reshape(-1) for finetune in finetunes]
    numel = flat_base.numel()
    if base.device.type != "cpu":
        chunk_elements = max(chunk_elements, _DEVICE_CHUNK_ELEMENTS)
    scratch = _Scratch(min(chunk_elements, numel), dtype, base.device)
    for start in range(0, numel, chunk_elements):
        chunk = slice(start, min(start + chunk_elements, numel))
        scratch.start, scratch.length = start, chunk.stop - start
        yield scratch, flat_base[chunk], [finetune[chunk] for finetune in flat_finetunes]


def _magnitudes(o: _Scratch, base_chunk: Tensor, chunks: Sequence[Tensor], dtype: torch.dtype) -> Tensor:
    """|tau_t| = |theta_t - theta_pre| of one chunk in ``dtype``, a row per model, in the scratch's "masks"."""
    base_c = _cast(base_chunk, dtype, o("base"))
    magnitudes = o("masks", len(chunks))
    assert magnitudes is not None
    for index, finetune in enumerate(chunks):  # cast, then subtract: a mixed bf16 - f32 op is 2.3x slower
        magnitudes[index].copy_(finetune).sub_(base_c).abs_()
    return magnitudes


def _cast(tensor: Tensor, dtype: torch.dtype, out: Optional[Tensor]) -> Tensor:
    """``tensor`` in ``dtype``: itself where it is, else its copy (into ``out``, if any)."""
    if tensor.dtype == dtype:
        return tensor
    return tensor.to(dtype) if out is None else out.copy_(tensor)


def _accumulate(
    total: Optional[Tensor], value: Tensor, mask: Optional[Tensor], scale: float, out: Optional[Tensor]
) -> Tensor:
    """``total + scale * value * mask``; the first model's (``total`` None) ``value * (mask * scale)`` into ``out``
    (so that its gradient is ``g * (mask * scale)``: 0, not Inf * 0, where inactive)."""
    if total is not None:
        return total.add_(value) if mask is None else total.addcmul_(value, mask, value=scale)
    if mask is None:
        return value.clone() if out is None else out.copy_(value)
    if scale != 1.0:
        mask = torch.mul(mask, scale, out=out)
    return torch.mul(value, mask, out=out)


def _merge_chunk(
    base: Tensor, finetunes: Sequence[Tensor], plan: _Plan, scratch: _Scratch
) -> tuple[Tensor, Optional[Tensor]]:
    """theta_pre + tau_merged of one chunk (or of whole tensors) in the arithmetic dtype, and its tally if counting."""
    n, o = len(finetunes), scratch
    base_c = _cast(base, plan.dtype, o("base"))
    if not n:
        return torch.add(base_c, 0.0, out=o("tau")), None
    rows = o("masks", n) if plan.counting else None  # counting: every model's mask
    c = unique = total = None
    kept: list[Optional[Tensor]] = [None] * 4  # sums of the kept positive and negative entries, their counts
    for index, finetune in enumerate(finetunes):
        tau = torch.sub(_cast(finetune, plan.dtype, o("tau")), base_c, out=o("tau"))
        mask = o("mask") if rows is None else rows[index]
        active = torch.gt(torch.abs(tau, out=mask), plan.epsilon, out=mask).to(plan.dtype)
        c = _accumulate(c, active, None, 1.0, o("c"))
        if plan.shared == "mean" and plan.scales:
            total = _accumulate(total, tau, active, 1.0, o("total"))
        unique = _accumulate(unique, tau, active, plan.scales[index] if plan.scales else 1.0, o("unique"))
        for sign, compare, bound in ((0, torch.ge, 1.0), (1, torch.le, -1.0)) if plan.kept_from else ():
            keep = compare(tau, bound * plan.kept_from[index], out=o("mask")).to(plan.dtype)  # > epsilon: active
            kept[sign] = _accumulate(kept[sign], tau, keep, 1.0, o(f"kept{sign}"))
            kept[sign + 2] = _accumulate(kept[sign + 2], keep, None, 1.0, o(f"kept{sign + 2}"))
    assert c is not None and unique is not None
    counted = _tally(rows, o) if rows is not None else None
    return _combine(plan, c, unique, total, kept, base, finetunes, o).add_(base_c), counted


def _combine(
    plan: _Plan,
    c: Tensor,
    unique: Tensor,
    total: Optional[Tensor],
    kept: list[Optional[Tensor]],
    base: Tensor,
    finetunes: Sequence[Tensor],
    o: _Scratch,
) -> Tensor:
    """tau_merged from the sums (overwritten) of the lambda-scaled ``unique`` and, for the shared rule, the unscaled
    ``total`` or the ``kept`` entries; with w = [c <= 1], shared - shared * w + unique * w: exact for w 0 and 1,
    never inf - inf from finite operands; where ``unique`` is not finite, selected."""
    count = c.clamp_(min=1)
    shared: Optional[Tensor] = None
    if plan.shared == "mean":
        shared = (unique if total is None else total).div_(count)
        if total is None:  # every lambda 1: where c == 1 the unique update divided by one
            return shared
    elif plan.shared == "ties":  # the mean of the kept entries of the elected sign, else 0
        positive, negative, positives, negatives = (sums for sums in kept if sums is not None)
        elected = torch.add(positive, negative, out=o("tau"))
        positive = positive.div_(positives.clamp_(min=1))
        negative = negative.div_(negatives.clamp_(min=1))
        positive.mul_(torch.gt(elected, 0, out=o("mask")).to(plan.dtype))
        shared = positive.addcmul_(negative, torch.lt(elected, 0, out=o("mask")).to(plan.dtype))
    weight = torch.eq(count, 1, out=o("mask")).to(plan.dtype)
    if math.isfinite(unique.sum().item()):
        if shared is None:
            return unique.mul_(weight)
        return shared.addcmul_(shared, weight, value=-1.0).addcmul_(unique, weight)
    _check_finite(base.detach(), [finetune.detach() for finetune in finetunes], plan.chunk_elements)
    chosen = weight.bool()
    if shared is None:
        return unique.masked_fill_(~chosen, 0.0)
    return torch.where(chosen, unique, shared, out=o("tau"))


def _zero_tally(n: int, device: torch.device) -> Tensor:
    """The empty tally of ``n`` models: 2**n pattern counts, or above ``_PATTERN_MODELS`` the n x n histograms."""
    return torch.zeros(1 << n if n <= _PATTERN_MODELS else (n, n), dtype=torch.int64, device=device)


def _tally(masks: Tensor, o: _Scratch) -> Tensor:
    """One chunk's tally from its masks (n rows of 0.0 / 1.0): how many elements have each pattern code sum_t 2**t
    m_t, one bincount (exact: codes below 2**16); above ``_PATTERN_MODELS`` models, ``tally[t][k - 1]`` = sum_i
    m_t,i [c_i == k], the masks times each k's indicator (exact: sums of ones, fewer than 2**24)."""
    n = masks.shape[0]
    if n <= _PATTERN_MODELS:
        code = o("code")
        assert code is not None  # counted on chunks only
        code.copy_(masks[0])
        for index in range(1, n):
            code.add_(masks[index], alpha=1 << index)
        return torch.bincount(_cast(code, torch.int32, o("codes", dtype=torch.int32)), minlength=1 << n)
    c = torch.sum(masks, 0, out=o("c"))
    levels = torch.arange(1, n + 1, dtype=c.dtype, device=c.device).view(n, 1)
    return torch.mm(masks, torch.eq(c, levels, out=o("indicators", n)).T).to(torch.int64)


def _histograms(tally: Tensor, n: int) -> Histograms:
    """The tally as plain integers, ``histograms[t][k - 1]``; from pattern counts, each pattern's count added to
    the models in it at its number of models."""
    if tally.dim() == 1:
        patterns = torch.arange(tally.numel(), device=tally.device)
        members = patterns.view(-1, 1).bitwise_right_shift(torch.arange(n, device=tally.device)).bitwise_and_(1)
        levels = members.sum(1)
        histograms = torch.zeros((n, n + 1), dtype=torch.int64, device=tally.device)
        for index in range(n):
            histograms[index].index_add_(0, levels, tally * members[:, index])
        tally = histograms[:, 1:]
    return tuple(tuple(row) for row in tally.tolist())


def _check_finite(base: Tensor, finetunes: Sequence[Tensor], chunk_elements: int) -> None:
    """Name the input holding NaN or Inf in the first chunk that holds one, the base first: as the merge meets it."""
    for _, base_chunk, chunks in _chunks(base, finetunes, base.dtype, chunk_elements):
        for index, tensor in [(None, base_chunk), *enumerate(chunks)]:
            if not bool(torch.isfinite(tensor).all()):
                raise NonFiniteInputError(index, "NaN" if bool(torch.isnan(tensor).any()) else "Inf")


def _check_result(out: Tensor, result: Tensor, base: Tensor, finetunes: Sequence[Tensor], chunk_elements: int) -> None:
    """Raise where ``out`` (``result`` rounded) holds NaN or Inf: for an input that does, wherever in the group (an
    input's NaN before any overflow), else for the overflow."""
    if bool(torch.isfinite(out).all()):
        return
    _check_finite(base, finetunes, chunk_elements)
    if bool(torch.isfinite(result).all()):
        raise MergeOverflowError(out.dtype)
    raise MergeOverflowError(result.dtype, _overflowing_update(base, finetunes, result.dtype, chunk_elements))


def _overflowing_update(
    base: Tensor, finetunes: Sequence[Tensor], dtype: torch.dtype, chunk_elements: int
) -> Optional[int]:
    """The first fine-tune whose update theta_t - theta_pre (finite inputs) overflows ``dtype`` in the first chunk
    where one does; None where every update fits."""
    for o, base_chunk, chunks in _chunks(base, finetunes, dtype, chunk_elements):
        overflowing = (~torch.isfinite(_magnitudes(o, base_chunk, chunks, dtype))).any(1).nonzero()
        if overflowing.numel():
            return int(overflowing[0])
    return None


def _ties_thresholds(
    base: Tensor, finetunes: Sequence[Tensor], epsilon: float, density: float, dtype: torch.dtype, chunk_elements: int
) -> tuple[float, ...]:
    """Per model, the k-th smallest of |tau_t| m_t at the P shared positions (c >= 2), k = floor(P (1 - density)),
    raised above epsilon (every active entry where k == 0). Exact: non-negative floats order as their bits, found
    16 at a time by a radix select, a pass over the chunks per 16 bits. Kept against gathering each model's shared
    entries for torch.kthvalue, side by side through mergekit-yaml on 2 loaded cores: 120m 13.5 s against 14.1 s
    (1.04x) with a peak anonymous memory of 574 MiB against 1109 MiB (1.93x); 500m 32.7 s against 35.1 s (1.07x),
    1283 MiB against 1835 MiB (1.43x). No 1.2x in time, but the plain version holds every shared entry: its peak is
    above the kernel's before (588 / 1322 MiB), the radix select's below it (docs/performance.md)."""
    n = len(finetunes)
    finfo = torch.finfo(dtype)
    above = torch.nextafter(torch.tensor(max(epsilon, 0.0), dtype=dtype), torch.tensor(math.inf, dtype=dtype))
    prefixes, ranks, shared = [0] * n, [0] * n, 0
    for shift in range(finfo.bits - _DIGIT_BITS, -1, -_DIGIT_BITS) if density < 1.0 and n else ():
        tables, counted = _digit_tables(base, finetunes, epsilon, dtype, chunk_elements, shift, prefixes)
        if shift == finfo.bits - _DIGIT_BITS:
            shared = counted
            ranks = [math.floor(shared * (1.0 - density))] * n
            if ranks[0] == 0:  # P == 0 or k == 0: nothing trimmed
                break
        for index in range(n):
            if prefixes[index] == 0:  # the unshared positions read as zeros there: not entries
                tables[index, 0] -= base.numel() - shared
            below = tables[index].cumsum(0)  # the digit of the ranks[index]-th smallest entry (1-based)
            digit = int(torch.searchsorted(below, ranks[index]))
            ranks[index] -= int(below[digit - 1]) if digit else 0
            prefixes[index] = prefixes[index] << _DIGIT_BITS | digit
            del below  # one table at a time
        del tables  # freed before the next pass allocates its own
    bits = torch.int32 if finfo.bits == 32 else torch.int64
    return tuple(max(torch.tensor(prefix, dtype=bits).view(dtype).item(), above.item()) for prefix in prefixes)


def _digit_tables(
    base: Tensor,
    finetunes: Sequence[Tensor],
    epsilon: float,
    dtype: torch.dtype,
    chunk_elements: int,
    shift: int,
    prefixes: list[int],
) -> tuple[Tensor, int]:
    """Per model, the histogram of the digit ``(bits >> shift) & 0xFFFF`` of |tau_t| at the shared positions (0
    elsewhere) among those under its prefix; and P, counted on the first pass (0 on the others). Inactive entries
    count too: at most epsilon, they change the k-th smallest only where it is raised above epsilon anyway."""
    n, width = len(finetunes), (1 << _DIGIT_BITS) + 2  # digit + 1; 0 below the prefix, 2**16 + 1 above it
    key_dtype = torch.int32 if dtype == torch.float32 else torch.int64
    first = shift == torch.finfo(dtype).bits - _DIGIT_BITS
    below = torch.tensor([(prefix << _DIGIT_BITS) - 1 for prefix in prefixes], dtype=key_dtype, device=base.device)
    tables = torch.zeros((n, width), dtype=torch.int64, device=base.device)
    shared = 0
    with torch.no_grad():
        for o, base_chunk, chunks in _chunks(base, finetunes, dtype, chunk_elements):
            magnitudes = _magnitudes(o, base_chunk, chunks, dtype)
            if first and not math.isfinite(magnitudes.sum().item()):  # a finite sum may overflow
                _check_finite(base, finetunes, chunk_elements)  # NaN or Inf keys would not order
                index = _overflowing_update(base_chunk, chunks, dtype, chunk_elements)
                if index is not None:
                    raise MergeOverflowError(dtype, index)  # an update, before any trimming
            c = None
            for magnitude in magnitudes:
                c = _accumulate(c, torch.gt(magnitude, epsilon, out=o("mask")), None, 1.0, o("c"))
            assert c is not None
            sharing = torch.ge(c, 2, out=c)
            if first:
                shared += int(sharing.sum().item())
            keys = magnitudes.mul_(sharing).view(key_dtype).bitwise_right_shift_(shift)
            keys.sub_(below.view(n, 1)).clamp_(0, width - 1)
            for index in range(n):
                tables[index] += torch.bincount(keys[index], minlength=width)
    return tables[:, 1:-1], shared
