"""benchmarks/allocator_trace.py on the CPU: the trace's compact form, and the refusal off CUDA."""

from __future__ import annotations

import json

import pytest

from benchmarks.allocator_trace import compact_trace, main


def test_compact_trace_keeps_order_sizes_and_the_deciding_frame() -> None:
    frames = [
        {"filename": "/usr/lib/python3/site-packages/torch/_tensor.py", "line": 1, "name": "f"},
        {"filename": "/repo/src/tiledmlp/ops/loss.py", "line": 42, "name": "forward"},
    ]
    trace = [
        {"action": "segment_alloc", "addr": 0, "size": 20 << 20, "stream": 0},
        {"action": "alloc", "addr": 0, "size": 1000, "stream": 0, "frames": frames},
        {"action": "alloc", "addr": 1024, "size": 1000, "stream": 7, "frames": frames},
        {"action": "free_completed", "addr": 0, "size": 1024, "stream": 0, "frames": frames},
    ]
    events, names = compact_trace(trace)
    assert [e[:4] for e in events] == [
        ["segment_alloc", 0, 20 << 20, 0],
        ["alloc", 0, 1000, 0],
        ["alloc", 1024, 1000, 7],
        ["free_completed", 0, 1024, 0],
    ]
    assert names[events[1][4]] == "tiledmlp/ops/loss.py:42 forward"
    assert events[1][4] == events[2][4] != events[0][4] == events[3][4]
    assert names[events[0][4]] == ""


def test_off_cuda_it_refuses_in_one_line(tmp_path) -> None:
    job = json.dumps({"config": {"num_hidden_layers": 1}, "device": "cpu"})
    with pytest.raises(SystemExit, match="CUDA only"):
        main([job, str(tmp_path / "t.json.gz")])
