"""The peak anatomy's replay and naming, on hand-made allocator snapshots (no GPU needed)."""
from zerolens.measure.peaks import live_block_sources, peak_anatomy, replay_to_peak
from zerolens.strategies import registry

DS = [{"filename": "/x/site-packages/deepspeed/runtime/zero/stage_1_and_2.py", "line": 1, "name": "backward"}]
ADAM = [{"filename": "/x/site-packages/torch/optim/adam.py", "line": 1, "name": "_multi_tensor_adam"}] + DS
MODEL = [{"filename": "/x/site-packages/torch/nn/modules/linear.py", "line": 1, "name": "forward"},
         {"filename": "/x/zerolens/model.py", "line": 9, "name": "forward"}]
MARK = [{"filename": "/x/zerolens/peaks.py", "line": 1, "name": "trace_marker"}]
FSDP_GATHER = [{"filename": "/x/site-packages/torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py", "line": 1,
                "name": "foreach_all_gather"},
               {"filename": "/x/site-packages/torch/nn/modules/module.py", "line": 1, "name": "_call_impl"}] + MODEL[1:]


def segment(address, blocks):
    return {"device": 0, "address": address, "blocks": blocks}


def anatomy_of(segments, events, phase="backward", at_start=None, during=(), at_end=None, known=0, allocator_peak=None,
               strategy="zero2"):
    return peak_anatomy(segments, events, phase, at_start=at_start or {}, during=list(during), at_end=at_end or {},
                        known_preexisting_bytes=known, backend_code=registry.spec(strategy).transient_code,
                        allocator_peak=replay_to_peak(segments, events)[1] if allocator_peak is None else allocator_peak)


def test_replay_finds_the_peak_and_who_was_alive():
    # Before the phase: a parameter at 0 (512 B) and a workspace at 512 (1024 B); a stale block at
    # 4096 (512 B) freed during the phase. During it: a bucket at 8192 (4096 B) comes and goes, an
    # activation gradient at 16384 (1024 B) stays.
    segments = [segment(0, [{"size": 512, "requested_size": 512, "state": "active_allocated"},
                            {"size": 1024, "requested_size": 1000, "state": "active_allocated"},
                            {"size": 2560, "state": "inactive"},
                            {"size": 512, "state": "inactive"}]),
                segment(8192, [{"size": 4096, "state": "inactive"}]),
                segment(16384, [{"size": 1024, "requested_size": 1024, "state": "active_allocated"}])]
    events = [{"action": "free_requested", "addr": 4096, "size": 512},
              {"action": "free_completed", "addr": 4096, "size": 512},
              {"action": "alloc", "addr": 8192, "size": 4096, "frames": DS},
              {"action": "alloc", "addr": 16384, "size": 1024, "frames": []},
              {"action": "free_requested", "addr": 8192, "size": 4096},
              {"action": "segment_free", "addr": 8192, "size": 4096}]
    at_start, peak, live, _ = replay_to_peak(segments, events)
    assert at_start == 512 + 1000 + 512  # requested sizes: what the trace records
    assert peak == 512 + 1000 + 4096 + 1024
    assert sorted(live) == [0, 512, 8192, 16384]

    anatomy = anatomy_of(segments, events, at_start={0: "param"}, known=1000, allocator_peak=peak + 24)
    parts = anatomy["components"]
    assert parts["param"] == 512 and parts["workspace_and_earlier"] == 1000
    assert parts["backend_transient"] == 4096 and parts["autograd_transient"] == 1024
    assert parts["unattributed"] == 0 and parts["allocator_slack"] == 24
    assert sum(parts.values()) == anatomy["allocator_peak"]
    assert anatomy["largest_transients"] == {"backend_transient: stage_1_and_2.py:backward": 4096,
                                             "autograd_transient: (no Python frame)": 1024}


def test_preexisting_bytes_beyond_what_is_known_are_unattributed():
    segments = [segment(0, [{"size": 2048, "requested_size": 2048, "state": "active_allocated"}])]
    anatomy = anatomy_of(segments, [], "forward", known=512)
    assert anatomy["components"]["workspace_and_earlier"] == 512
    assert anatomy["components"]["unattributed"] == 1536


