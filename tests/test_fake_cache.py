"""FakeTensorMode's cache keyed without storage offsets for operations with fresh outputs (predict/fake_cache.py):
the same traces as torch's own keys give, and more of the cache's answers on ZeRO's flat buffers."""
import contextlib
import dataclasses

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from zerolens.models.hf import model_config_fields
from zerolens.models.model import PRESETS, ModelConfig
from zerolens.predict import fake_cache, peak
from zerolens.predict.peak import traced_rank
from zerolens.strategies import TrainSettings

H200 = (9, 0)


def test_only_operations_that_make_new_tensors_are_keyed_without_offsets():
    aten = torch.ops.aten
    assert fake_cache.fresh_outputs(aten.addmm.default) and fake_cache.fresh_outputs(aten.native_layer_norm.default)
    for func in (aten.view.default, aten.t.default, aten.add_.Tensor, aten.addmm.out, aten.as_strided.default,
                 aten._foreach_add_.Tensor):
        assert not fake_cache.fresh_outputs(func), func


def test_this_torchs_cache_is_the_one_read():
    assert fake_cache.supported()


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

    own = FakeTensorMode._cache_key, fake_cache.fake_tensor.extract_tensor_metadata
    with fake_cache.cache_blind_to_storage_offsets():
        blind = misses_of_two_products()
    assert (FakeTensorMode._cache_key, fake_cache.fake_tensor.extract_tensor_metadata) == own  # restored
    assert misses_of_two_products() > blind  # torch's own key: the second view's product is new to it


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
    monkeypatch.setattr(peak, "cache_blind_to_storage_offsets", contextlib.nullcontext)
    assert trace() == blind
