"""The bucket advisor: which bucket lengths make a run fastest, and why.

Padding to a few fixed lengths (``tpukit.data.BucketBatcher``) trades two costs:
every bucket is one more graph to compile, and every padded token slot is
computed for nothing. :func:`suggest_buckets` picks the set of lengths that
minimises the expected training time for a histogram of example lengths,
under a stated cost model; :func:`evaluate_buckets` applies the same model to a
set you chose. Both return a :class:`BucketAdvice`, whose ``explain()`` says in
one line what the set costs and why it has no more buckets.

Cost model (seconds): every example is trained on, each bucket's examples in
``ceil(n / batch_size)`` steps of shape ``(batch_size, bucket length)``, a partial
last batch padded to the full batch so the shape never changes; a step at
length L takes ``step_time(L)``, by default ``step_overhead_s + token_s x
batch_size x L``; each bucket that gets a batch compiles one graph,
``compile_s``, once per run::

    expected time = epochs x sum over buckets of steps x step_time(length) + buckets x compile_s

Costs that do not depend on the buckets (the optimizer's first step) are left
out. The search is exact: dynamic programming over the candidate lengths.

Plain Python over lengths: no torch, no device. ``tpukit.data`` re-exports the
advisor, so ``tpukit.data.suggest_buckets`` keeps working.
"""

from __future__ import annotations

import bisect
import math
import operator
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._text import plural
from .errors import DataError

# Defaults: MiniLM-L6 BERT training (AdamW, batch 16) on 2 idle XLA:CPU cores, measured by bench/advisor.py:
# a step takes 0.53 s at 16 tokens and 1.14 s at 64, a new bucket 15 s to compile. On a TPU steps are far
# cheaper while compiles are not, which favours more buckets: measure there and pass the costs.
DEFAULT_COMPILE_S = 15.0
DEFAULT_TOKEN_S = 8e-4  # per padded token slot
DEFAULT_STEP_OVERHEAD_S = 0.3  # per step, whatever its length


@dataclass(frozen=True)
class BucketAdvice:
    """Bucket lengths and their expected cost; pass ``buckets`` to ``BucketBatcher(..., buckets=...)``.

    Times are seconds over ``epochs`` epochs: ``step_s`` running the steps
    (``padding_s`` of it spent on padding slots), ``compile_s`` compiling one graph
    per used bucket. ``waste`` counts the empty rows of a padded last batch too.
    """

    buckets: tuple[int, ...]
    batch_size: int
    epochs: int
    examples_per_bucket: tuple[int, ...]
    steps_per_bucket: tuple[int, ...]  # per epoch
    step_times: tuple[float, ...]  # seconds per step at each bucket length
    compile_time: float  # seconds per compiled graph
    tokens: int  # real tokens per epoch
    slots: int  # token slots fed per epoch: batch_size x bucket length per step
    step_s: float
    padding_s: float
    compile_s: float
    max_buckets: int | None = None  # the advisor's cap; None when the buckets were given, not chosen
    more_saves_s: float | None = None  # step time the best set with one more bucket saves; None: none possible

    @property
    def total_s(self) -> float:
        """Expected time: steps plus compiles."""
        return self.step_s + self.compile_s

    @property
    def compiles(self) -> int:
        """Graphs compiled: one per bucket that gets at least one batch."""
        return sum(1 for s in self.steps_per_bucket if s)

    @property
    def steps(self) -> int:
        """Steps per epoch."""
        return sum(self.steps_per_bucket)

    @property
    def waste(self) -> float:
        """Fraction of the token slots that are padding."""
        return 1 - self.tokens / self.slots if self.slots else 0.0

    @property
    def dropped(self) -> int:
        """Examples ``BucketBatcher(drop_last=True)`` leaves out of an epoch (each bucket's partial batch)."""
        return sum(n % self.batch_size for n in self.examples_per_bucket)

    def explain(self) -> str:
        """One line: the buckets, their padding and compiles, and why not one more bucket."""
        epochs = "" if self.epochs == 1 else f" over {self.epochs} epochs"
        head = (f"{plural(len(self.buckets), 'bucket')} {list(self.buckets)}: {self.waste:.0%} padding, "
                f"{plural(self.compiles, 'compile')}, expected {_s(self.total_s)}{epochs} ({_s(self.step_s)} of steps, "
                f"{_s(self.padding_s)} of it padding; {_s(self.compile_s)} compiling)")
        if self.max_buckets is None:
            return head
        nth = _ordinal(len(self.buckets) + 1)
        if self.more_saves_s is None:
            return head + f"; no {nth} bucket is possible: every distinct length already has its own"
        saves, costs = _s(self.more_saves_s), _s(self.compile_time)
        if saves == costs:  # a near tie: show the digit that decides it
            saves, costs = f"{self.more_saves_s:.1f} s", f"{self.compile_time:.1f} s"
        if self.more_saves_s > self.compile_time:
            return (head + f"; a {nth} bucket would save {saves} of padding and cost only {costs} to compile: "
                    f"raise max_buckets={self.max_buckets} to get it")
        return head + f"; a {nth} bucket would save {saves} of padding but cost {costs} to compile"


