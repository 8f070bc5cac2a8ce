"""The peak anatomy's replay and naming, on hand-made allocator snapshots (no GPU needed)."""
from zerolens.peaks import live_block_sources, peak_anatomy, replay_to_peak

DS = [{"filename": "/x/site-packages/deepspeed/runtime/zero/stage_1_and_2.py", "line": 1, "name": "backward"}]
MODEL = [{"filename": "/x/site-packages/torch/nn/modules/linear.py", "line": 1, "name": "forward"},
         {"filename": "/x/zerolens/model.py", "line": 9, "name": "forward"}]


def segment(address, blocks):
    return {"device": 0, "address": address, "blocks": blocks}


def test_replay_finds_the_peak_and_who_was_alive():
    # Before the phase: a parameter at 0 (512 B) and a workspace at 512 (1024 B); a stale block at
    # 4096 (512 B) freed during the phase. During it: a bucket at 8192 (4096 B) comes and goes, an
    # activation gradient at 16384 (1024 B) stays.
    segments = [segment(0, [{"size": 512, "state": "active_allocated"},
                            {"size": 1024, "state": "active_allocated"},
                            {"size": 2560, "state": "inactive"},
                            {"size": 512, "state": "inactive"}]),
                segment(8192, [{"size": 4096, "state": "inactive"}]),
                segment(16384, [{"size": 1024, "state": "active_allocated"}])]
    events = [{"action": "free_requested", "addr": 4096, "size": 512},
              {"action": "free_completed", "addr": 4096, "size": 512},
              {"action": "alloc", "addr": 8192, "size": 4096, "frames": DS},
              {"action": "alloc", "addr": 16384, "size": 1024, "frames": []},
              {"action": "free_requested", "addr": 8192, "size": 4096},
              {"action": "segment_free", "addr": 8192, "size": 4096}]
    at_start, peak, live = replay_to_peak(segments, events)
    assert at_start == 512 + 1024 + 512
    assert peak == 512 + 1024 + 4096 + 1024
    assert sorted(live) == [0, 512, 8192, 16384]

    anatomy = peak_anatomy(segments, events, "backward", held={0: "param"}, activations=set(),
                           known_preexisting_bytes=1024)
    parts = anatomy["components"]
    assert anatomy["replayed_peak"] == peak
    assert parts["param"] == 512 and parts["workspace_and_earlier"] == 1024
    assert parts["deepspeed_transient"] == 4096 and parts["autograd_transient"] == 1024
    assert parts["unattributed"] == 0
    assert sum(parts.values()) == peak
    assert anatomy["largest_transients"] == {"deepspeed_transient: stage_1_and_2.py:backward": 4096,
                                             "autograd_transient: (no Python frame)": 1024}


def test_preexisting_bytes_beyond_what_is_known_are_unattributed():
    segments = [segment(0, [{"size": 2048, "state": "active_allocated"}])]
    anatomy = peak_anatomy(segments, [], "forward", held={}, activations=set(), known_preexisting_bytes=512)
    assert anatomy["components"]["workspace_and_earlier"] == 512
    assert anatomy["components"]["unattributed"] == 1536


def test_forward_blocks_are_named_by_address_then_by_code():
    segments = [segment(0, [{"size": 512, "state": "active_allocated"}, {"size": 512, "state": "active_allocated"}])]
    events = [{"action": "alloc", "addr": 0, "size": 512, "frames": MODEL},
              {"action": "alloc", "addr": 512, "size": 512, "frames": MODEL}]
    anatomy = peak_anatomy(segments, events, "forward", held={}, activations={0}, known_preexisting_bytes=0)
    assert anatomy["components"]["activation"] == 512
    assert anatomy["components"]["forward_transient"] == 512
    assert anatomy["largest_transients"] == {"forward_transient: model.py:forward": 512}


def test_a_reused_address_is_replayed_in_order():
    # 0 is freed and allocated again twice; only the last allocation is alive at the end.
    segments = [segment(0, [{"size": 1024, "state": "active_allocated"}])]
    events = [{"action": "free_requested", "addr": 0, "size": 512},
              {"action": "alloc", "addr": 0, "size": 2048, "frames": MODEL},
              {"action": "free_requested", "addr": 0, "size": 2048},
              {"action": "alloc", "addr": 0, "size": 1024, "frames": MODEL}]
    at_start, peak, live = replay_to_peak(segments, events)
    assert at_start == 512 and peak == 2048 and live[0].size == 2048


def test_live_block_sources_groups_by_allocating_code():
    segments = [segment(0, [{"size": 512, "state": "active_allocated", "frames": MODEL},
                            {"size": 512, "state": "inactive"},
                            {"size": 1024, "state": "active_allocated", "frames": MODEL}])]
    assert live_block_sources(segments) == {"model.py:forward": 1536}
