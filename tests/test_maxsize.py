"""The max-size search against synthetic memory models: it must return the exact boundary, having
seen it fit and the next depth fail, whatever the memory's shape."""
import pytest

from zerolens.maxsize import largest_fitting_depth, max_fitting

GiB = 2**30


def linear(fixed, per_layer, limit):
    def trial(depth):
        peak = fixed + per_layer * depth
        return peak if peak <= limit else None
    return trial


@pytest.mark.parametrize("fixed,per_layer,limit", [
    (6 * GiB, int(1.67 * GiB), 141 * GiB),  # DDP-like on an H200
    (6 * GiB, GiB, 24 * GiB),
    (1, 1, 10),
    (23 * GiB, GiB, 24 * GiB),  # exactly one layer
])
def test_finds_the_exact_boundary_of_a_linear_model(fixed, per_layer, limit):
    search = largest_fitting_depth(linear(fixed, per_layer, limit), lambda: limit)
    best = max_fitting(search)
    assert best == (limit - fixed) // per_layer
    assert search.trials[best] is not None and search.trials[best + 1] is None
    assert len(search.trials) <= 12


def test_a_guess_that_is_far_off_still_ends_at_the_boundary():
    # Memory grows slowly for the first layers, then jumps (e.g. a bucket or fragmentation):
    # the straight line through depths 1 and 2 overshoots a lot.
    def trial(depth):
        peak = depth if depth <= 2 else 2 + 50 * (depth - 2)
        return peak if peak <= 1000 else None
    search = largest_fitting_depth(trial, lambda: 1000)
    assert max_fitting(search) == 21 and search.trials[22] is None


def test_a_flat_start_does_not_jump_to_a_huge_model():
    # Depths 1 and 2 peak the same: the straight line is flat and would point at the cap.
    tried = []

    def trial(depth):
        tried.append(depth)
        peak = 100 if depth <= 2 else 100 + 10 * depth
        return peak if peak <= 3000 else None
    search = largest_fitting_depth(trial, lambda: 3000)
    assert max_fitting(search) == 290 and max(tried) <= 2 * 290


def test_nothing_fits_and_everything_fits():
    assert max_fitting(largest_fitting_depth(lambda d: None, lambda: 100)) == 0
    search = largest_fitting_depth(lambda d: d, lambda: 10**9, max_depth=64)
    assert max_fitting(search) == 64 and 65 not in search.trials
