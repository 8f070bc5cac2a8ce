from zerolens.strategies.layout import zero_partition_layout


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


def test_one_ranks_partition_is_the_rule_applied_to_every_parameter():
    """zero_rank_partition finds a rank's parameters by bisection; they are those get_partition_info's
    rule picks by looking at every parameter (empty ones, straddles, ranks of padding alone)."""
    import math
    import random
    rng = random.Random(0)
    for _ in range(300):
        numels = [rng.choice([0, 1, 2, 3, 7, 50, 1000]) for _ in range(rng.randint(1, 12))]
        world_size = rng.randint(1, 9)
        total = sum(numels)
        size = max(1, math.ceil(total / (2 * world_size))) * 2 if total else 0
        offsets = [sum(numels[:i]) for i in range(len(numels))]
        for rank, part in enumerate(zero_partition_layout(numels, world_size)):
            start, end = rank * size, (rank + 1) * size
            expected = tuple(i for i, (off, n) in enumerate(zip(offsets, numels))
                             if start <= off < end or off < start < off + n)
            assert (part.partition_elements, part.overlapping_params) == (size, expected), (numels, world_size, rank)


from zerolens.predict.formulas import deepspeed_estimator, paper_model_states  # noqa: E402
from zerolens.strategies.registry import predict_retained  # noqa: E402


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


def test_predict_fsdp2_by_hand():
    # N=3, shapes (10, 2) and (3,): chunks of ceil(10/3)=4 rows of 2 and ceil(3/3)=1 row. Rank 2
    # holds rows 8-9 of the first (2 of its 4 padded rows) and row 2 of the second.
    shapes = [(10, 2), (3,)]
    for name in ("fsdp2", "fsdp2-grad"):
        r2 = predict_retained(name, [20, 3], 3, 2, "bf16", param_shapes=shapes)
        assert r2["param_bytes"] == r2["grad_bytes_after_backward"] == 4 * (8 + 1)  # fp32, padded
        assert r2["grad_partition_elements"] == 4 + 1
        assert r2["optimizer_state_bytes"] == 8 * 5 + 4 * 2  # moments unpadded, a step counter per tensor
        assert r2["grad_bytes_after_step"] == r2["comm_buffer_bytes_after_backward"] == 0


def test_fsdp2_shards_follow_torch_chunk_including_ranks_with_no_rows():
    import torch

    from zerolens.strategies.layout import fsdp2_shard_elements
    for shape in [(4, 3), (1, 5), (7,), (5003, 24), (2, 2, 2)]:
        t = torch.empty(shape)
        for n in (1, 2, 3, 4):
            chunks = torch.chunk(t, n, dim=0)  # may be fewer than n: the last ranks get no rows
            for rank in range(n):
                padded, held = fsdp2_shard_elements([shape], n, rank)
                assert padded == chunks[0].numel()
                assert held == (chunks[rank].numel() if rank < len(chunks) else 0)
    assert fsdp2_shard_elements([(4, 3)], 3, 2) == (6, 0)  # rows 2 + 2 + 0: rank 2 keeps only padding


def test_deepspeed_layouts_by_release():
    from zerolens.strategies.layout import DEEPSPEED_0_19, deepspeed_layout
    assert deepspeed_layout("0.19.8") == deepspeed_layout("0.18.9") == deepspeed_layout("0.17.6") == DEEPSPEED_0_19
    assert deepspeed_layout("0.16.9").stage0_bf16_wrapper == "BF16_Optimizer"
    assert deepspeed_layout("0.15.4").stage0_bf16_wrapper == "BF16_Optimizer"  # no error: compat.py refuses it


def test_predict_zero0_bf16_in_deepspeed_0_16_by_hand():
    from zerolens.strategies.layout import deepspeed_layout
    sizes = [10, 3]  # 13 elements; N=2: padded to 16, 8 per rank
    z16 = predict_retained("zero0", sizes, 2, 1, "bf16", deepspeed=deepspeed_layout("0.16.9"))
    assert z16["param_bytes"] == 2 * 16  # the flat bf16 buffer, padding included
    assert z16["grad_bytes_after_backward"] == z16["grad_bytes_after_step"] == 2 * 13 + 4 * 16  # + flat fp32 grads
    assert z16["optimizer_state_bytes"] == 12 * 8 + 4  # masters and moments on the rank's 8, one step counter
    assert z16["grad_partition_elements"] == 13
    assert predict_retained("zero0", sizes, 2, 0, "fp32", deepspeed=deepspeed_layout("0.16.9")) == \
        predict_retained("zero0", sizes, 2, 0, "fp32")  # no wrapper in fp32


def test_a_model_built_in_bf16_keeps_bf16_under_ddp_and_fsdp2_and_deepspeed_casts_it_as_ever():
    """weight_bytes 2: DDP's and FSDP2's weights, gradients, buckets and AdamW moments in bf16 (the
    step counters stay fp32 scalars); DeepSpeed's figures do not depend on how the model was built."""
    from zerolens.strategies import registry
    numels, shapes = [64 * 16, 16], [(64, 16), (16,)]
    for name in ("ddp", "fsdp2", "zero2"):
        fp32, bf16 = (registry.predict_retained(name, numels, 2, 0, "bf16", param_shapes=shapes, weight_bytes=w)
                      for w in (4, 2))
        if name == "zero2":
            assert bf16 == fp32
            continue
        assert bf16["param_bytes"] * 2 == fp32["param_bytes"]
        assert bf16["grad_bytes_after_backward"] * 2 == fp32["grad_bytes_after_backward"]
        steps = 4 * len(numels)
        assert (bf16["optimizer_state_bytes"] - steps) * 2 == fp32["optimizer_state_bytes"] - steps


def test_frozen_parameters_have_no_gradient_or_optimizer_state_and_stay_out_of_zero12s_partition():
    """A frozen embedding: gradients, AdamW states and step counters only for what trains; ZeRO-1/2
    partition what trains and keep the frozen weight whole in 16-bit; ZeRO-3 and FSDP2 still shard it.
    (The byte counts against real backends: tests/test_user_model.py.)"""
    from zerolens.strategies import registry
    numels, shapes, trainable = [1024, 512, 32], [(64, 16), (32, 16), (32,)], [False, True, True]
    trained = 512 + 32
    ddp = registry.predict_retained("ddp", numels, 2, 0, "bf16", param_shapes=shapes, trainable=trainable)
    assert ddp["param_bytes"] == 4 * sum(numels) and ddp["grad_bytes_after_backward"] == 4 * trained
    assert ddp["optimizer_state_bytes"] == 8 * trained + 4 * 2
    zero2 = registry.predict_retained("zero2", numels, 2, 0, "bf16", param_shapes=shapes, trainable=trainable)
    assert zero2["grad_partition_elements"] == trained // 2
    assert zero2["param_bytes"] == 2 * (trained + 1024)
    zero3 = registry.predict_retained("zero3", numels, 2, 0, "bf16", param_shapes=shapes, trainable=trainable)
    assert zero3["grad_partition_elements"] == trained // 2 and zero3["optimizer_state_bytes"] == 12 * trained // 2 + 4
    fsdp2 = registry.predict_retained("fsdp2", numels, 2, 0, "bf16", param_shapes=shapes, trainable=trainable)
    assert fsdp2["param_bytes"] == 4 * sum(numels) // 2 and fsdp2["grad_bytes_after_backward"] == 4 * trained // 2
