"""The step-time breakdown's communication not overlapped (measure/overlap.py): interval arithmetic on
a kernel timeline, and bench's summary of it."""
import pytest

from zerolens.measure.overlap import is_communication, merged, not_overlapped


def test_the_union_of_intervals():
    assert merged([(3, 4), (0, 1), (0.5, 2), (2, 2.5)]) == [(0, 2.5), (3, 4)]
    assert merged([]) == []


@pytest.mark.parametrize("communication, computation, exposed", [
    ([(0, 10)], [(2, 3), (5, 7)], 7),  # computation hides 3 of 10
    ([(0, 1), (2, 3)], [(0.5, 2.5)], 1.0),  # each half hidden
    ([(0, 1)], [], 1),  # nothing to hide behind
    ([], [(0, 1)], 0),
    ([(1, 2)], [(0, 5)], 0),  # wholly hidden
    ([(0, 4)], [(1, 2), (1.5, 3)], 2),  # overlapping computation counted once
    ([(0, 1), (1.5, 2), (4, 6)], [(0.5, 5)], 1.5),  # one computation across several communications
])
def test_communication_not_overlapped_is_what_no_computation_runs_beside(communication, computation, exposed):
    assert not_overlapped(communication, computation) == pytest.approx(exposed)


def test_nccls_kernels_are_the_communication():
    assert is_communication("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)")
    assert is_communication("ncclKernel_ReduceScatter_RING_LL_Sum_bf16")
    assert not is_communication("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64")


def test_bench_reports_the_profiled_steps_communication_the_largest_ranks():
    from zerolens.report.bench import communication_of
    ranks = [{"communication": {"communication": 0.004, "communication_not_overlapped": 0.001}},
             {"communication": {"communication": 0.003, "communication_not_overlapped": 0.002}}]
    assert communication_of(ranks) == {"communication_s": 0.004, "communication_not_overlapped_s": 0.002}
    # a rank without a profiled step (the CPU, --warmup 0): no figure rather than a part of one
    assert communication_of([ranks[0], {"communication": None}]) == {"communication_s": None,
                                                                    "communication_not_overlapped_s": None}
