"""FakeTensorMode's cache keyed fast, and without storage offsets for operations with fresh outputs
(predict/fake_cache.py): the same traces as torch's own keys give, and more of the cache's answers on ZeRO's flat
buffers."""
import contextlib
import dataclasses
import math

import pytest
import torch
from torch._subclasses import fake_tensor
from torch._subclasses.fake_tensor import FakeTensorMode

from zerolens.models.hf import model_config_fields
from zerolens.models.model import PRESETS, ModelConfig
from zerolens.predict import fake_cache, peak
from zerolens.predict.peak import traced_rank
from zerolens.strategies import TrainSettings

H200 = (9, 0)
aten = torch.ops.aten


def test_only_operations_that_make_new_tensors_are_keyed_without_offsets():
    assert fake_cache.fresh_outputs(aten.addmm.default) and fake_cache.fresh_outputs(aten.native_layer_norm.default)
    for func in (aten.view.default, aten.t.default, aten.add_.Tensor, aten.addmm.out, aten.as_strided.default,
                 aten._foreach_add_.Tensor, *OUTPUTS_LAID_OUT_AS_INPUTS):
        assert not fake_cache.fresh_outputs(func), func


def output_layouts(func, make_args, at: int) -> list[tuple]:
    """Each output's (storage offset, storage bytes, shape, strides) of `func` on fake inputs that lie `at`
    elements into buffers of their own (`make_args(tensor)`, tensor(*shape) making one), the cache off."""
    with FakeTensorMode() as mode:
        mode.cache_enabled = False

        def tensor(*shape, dtype=torch.float32):
            n = math.prod(shape)
            return torch.empty(n + 2 * at, dtype=dtype)[at:at + n].view(shape)
        out = func(*make_args(tensor))
        return [(t.storage_offset(), t.untyped_storage().nbytes(), tuple(t.shape), t.stride())
                for t in (out if isinstance(out, tuple) else (out,)) if isinstance(t, torch.Tensor)]


# Each operator named by fresh_outputs, and some of each tag, with arguments made by `tensor`
NEW_OUTPUTS = {
    aten.mm.default: lambda t: (t(8, 16), t(16, 4)),
    aten.addmm.default: lambda t: (t(4), t(8, 16), t(16, 4)),
    aten.bmm.default: lambda t: (t(2, 8, 16), t(2, 16, 4)),
    aten.baddbmm.default: lambda t: (t(2, 8, 4), t(2, 8, 16), t(2, 16, 4)),
    aten.native_layer_norm.default: lambda t: (t(8, 16), [16], t(16), t(16), 1e-5),
    aten.native_layer_norm_backward.default: lambda t: (t(8, 16), t(8, 16), [16], t(8, 1), t(8, 1), t(16), t(16),
                                                        [True, True, True]),
    aten._to_copy.default: lambda t: (t(8, 16),),
    aten.embedding.default: lambda t: (t(32, 16), t(8, dtype=torch.int64)),
    aten.new_empty.default: lambda t: (t(8, 16), [4, 4]),
    aten.add.Tensor: lambda t: (t(8, 16), t(8, 16)),
    aten.mul.Tensor: lambda t: (t(8, 16), t(16)),
    aten.clone.default: lambda t: (t(8, 16),),
    aten.amax.default: lambda t: (t(8, 16), [1]),
    aten.sum.dim_IntList: lambda t: (t(8, 16), [0]),
}
# Operators that alias and mutate nothing but lay their outputs out as their inputs (the review's finds)
OUTPUTS_LAID_OUT_AS_INPUTS = {
    aten.slice_scatter.default: lambda t: (t(8, 16), t(4, 16), 0, 0, 4),
    aten.select_scatter.default: lambda t: (t(8, 16), t(16), 0, 1),
    aten.diagonal_scatter.default: lambda t: (t(8, 8), t(8)),
    aten.as_strided_scatter.default: lambda t: (t(8, 16), t(4, 4), [4, 4], [16, 1]),
    aten.copy.default: lambda t: (t(8, 16), t(8, 16)),
}