def _s(x: float) -> str:
    return f"{x:.1f} s" if abs(x) < 10 else f"{x:.0f} s"


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _check_lengths(lengths: Iterable[int], max_length: int | None) -> Counter:
    """The lengths' histogram ``{length: examples}``, once every length is checked to be a whole number >= 0."""
    try:
        hist = Counter(map(operator.index, lengths))  # int-like only: 3.0 or 3.5 is refused, not rounded
    except TypeError:
        raise DataError("lengths must be whole numbers (tokens per example, ints), e.g. "
                        "[len(ids) for ids in tokenized['input_ids']]; floats are refused, not rounded.") from None
    if not hist:
        raise DataError("lengths is empty: there is nothing to bucket. Pass one length per training example.")
    if min(hist) < 0:
        raise DataError(f"lengths has a negative value ({min(hist)}); a length counts tokens, so it is >= 0.")
    if max_length is not None:
        if max_length < 1:
            raise DataError(f"max_length must be >= 1, got {max_length}.")
        over = {n: m for n, m in hist.items() if n > max_length}
        if over:
            count = sum(over.values())
            raise DataError(f"{plural(count, 'example')} {'is' if count == 1 else 'are'} longer than "
                            f"max_length={max_length} (longest {max(over)}): truncate when tokenizing "
                            f"(truncation=True, max_length={max_length}) or raise max_length.")
    return hist


