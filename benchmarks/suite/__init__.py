"""The measurement suite: one command that measures everything within a time budget,
`python -m benchmarks.suite [--budget SECONDS] [--out DIR] [--smoke]`.

    run.py      the command: plans the parts' tasks within the budget, runs them, writes
                records.jsonl and summary.md
    parts.py    the parts in order of value, each giving its tasks with an estimate of seconds
    steps.py    the whole-model parts: whole training steps per length and stack with the
                planner's prediction beside them, the attention core by heads, the allocator
    sizes.py    the GPU-scale sizes and the toy sizes of `--smoke`
"""
