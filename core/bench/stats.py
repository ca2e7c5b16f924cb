"""Spread of repeated timings, and ratios to DSP taken per interleaved repetition."""

from __future__ import annotations

import statistics


def spread(values: list[float]) -> dict[str, float]:
    """Median, quartiles (``q1``, ``q3``: the IQR) and range of ``values`` (at least one).

    The quartiles interpolate between the measured values (``method="inclusive"``), so the
    IQR lies inside the range; the default "exclusive" method extrapolates on a few
    repetitions (2 timings 0.015 and 0.022 gave an IQR of 0.013–0.024)."""
    if not values:
        raise ValueError("spread() needs at least one value")
    q = (
        statistics.quantiles(values, n=4, method="inclusive")
        if len(values) > 1
        else [values[0]] * 3
    )
    return {
        "median": statistics.median(values),
        "q1": q[0],
        "q3": q[2],
        "min": min(values),
        "max": max(values),
    }


def paired_ratios(times: list[float], reference: list[float]) -> list[float]:
    """``times[i] / reference[i]``: repetition ``i`` of both ran in the same interleaved round,
    so the machine's drift between rounds cancels in the ratio."""
    if len(times) != len(reference):
        raise ValueError(f"{len(times)} timings against {len(reference)} reference timings")
    return [t / r for t, r in zip(times, reference)]


def moved_beyond_iqr(before: dict[str, float], after: dict[str, float]) -> bool:
    """Whether the median ratio moved by more than its IQR (the wider of the two runs')."""
    iqr = max(before["q3"] - before["q1"], after["q3"] - after["q1"])
    return abs(after["median"] - before["median"]) > iqr
