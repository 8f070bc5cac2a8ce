from zerolens.theory import zero_partition_layout


def test_layout_two_ranks_by_hand():
    # 15 elements, alignment 2*2=4 -> padded 16, P=8. Rank 0 owns [0,8): params 0 (0-5) and 1 (5-8).
    # Rank 1 owns [8,16): param 2 (8-15) and one padding element.
    r0, r1 = zero_partition_layout([5, 3, 7], 2)
    assert (r0.partition_elements, r0.overlapping_params, r0.grad_buffer_elements, r0.padding_elements) == (8, (0, 1), 8, 0)
    assert (r1.partition_elements, r1.overlapping_params, r1.grad_buffer_elements, r1.padding_elements) == (8, (2,), 7, 1)
    assert r1.held_grad_elements == 8


def test_straddling_parameter_is_held_whole_by_both_ranks():
    # 10 + 10 = 20 elements, N=2, alignment 4 -> padded 20, P=10... make one straddle: [6, 14]
    r0, r1 = zero_partition_layout([6, 14], 2)
    assert r0.partition_elements == 10
    assert r0.overlapping_params == (0, 1)  # param 1 spans [6, 20): starts inside rank 0's slice
    assert r1.overlapping_params == (1,)  # and straddles the start of rank 1's
    assert r0.grad_buffer_elements == 20 and r1.grad_buffer_elements == 14


def test_three_ranks_padding_and_sum():
    sizes = [7, 11, 5]  # 23 elements, alignment 6 -> padded 24, P=8
    layout = zero_partition_layout(sizes, 3)
    assert [r.partition_elements for r in layout] == [8, 8, 8]
    assert [r.padding_elements for r in layout] == [0, 0, 1]
    assert sum(r.partition_elements for r in layout) - sum(sizes) == 1
    assert [r.overlapping_params for r in layout] == [(0, 1), (1,), (1, 2)]


def test_rank_with_no_parameters_holds_a_zero_buffer():
    # 2 elements on 4 ranks: alignment 8 -> padded 8, P=2; ranks 1..3 hold only padding.
    layout = zero_partition_layout([2], 4)
    assert layout[0].held_grad_elements == 2
    assert [r.held_grad_elements for r in layout[1:]] == [2, 2, 2]
    assert [r.overlapping_params for r in layout[1:]] == [(), (), ()]


from zerolens.theory import deepspeed_estimator, paper_model_states, predict_retained  # noqa: E402


def test_predict_ddp_and_zero0_by_hand():
    sizes = [10, 3]  # 13 parameters in 2 tensors
    ddp = predict_retained("ddp", sizes, 2, 0, "bf16")
    assert ddp["param_bytes"] == 52 and ddp["grad_bytes_after_backward"] == 52
    assert ddp["optimizer_state_bytes"] == 8 * 13 + 4 * 2  # two fp32 moments + a step counter per tensor
    assert ddp["comm_buffer_bytes_after_backward"] == 52  # the buckets mirror the fp32 gradients
    z0 = predict_retained("zero0", sizes, 2, 0, "bf16")
    assert z0["param_bytes"] == 26 and z0["optimizer_state_bytes"] == 12 * 13 + 8  # + fp32 master copy
    assert predict_retained("zero0", sizes, 2, 0, "fp32")["optimizer_state_bytes"] == 8 * 13 + 8  # no copy


def test_predict_zero3_by_hand():
    # N=3: shards ceil(10/3)=4 and ceil(3/3)=1 -> 5 elements. Both tensors are below the persistence
    # threshold, so they stay gathered in buffers of 3 padded shards: 12 + 3 elements.
    z3 = predict_retained("zero3", [10, 3], 3, 1, "bf16", reduce_bucket_size=100)
    assert z3["grad_partition_elements"] == 5
    assert z3["param_bytes"] == 2 * (5 + 15)
    assert z3["grad_bytes_after_backward"] == z3["grad_bytes_after_step"] == 10
    assert z3["optimizer_state_bytes"] == 12 * 5 + 4
    assert z3["comm_buffer_bytes_after_backward"] == 200  # the persistent reduce bucket


def test_paper_formulas_and_estimator():
    psi = 1000
    assert [paper_model_states(psi, 4, s) for s in range(4)] == [16000, 4000 + 3000, 2000 + 3500, 4000]
    assert deepspeed_estimator(psi, 4, 2) == 2000 + 4500
    assert deepspeed_estimator(psi, 4, 1) is None