def _check_int(name: str, value: int, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise DataError(f"{name} must be a whole number >= {low}, got {value!r}.")
    return value


def _step_model(batch_size: int, token_s: float | None, step_overhead_s: float | None,
                step_time: Callable[[int], float] | Mapping[int, float] | None) -> Callable[[int], float]:
    """Seconds per step of ``batch_size`` x ``length`` tokens, from the given or default costs."""
    if step_time is not None:
        if token_s is not None or step_overhead_s is not None:
            raise DataError("give either step_time or token_s/step_overhead_s, not both: step_time already says "
                            "what a step costs at each length.")
        if isinstance(step_time, Mapping):
            return _interpolate(step_time)
        if not callable(step_time):
            raise DataError("step_time must be a function length -> seconds per step, or a dict of measured "
                            "{length: seconds per step}.")
        return step_time
    tok = DEFAULT_TOKEN_S if token_s is None else float(token_s)
    over = DEFAULT_STEP_OVERHEAD_S if step_overhead_s is None else float(step_overhead_s)
    if tok < 0 or over < 0:
        raise DataError(f"token_s and step_overhead_s are times, so >= 0 (got {tok}, {over}).")
    return lambda length: over + tok * batch_size * length


def _interpolate(points: Mapping[int, float]) -> Callable[[int], float]:
    """Piecewise-linear step time through measured ``{length: seconds}``, extended by its end segments.

    Made non-decreasing (a longer step is never cheaper), which keeps the advisor's search exact.
    """
    pts = sorted((int(k), float(v)) for k, v in points.items())
    if not pts or pts[0][0] < 1 or any(v < 0 for _, v in pts):
        raise DataError("step_time as a dict needs at least one measured {length >= 1: seconds >= 0}.")
    xs, ys = [x for x, _ in pts], []
    for _, v in pts:
        ys.append(max(v, ys[-1]) if ys else v)
    if len(pts) == 1:
        return lambda length: ys[0] * length / xs[0]

    def f(length: int) -> float:
        i = max(1, min(len(xs) - 1, next((k for k, x in enumerate(xs) if x >= length), len(xs) - 1)))
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return max(0.0, y0 + (y1 - y0) * (length - x0) / (x1 - x0))

    return f


def _advice(hist: Mapping[int, int], batch_size: int, buckets: Sequence[int], step: Callable[[int], float],
            compile_time: float, epochs: int, **extra: Any) -> BucketAdvice:
    """The cost model applied to one bucket set (lengths over the last bucket are truncated to it).

    ``hist``: the lengths' histogram ``{length: examples}``, so the work grows with the distinct lengths.
    """
    bs = sorted({int(b) for b in buckets})
    counts, fill = Counter(), Counter()  # examples and real tokens per bucket
    for n, m in hist.items():
        b = bs[min(bisect.bisect_left(bs, n), len(bs) - 1)]  # bucket_for, without re-sorting per length
        counts[b] += m
        fill[b] += m * min(n, b)
    n_ex = tuple(counts[b] for b in bs)
    n_steps = tuple(math.ceil(n / batch_size) for n in n_ex)
    times = tuple(float(step(b)) for b in bs)
    if any(not math.isfinite(t) or t < 0 for t in times):
        raise DataError(f"step_time gave {list(times)} s for lengths {bs}: a step time must be finite and >= 0.")
    slots = [s * batch_size * b for s, b in zip(n_steps, bs)]
    step_s = epochs * sum(s * t for s, t in zip(n_steps, times))
    # padding's share of a bucket's step time is its share of the bucket's token slots
    padding_s = epochs * sum(s * t * (1 - fill[b] / n) for s, t, b, n in zip(n_steps, times, bs, slots) if n)
    return BucketAdvice(tuple(bs), batch_size, epochs, n_ex, n_steps, times, compile_time, sum(fill.values()),
                        sum(slots), step_s, padding_s, compile_time * sum(1 for s in n_steps if s), **extra)


_CHUNK = 256  # columns (bucket candidates) per block of the cost table
_KEEP_CELLS = 8 << 20  # blocks up to this many cells in all (64 MiB) are kept for every level, else remade


def _search(counts: list[int], times: list[float], batch_size: int, epochs: int,
            levels: int) -> tuple[list[list[float]], list[list[int]]]:
    """The advisor's dynamic programme over candidate lengths (``counts[i]`` examples round up to the
    i-th, a step there takes ``times[i]``), for 1..``levels`` buckets.

    ``best[k-1][j]``: least step time covering candidates 0..j with k buckets, the last at j;
    ``back[k-1][j]``: the first candidate of that last bucket. A bucket at j holding candidates
    a..j costs ``epochs x ceil(examples / batch_size) x times[j]``. Vectorised over (a, j) with numpy,
    in blocks of columns: the same sums in the same order as plain loops (``best[k-2][a-1] + cost``),
    ties to the smallest a, so the result is identical; the work is levels x d^2 / 2 array cells.
    """
    d, inf = len(counts), float("inf")
    before = np.zeros(d + 1, dtype=np.int64)  # before[i]: examples whose rounded length is below candidate i
    before[1:] = np.cumsum(np.asarray(counts, dtype=np.int64))
    t = np.asarray(times, dtype=np.float64)
    spans = [(j0, min(d, j0 + _CHUNK)) for j0 in range(0, d, _CHUNK)]

    def block(j0: int, j1: int) -> np.ndarray:  # cost[j - j0, a] for j0 <= j < j1, a < j1; inf where a > j
        examples = before[j0 + 1:j1 + 1, None] - before[None, :j1]
        cost = (-(-examples // batch_size) * epochs) * t[j0:j1, None]  # (epochs x steps) x time, as a float
        cost[np.arange(j1)[None, :] > np.arange(j0, j1)[:, None]] = inf
        return cost

    kept = [block(j0, j1) for j0, j1 in spans] if sum(j1 * (j1 - j0) for j0, j1 in spans) <= _KEEP_CELLS else None
    best = [(-(-before[1:] // batch_size) * epochs) * t]  # one bucket: candidates 0..j at j (cost[0, j])
    back = [np.zeros(d, dtype=np.int64)]
    for k in range(2, levels + 1):
        shifted = best[-1][None, k - 2:d - 1]  # shifted[a - (k-1)] = best[k-2][a-1], for a >= k-1
        row, arg = np.full(d, inf), np.zeros(d, dtype=np.int64)
        last = k == levels  # the last level is only read at the last candidate
        for n, (j0, j1) in enumerate(spans):
            if j1 <= k - 1 or (last and j1 < d):
                continue
            cost = kept[n] if kept is not None else block(j0, j1)
            lo = max(j0, k - 1)  # columns below k-1 cannot hold k buckets
            total = shifted[:, :j1 - k + 1] + cost[lo - j0:, k - 1:]
            first = total.argmin(axis=1)  # the smallest a of the least total
            arg[lo:j1] = first + (k - 1)
            row[lo:j1] = total[np.arange(j1 - lo), first]
        best.append(row)
        back.append(arg)
    return [r.tolist() for r in best], [a.tolist() for a in back]


def evaluate_buckets(lengths: Iterable[int], batch_size: int, buckets: Sequence[int], *,
                     compile_s: float | None = None, token_s: float | None = None,
                     step_overhead_s: float | None = None,
                     step_time: Callable[[int], float] | Mapping[int, float] | None = None,
                     epochs: int = 1) -> BucketAdvice:
    """The advisor's cost model applied to a given bucket set (to compare sets, e.g. with a grid search).

    Same costs as :func:`suggest_buckets`; lengths over the last bucket count as truncated to it.
    """
    hist = _check_lengths(lengths, None)
    _check_int("batch_size", batch_size)
    _check_int("epochs", epochs)
    if not buckets or min(int(b) for b in buckets) < 1:
        raise DataError("buckets needs at least one length >= 1.")
    compile_time = DEFAULT_COMPILE_S if compile_s is None else float(compile_s)
    if compile_time < 0:
        raise DataError(f"compile_s is a time, so >= 0 (got {compile_time}).")
    return _advice(hist, batch_size, buckets, _step_model(batch_size, token_s, step_overhead_s, step_time),
                   compile_time, epochs)


def suggest_buckets(lengths: Iterable[int], batch_size: int, *, max_buckets: int = 8, multiple: int = 8,
                    max_length: int | None = None, compile_s: float | None = None, token_s: float | None = None,
                    step_overhead_s: float | None = None,
                    step_time: Callable[[int], float] | Mapping[int, float] | None = None,
                    epochs: int = 1) -> BucketAdvice:
    """Bucket lengths that minimise the expected training time for these example lengths.

    Expected time = ``epochs`` x (steps x step time at each bucket's length, so
    padding costs what its slots cost) + one compile of ``compile_s`` per bucket.
    Costs: ``compile_s`` (default 15 s) and a step time, either
    ``step_overhead_s + token_s x batch_size x length`` (defaults 0.3 s and
    0.8 ms: MiniLM-L6 BERT on 2-core XLA:CPU, measured by bench/advisor.py) or
    ``step_time``: a function length -> seconds per step of ``batch_size``
    rows, or measured ``{length: seconds}`` (interpolated). On a TPU steps are
    far cheaper than here while compiles are not: time a step at two lengths
    and a new bucket's first step, and pass them.

    Bucket lengths are multiples of ``multiple`` (or ``max_length``), at most
    ``max_buckets`` of them, the last one holding the longest example. The
    search is exact: dynamic programming over the candidate lengths (the
    example lengths rounded up), optimal whenever a step is no cheaper at a
    longer length. ``explain()`` says why in one line.
    """
    _check_int("batch_size", batch_size)
    _check_int("max_buckets", max_buckets)
    _check_int("multiple", multiple)
    _check_int("epochs", epochs)
    hist = _check_lengths(lengths, max_length)
    compile_time = DEFAULT_COMPILE_S if compile_s is None else float(compile_s)
    if compile_time < 0:
        raise DataError(f"compile_s is a time, so >= 0 (got {compile_time}).")
    step = _step_model(batch_size, token_s, step_overhead_s, step_time)

    def round_up(n: int) -> int:
        r = max(multiple, math.ceil(n / multiple) * multiple)
        return min(r, max_length) if max_length is not None else r

    per: Counter = Counter()
    for n, m in hist.items():
        per[round_up(n)] += m
    cands = sorted(per)  # each holds >= 1 example, so every chosen bucket compiles
    times = [float(step(c)) for c in cands]
    if any(not math.isfinite(t) or t < 0 for t in times):
        raise DataError(f"step_time gave a negative or non-finite time for a length in {cands}.")
    d, top_k = len(cands), min(max_buckets + 1, len(cands))
    best, back = _search([per[c] for c in cands], times, batch_size, epochs, top_k)
    totals = [best[k - 1][d - 1] + k * compile_time for k in range(1, min(max_buckets, d) + 1)]
    k = min(range(len(totals)), key=lambda i: (totals[i], i)) + 1
    chosen, j = [], d - 1
    for kk in range(k, 0, -1):
        chosen.append(cands[j])
        j = back[kk - 1][j] - 1
    more = best[k - 1][d - 1] - best[k][d - 1] if k < top_k else None
    return _advice(hist, batch_size, sorted(chosen), step, compile_time, epochs, max_buckets=max_buckets,
                   more_saves_s=more)
