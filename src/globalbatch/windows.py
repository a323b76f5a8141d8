"""This rank's micro-batches of every window: the one way a global batch is cut over ranks and micro-steps.

Every rank reads the **same** stream of samples (a dataset, or — cheaper for large data — a seeded
order of indices that ``collate`` loads) and, window after window, draws the driver's current global
batch from it (:attr:`StepDriver.global_batch`, which follows the batch schedule), then keeps its own
micro-batches. The cut is fixed by ``(samples in the window, micro_batch, dp_world_size)`` alone:

* a full window is ``grad_accum_steps`` rows of ``micro_batch × dp_world_size`` samples in draw
  order; in row ``a`` rank ``r`` takes the ``r``-th block of ``micro_batch`` samples. One process
  and two ranks therefore train on the same samples in the same windows;
* a short window (the end of the data) of ``n`` samples gives rank ``r``
  ``n // W + (r < n % W)`` samples, cut into ``ceil(max share / micro_batch)`` micro-batches whose
  sizes differ by at most one (so every rank runs the same number of micro-steps whenever
  ``micro_batch ≥ 2``), laid out row by row as a full window is; on one process at least two
  micro-batches when the full windows have two or more (the noise monitor needs two small batches);
* a tail of fewer samples than ranks cannot give every rank a micro-batch (a rank without one
  would leave the others waiting in the gradient all-reduce): it is left out, with a warning naming it;
  so is a last single sample on one process whose full windows have two or more micro-batches (one
  small batch: the noise monitor refuses such a window).

Ragged samples are the collate function's business: each micro-batch is collated (padded) on its own.
"""

from __future__ import annotations

import itertools
import logging
import math
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence, TypeVar

from globalbatch.errors import Raw, SettingError
from globalbatch.validate import whole

