"""The planner's simulator: the pieces a fake training step is tracked and replayed with.

plan/fake_step.py runs one step of a model cut to a few decoder layers on fake tensors with
these pieces, and the planning API reads peaks from its record; nothing here imports plan/
outside this package (a floor below the planner: tests/package/test_import_layers.py), or
knows about stacks' names, searches or reports. The map, in the order a step goes through it:

    fast_fake.py        the planner's FakeTensorMode (faster dispatch-cache keys; stacked
                        experts on fake tensors)
    fake_memory.py      storages counted as they appear and die (a TorchDispatchMode)
    phase_tracker.py    the same by phase and segment, kernel workspaces added where named
    written_out.py      a GEMM into an `out=` tensor answered without dispatching it
    periodic_tiles.py   a tile loop's repeated tiles run once each, the trace rebuilt
    exchange.py         one GPU's attention under Ulysses sequence parallelism
    step_record.py      the allocation trace, each storage's phase and bytes, the segments
    segments.py         peaks by segment and their extrapolation to the model's depth
    deeper.py           the record of a step with one more decoder layer, built from a
                        simulated one (the middle layers are alike)
    caching_allocator.py PyTorch's CUDA caching allocator (with and without expandable
                        segments) replayed on a step's trace: the reserve beside the peak

How the pieces fit, with the figures behind them: docs/how-it-works/planner.md.
"""
