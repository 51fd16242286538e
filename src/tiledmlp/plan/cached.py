"""plan_model's per-stack answers through the cache (plan/cache.py): a stack planned before
for the same configuration, length and options is read back, the others are planned and kept.

Invariant: an entry read from the cache is the entry plan_model returned for the same key;
what is not in the cache is planned exactly as plan_model plans it.
"""

from __future__ import annotations

from typing import Any

from tiledmlp.plan import cache

__all__ = ["plan_stacks"]


def plan_stacks(
    config: Any,
    fields: dict[str, Any] | None,
    *,
    stacks: tuple[str, ...],
    **options: Any,
) -> dict[str, Any]:
    """{stack: plan_model's entry} for `stacks`, each from the cache where it holds one.

    Args:
        config: the model's transformers config, or a function of no arguments that builds
            it (called only where the cache misses: a hit imports no transformers).
        fields: what identifies the configuration (cache.config_fields); None: nothing is read
            from or written to the cache.
        stacks: the stacks to plan.
        options: plan_model's keyword options (seq_len, dtype, ...); `processes` does not
            change the answer and is not part of the key.
    """
    keyed = {k: v for k, v in options.items() if k != "processes"}
    keys = {}
    if fields is not None:
        keys = {s: cache.cache_key("stack", fields, {**keyed, "stack": s}) for s in stacks}
    found = {s: cache.load(k) for s, k in keys.items()}
    missing = tuple(s for s in stacks if found.get(s) is None)
    if missing:
        from tiledmlp.plan.model import plan_model  # the simulation: only where it is needed

        built = config() if callable(config) else config
        planned = plan_model(built, stacks=missing, **options)
        for stack, entry in planned.items():
            found[stack] = entry
            if stack in keys:
                cache.store(keys[stack], entry)
    return {s: found[s] for s in stacks}