def test_an_address_map_names_only_blocks_alive_when_it_was_taken():
    # A forward activation at 0 is freed; a gradient is allocated at the same address and is
    # alive at the end. The end-of-phase map names address 0 "grad", which is right for the
    # second block only. A block at 1024 comes and goes around a census marked in the trace.
    segments = [segment(0, [{"size": 512, "requested_size": 512, "state": "active_allocated"},
                            {"size": 512, "state": "inactive"},
                            {"size": 4096, "state": "inactive"}])]
    events = [{"action": "alloc", "addr": 0, "size": 512, "frames": MODEL},
              {"action": "alloc", "addr": 1024, "size": 4096, "frames": DS},
              {"action": "alloc", "addr": 512, "size": 512, "frames": MARK},
              {"action": "free_requested", "addr": 512, "size": 512},
              {"action": "free_requested", "addr": 1024, "size": 4096},
              {"action": "free_requested", "addr": 0, "size": 512},
              {"action": "alloc", "addr": 0, "size": 512, "frames": MODEL}]
    anatomy = anatomy_of(segments, events, "forward", during=[{1024: "comm_buffer"}], at_end={0: "grad"})
    parts = anatomy["components"]
    assert anatomy["replayed_peak"] == 512 + 4096 + 512  # at the marker
    assert parts["comm_buffer"] == 4096  # named by the census taken while it was alive
    # The first block at 0 was not a gradient; with the marker's own 512 bytes it is a forward temporary.
    assert parts["grad"] == 0 and parts["forward_transient"] == 512 + 512


def test_temporaries_are_named_by_the_innermost_known_code():
    segments = [segment(0, [{"size": 512, "requested_size": 512, "state": "active_allocated"},
                            {"size": 512, "requested_size": 512, "state": "active_allocated"}])]
    events = [{"action": "alloc", "addr": 0, "size": 512, "frames": ADAM},
              {"action": "alloc", "addr": 512, "size": 512, "frames": MODEL}]
    parts = anatomy_of(segments, events, "step")["components"]
    assert parts["optimizer_transient"] == 512  # torch's Adam, though called from DeepSpeed
    assert parts["unattributed"] == 512  # model code allocating during the step: not expected


def test_fsdp_buffers_are_backend_transients_named_by_fsdp_code():
    # An all-gather output allocated by FSDP2's pre-forward hook, inside the model's forward.
    segments = [segment(0, [{"size": 2048, "requested_size": 2048, "state": "active_allocated"}])]
    events = [{"action": "alloc", "addr": 0, "size": 2048, "frames": FSDP_GATHER}]
    anatomy = anatomy_of(segments, events, "forward", strategy="fsdp2")
    assert anatomy["components"]["backend_transient"] == 2048 and anatomy["components"]["forward_transient"] == 0
    assert anatomy["largest_transients"] == {"backend_transient: _fsdp_collectives.py:foreach_all_gather": 2048}


def test_a_backends_temporaries_are_recognised_by_its_registry_entry_only():
    # The same DeepSpeed allocation in a run of FSDP2 is not FSDP2's temporary: outside torch, in
    # backward, it is unattributed (and fails the peak check if large), never silently the backend's.
    segments = [segment(0, [{"size": 4096, "requested_size": 4096, "state": "active_allocated"}])]
    events = [{"action": "alloc", "addr": 0, "size": 4096, "frames": DS}]
    assert anatomy_of(segments, events, strategy="zero2")["components"]["backend_transient"] == 4096
    parts = anatomy_of(segments, events, strategy="fsdp2")["components"]
    assert parts["backend_transient"] == 0 and parts["unattributed"] == 4096


def test_a_reused_address_is_replayed_in_order():
    segments = [segment(0, [{"size": 1024, "requested_size": 1024, "state": "active_allocated"}])]
    events = [{"action": "free_requested", "addr": 0, "size": 512},
              {"action": "alloc", "addr": 0, "size": 2048, "frames": MODEL},
              {"action": "free_requested", "addr": 0, "size": 2048},
              {"action": "alloc", "addr": 0, "size": 1024, "frames": MODEL}]
    at_start, peak, live, _ = replay_to_peak(segments, events)
    assert at_start == 512 and peak == 2048 and live[0].size == 2048 and live[0].free_index == 2


def test_live_block_sources_groups_by_allocating_code():
    segments = [segment(0, [{"size": 512, "state": "active_allocated", "frames": MODEL},
                            {"size": 512, "state": "inactive"},
                            {"size": 1024, "state": "active_allocated", "frames": MODEL}])]
    assert live_block_sources(segments) == {"model.py:forward": 1536}
