import pytest
import torch
from torch import nn

from zerolens.measure.census import Holdings, MeasurementError, count, required, storage_bytes


def test_views_of_one_buffer_count_once_at_full_size():
    flat = torch.zeros(100, dtype=torch.bfloat16)
    views = [flat[:10], flat[10:60], flat[60:]]
    assert storage_bytes(views) == 200
    assert storage_bytes(views[:1]) == 200  # a view keeps its whole buffer alive


def test_tied_weights_count_once():
    emb = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    assert storage_bytes([emb.weight, head.weight]) == 10 * 4 * 4


def test_a_storage_counts_under_the_first_component_only():
    p = torch.zeros(8)
    g = torch.zeros(4, dtype=torch.float16)
    b = torch.zeros(2, dtype=torch.float64)
    out = count(Holdings(param=[p], grad=[g, p], optimizer_state=[p[:2]], comm_buffer=[b, g],
                         grad_partition_elements=4))
    assert out == {"param_bytes": 32, "grad_bytes": 8, "optimizer_state_bytes": 0, "comm_buffer_bytes": 16,
                   "grad_partition_elements": 4}


def test_none_and_meta_tensors_are_skipped():
    assert storage_bytes([None, torch.empty(3, device="meta")]) == 0


def test_missing_attribute_fails_loudly():
    with pytest.raises(MeasurementError, match="has no attribute 'averaged_gradients'"):
        required(object(), "averaged_gradients")
