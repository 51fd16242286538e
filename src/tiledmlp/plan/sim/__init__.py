"""The planner's simulator: one training step run on fake tensors, its storages tracked, its
record extended to the model's depth and replayed through the CUDA caching allocator.

The planning API (plan/estimate.py, plan/model.py, plan/search.py, plan/layer.py) asks it for
a step's record and reads peaks from it; nothing here knows about stacks' names, searches or
reports. The map, in the order a step goes through it:

What a fake step is
    fake_step.py        a model cut to a few decoder layers, built under FakeTensorMode, the
                        features (a PatchConfig) applied, one step (config/plan.py's
                        StepSpec) run: forward, loss, backward, optimizer step
    fast_fake.py        the planner's FakeTensorMode (faster dispatch-cache keys; stacked
                        experts on fake tensors)
    fake_memory.py      storages counted as they appear and die (a TorchDispatchMode)
    phase_tracker.py    the same by phase and segment, kernel workspaces added where named
    written_out.py      a GEMM into an `out=` tensor answered without dispatching it
    periodic_tiles.py   a tile loop's repeated tiles run once each, the trace rebuilt
    exchange.py         one GPU's attention under Ulysses sequence parallelism

What a step recorded, and a depth built from a few layers
    step_record.py      the allocation trace, each storage's phase and bytes, the segments
    segments.py         peaks by segment and their extrapolation to the model's depth
    deeper.py           the record of a step with one more decoder layer, built from a
                        simulated one (the middle layers are alike)

How the allocator is replayed
    caching_allocator.py PyTorch's CUDA caching allocator (with and without expandable
                        segments) replayed on a step's trace: the reserve beside the peak
"""
