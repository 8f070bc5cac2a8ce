"""The allocator check's arithmetic on hand-made figures: the allocator's rounding of the census's
own blocks is explained; a buffer the census does not know of is not."""
from zerolens.report.checks import allocator_check

MiB = 2**20


def rank(**changes):
    base = dict(rank=0, allocated_after_step=700 * MiB, leftover_bytes_at_end=0, param_bytes=200 * MiB,
                grad_bytes_after_step=0, optimizer_state_bytes=400 * MiB, comm_buffer_bytes_after_step=0,
                census_block_rounding_after_step=13 * MiB, cublas_workspace_bytes=65 * MiB)
    return base | changes


def test_rounding_of_census_blocks_is_explained():
    check = allocator_check("fsdp2", rank(allocated_after_step=678 * MiB))
    assert check["passed"] and check["measured"]["unexplained_bytes"] == 0
    assert "13.00 MiB allocator rounding" in check["detail"]


def test_an_unknown_buffer_is_not():
    check = allocator_check("fsdp2", rank(allocated_after_step=(678 + 20) * MiB))
    assert not check["passed"] and check["measured"]["unexplained_bytes"] == 20 * MiB


def test_runs_without_the_rounding_figure_count_none():
    check = allocator_check("zero2", rank(allocated_after_step=665 * MiB, census_block_rounding_after_step=None))
    assert check["passed"]