@pytest.mark.parametrize("func", list(NEW_OUTPUTS), ids=str)
def test_operations_keyed_without_offsets_make_outputs_that_do_not_depend_on_them(func):
    assert fake_cache.fresh_outputs(func)
    layouts = output_layouts(func, NEW_OUTPUTS[func], 0)
    assert layouts and all(offset == 0 for offset, *_ in layouts)
    assert output_layouts(func, NEW_OUTPUTS[func], 24) == layouts


def test_the_check_of_outputs_tells_those_laid_out_as_their_inputs():
    for func, make_args in OUTPUTS_LAID_OUT_AS_INPUTS.items():
        assert output_layouts(func, make_args, 24) != output_layouts(func, make_args, 0), func


def test_this_torchs_cache_is_the_one_read():
    assert fake_cache.supported()


def test_a_torch_that_keys_another_field_of_a_tensor_keeps_its_own_keys(monkeypatch):
    torchs = fake_tensor.FakeTensorMode._cache_key
    keyed_more = dataclasses.make_dataclass("TensorMetadata", [*fake_cache.KEYED_FIELDS, "pinned"])
    monkeypatch.setattr(fake_tensor, "TensorMetadata", keyed_more)
    fake_cache.supported.cache_clear()
    try:
        assert not fake_cache.supported()
        with fake_cache.trace_cache_keys():
            assert fake_tensor.FakeTensorMode._cache_key is torchs
    finally:
        monkeypatch.undo()
        fake_cache.supported.cache_clear()
    assert fake_cache.supported()
    with fake_cache.trace_cache_keys():
        assert fake_tensor.FakeTensorMode._cache_key is not torchs


def test_views_at_other_offsets_of_one_buffer_share_the_cache_only_inside():
    def misses_of_two_products():
        FakeTensorMode.cache.clear()
        with FakeTensorMode() as mode:
            flat = mode.from_tensor(torch.empty(2 * 64 * 64))
            x = mode.from_tensor(torch.empty(8, 64))
            before = FakeTensorMode.cache_misses
            outs = [x @ flat[i * 64 * 64:(i + 1) * 64 * 64].view(64, 64) for i in range(2)]
            assert all(o.shape == (8, 64) and o.storage_offset() == 0 for o in outs)
            return FakeTensorMode.cache_misses - before

    own = FakeTensorMode._cache_key
    with fake_cache.trace_cache_keys():
        blind = misses_of_two_products()
    assert FakeTensorMode._cache_key == own  # restored
    assert misses_of_two_products() > blind  # torch's own key: the second view's product is new to it


def keys_alike(calls: list) -> list[list[bool]]:
    """For each pair of (func, args) calls, whether their cache keys are equal, made under the current keys."""
    with FakeTensorMode() as mode:
        state = fake_tensor._CacheKeyState(mode.shape_env)
        keys = [mode._cache_key(state, func, make(mode), {}) for func, make in calls]
    return [[a == b for b in keys] for a in keys]