__all__ = ["MicroBatches", "window_layout", "cut_window", "rank_windows"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


class MicroBatches(list):
    """One window's micro-batches on this rank (a list), with ``samples``: the samples of each.

    :meth:`globalbatch.step.StepDriver.run_window` reads ``samples`` (no ``samples_per_micro`` needed)."""

    samples: list[int]
    """Samples in each micro-batch, in order."""
    window_samples: int
    """Samples of the whole window over all ranks."""

    def __init__(self, items: Iterable[Any], *, samples: Sequence[int], window_samples: int) -> None:
        super().__init__(items)
        self.samples = [int(s) for s in samples]
        self.window_samples = int(window_samples)


def window_layout(n_samples: int, micro_batch: int, dp_world_size: int, *,
                  min_micro_steps: int = 1) -> Optional[list[list[int]]]:
    """Micro-batch sizes ``[rank][micro_step]`` of a window of ``n_samples`` (None: fewer samples than ranks).

    ``window_layout(16, 2, 2)`` → ``[[2, 2, 2, 2], [2, 2, 2, 2]]``; ``window_layout(5, 2, 2)`` →
    ``[[2, 1], [1, 1]]`` (shares 3 and 2, two micro-steps each). ``min_micro_steps``: at least this many
    micro-steps per rank where the samples allow (a short window of one process keeps two small batches
    for the noise monitor)."""
    whole(n_samples, "n_samples", minimum=0)
    m = whole(micro_batch, "micro_batch")
    w = whole(dp_world_size, "dp_world_size")
    if n_samples < w:
        return None
    shares = [n_samples // w + (r < n_samples % w) for r in range(w)]
    steps = max(math.ceil(max(shares) / m), min(whole(min_micro_steps, "min_micro_steps"), min(shares)))
    out = []
    for share in shares:
        parts = min(steps, share)
        q, rem = divmod(share, parts)
        out.append([q + 1] * rem + [q] * (parts - rem))
    return out


def cut_window(samples: Sequence[T], micro_batch: int, dp_world_size: int, rank: int, *,
               min_micro_steps: int = 1) -> list[list[T]]:
    """Rank ``rank``'s micro-batches of one window (``samples``: all ranks' samples, in draw order).

    Row by row (micro-step ``a``), each rank takes its next block: for a full window rank ``r`` gets
    ``samples[a·m·W + r·m : a·m·W + (r+1)·m]`` in row ``a``. A window of fewer samples than ranks is a
    ``SettingError`` (:func:`rank_windows` leaves such a tail out)."""
    layout = window_layout(len(samples), micro_batch, dp_world_size, min_micro_steps=min_micro_steps)
    if layout is None:
        raise SettingError("samples", len(samples), f"at least dp_world_size {dp_world_size} samples in a window "
                           "(every rank needs a micro-batch)")
    whole(rank, "rank", minimum=0, maximum=dp_world_size - 1, allowed=f"a whole number in [0, {dp_world_size})")
    mine: list[list[T]] = []
    pos = 0
    for a in range(max(len(sizes) for sizes in layout)):
        for r, sizes in enumerate(layout):
            if a < len(sizes):
                if r == rank:
                    mine.append(list(samples[pos:pos + sizes[a]]))
                pos += sizes[a]
    return mine


def rank_windows(samples: Iterable[T], driver: Any, *, collate: Optional[Callable[[list[T]], Any]] = None,
                 start: int = 0) -> Iterator[MicroBatches]:
    """This rank's collated micro-batches of each window, drawn at the driver's current global batch.

    Args:
        samples: the same iterable of single samples on every rank (a dataset, a list, a seeded order of
            indices, a ``DataLoader(batch_size=None)``); a batching DataLoader is refused.
        driver: the :class:`~globalbatch.step.StepDriver`; its ``global_batch`` is read when each window is
            drawn (after the previous ``step()``), so batch schedules are followed; ``config.micro_batch``,
            ``dp_world_size`` and ``dp_rank`` fix the cut.
        collate: ``list of samples -> micro-batch`` (pad each micro-batch on its own); None: the lists.
        start: samples to skip first (``driver.consumed_samples`` after a resume).

    Each window must be stepped before the next is drawn: drawing two windows ahead (``list(...)``) would
    cut them all at one batch size, so it is a ``RuntimeError``.
    """
    start = whole(start, "start", minimum=0)
    if getattr(samples, "batch_sampler", None) is not None and hasattr(samples, "dataset"):
        # a torch DataLoader that batches: its items are batches, not samples
        raise SettingError("samples", Raw(f"a DataLoader with batch_size {getattr(samples, 'batch_size', None)}"),
                           "samples one at a time: the dataset, a seeded order of indices, or "
                           "DataLoader(..., batch_size=None); rank_windows forms the micro-batches")
    return _draw(samples, driver, collate, start)


def _draw(samples: Iterable[T], driver: Any, collate: Optional[Callable[[list[T]], Any]], start: int
          ) -> Iterator[MicroBatches]:
    it = iter(samples)
    if start:
        skipped = sum(1 for _ in itertools.islice(it, start))
        if skipped < start:
            raise SettingError("start", start, f"at most the {skipped} samples there are")
    drawn_at: Optional[int] = None
    while True:
        if drawn_at is not None and driver.windows == drawn_at:
            raise RuntimeError("rank_windows: the next window was drawn before step() of the previous one; "
                               "call driver.step() (or run_window) on each window first")
        n = driver.global_batch
        drawn = list(itertools.islice(it, n))
        if not drawn:
            return
        world = driver.dp_world_size
        micro = driver.config.micro_batch
        if len(drawn) < world or (world == 1 and len(drawn) == 1 and n >= 2 * micro):
            if getattr(driver, "_log", True) and world > 1:
                logger.warning("the last %d samples are fewer than the %d data-parallel ranks: left out (every rank "
                               "needs a micro-batch)", len(drawn), world)
            elif getattr(driver, "_log", True):
                logger.warning("the last sample is left out: alone it is one micro-batch, and every full window has "
                               "two or more (the noise scale needs two small batches)")
            return
        # a short window of one process keeps two micro-batches when full ones have them (two small batches:
        # what the noise monitor needs); full windows are always rows of micro_batch
        two = world == 1 and len(drawn) < n and n >= 2 * micro
        mine = cut_window(drawn, micro, world, driver.dp_rank, min_micro_steps=2 if two else 1)
        drawn_at = driver.windows
        yield MicroBatches([collate(part) if collate is not None else part for part in mine],
                           samples=[len(part) for part in mine], window_samples=len(drawn))