def test_keys_tell_apart_what_torchs_tell_apart():
    def tensor(*shape, dtype=torch.float32, grad=False):
        return lambda mode: mode.from_tensor(torch.empty(*shape, dtype=dtype, requires_grad=grad))

    def offset_view(mode):  # a view at an offset of its buffer: for a fresh output, keyed as the tensor itself
        return mode.from_tensor(torch.empty(2 * 64 * 8))[64 * 8:].view(8, 64)
    calls = [
        (aten.mm.default, lambda m: (tensor(8, 64)(m), tensor(64, 64)(m))),
        (aten.mm.default, lambda m: (tensor(8, 64)(m), tensor(64, 64)(m))),  # alike: the same key
        (aten.mm.default, lambda m: (tensor(8, 64)(m), tensor(64, 32)(m))),  # another shape
        (aten.mm.default, lambda m: (tensor(8, 64, dtype=torch.bfloat16)(m), tensor(64, 64, dtype=torch.bfloat16)(m))),
        (aten.mm.default, lambda m: (tensor(8, 64)(m), tensor(64, 64)(m).t())),  # other strides
        (aten.mm.default, lambda m: (tensor(8, 64, grad=True)(m), tensor(64, 64)(m))),
        (aten.mm.default, lambda m: (offset_view(m), tensor(64, 64)(m))),
        (aten.add.Tensor, lambda m: (tensor(8, 64)(m), tensor(8, 64)(m))),  # another operation
        (aten.add.Tensor, lambda m: (tensor(8, 64)(m), 2)),  # an int and a float hash alike: kept apart by type
        (aten.add.Tensor, lambda m: (tensor(8, 64)(m), 2.0)),
        (aten.view.default, lambda m: (tensor(8, 64)(m), [64, 8])),  # a view keeps its input's offset
        (aten.view.default, lambda m: (offset_view(m), [64, 8])),
    ]
    own = keys_alike(calls)
    with fake_cache.trace_cache_keys():
        fast = keys_alike(calls)
    # torch's own keys hold the offset (its index: 6); ours leave it out for mm's fresh output alone
    expected = [row[:] for row in own]
    expected[0][6] = expected[1][6] = expected[6][0] = expected[6][1] = True
    assert fast == expected
    assert own[0][1] and not own[10][11] and not fast[10][11]


def frees_in_runs_sorted(requests: list) -> list:
    """A sequence with each run of frees (no allocation between them) in one order: autocast frees its cached
    casts of the weights in the order of a hash map keyed by address (torch.clear_autocast_cache), another
    in each process, and the allocator ends such a run in one state whatever its order."""
    out, run = [], []
    for request in requests:
        if request[0] == "free":
            run.append(request)
            continue
        out += sorted(run) + [request]
        run = []
    return out + sorted(run)


def llama_tiny() -> ModelConfig:
    return ModelConfig(**model_config_fields("examples/hf/llama-tiny.json", depth=None, seq_len=64))


@pytest.mark.parametrize("name, model, settings, capability, brackets", [
    ("zero1", PRESETS["gpt-tiny"], TrainSettings(precision="bf16", micro_batch=2, world_size=4), H200, True),
    *(pytest.param(*case, marks=pytest.mark.slow) for case in [  # ~10 s more: the slow tier
        ("zero2", dataclasses.replace(PRESETS["gpt-tiny"], activation_checkpointing=True),
         TrainSettings(precision="fp16", micro_batch=2, world_size=2), H200, False),
        ("zero2", llama_tiny(), TrainSettings(precision="bf16", micro_batch=2, world_size=2, grad_accum=2), H200, True),
        ("zero3", PRESETS["gpt-tiny"], TrainSettings(precision="bf16", micro_batch=2, world_size=2), H200, False),
        ("fsdp2", PRESETS["gpt-tiny"], TrainSettings(precision="bf16", micro_batch=2, world_size=2), H200, False),
        ("ddp", PRESETS["gpt-tiny"], TrainSettings(precision="fp32", micro_batch=2, world_size=2), None, False)]),
])
def test_a_trace_is_the_one_torchs_own_keys_give(monkeypatch, name, model, settings, capability, brackets):
    def trace():
        monkeypatch.setattr(peak, "SECOND_STEP_FOLLOWS", {})
        monkeypatch.setattr(peak, "THIRD_STEP_ONCE", {})
        FakeTensorMode.cache.clear()
        outcome, record = traced_rank(name, model, settings, cuda_capability=capability, brackets=brackets)
        return (outcome, frees_in_runs_sorted(record["requests"] or []), record["raw"], record["phase_peaks"],
                record["held"], record["batch_bytes"])

    blind = trace()
    monkeypatch.setattr(peak, "trace_cache_keys", contextlib.nullcontext)
    assert trace() == blind
