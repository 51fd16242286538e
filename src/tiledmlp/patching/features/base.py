"""The interface of a patch_model feature.

A feature is one thing patch_model can do to a model: tile its MLPs, its norms, its decoder
layers or its loss, offload its checkpointed activations, make its attention sequence-parallel.
Each one is an object with five steps:

- `wanted(config)`: whether the PatchConfig asks for it;
- `probe(model, config, found)`: reads the model, and may run its modules on real values (to
  recognise an MLP's structure, to check that the tiled loss equals the model's own); raises
  what the feature refuses, changes nothing; returns what `apply` needs;
- `apply(model, config, probed, report)`: installs the feature from that result, reading no
  values, so that it runs on a model built under fake tensors or on the meta device when the
  result is declared from structure instead of probed (the planner's case, plan/apply_stack.py);
- `blocked(model)` / `remove(model)`: why it cannot be taken off (another library's forward
  installed over ours), and taking it off;
- `describe(model, report)`: its part of the report for the model as it is now.

A feature's state lives on the model (the instances it changed) under keys its own modules
define; the hubs (patching/patch.py) go over the ordered list of features
(patching/features/__init__.py) and never name a key.

Invariant: apply(model, config, probe(model, config, found)) is what patch_model does for the
feature; remove(model) undoes exactly what apply did.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from tiledmlp.config.patch import PatchConfig
from tiledmlp.patching.report import ReportParts

__all__ = ["Feature", "Found"]

#: probe results by feature name (a planner declares some of them instead of probing)
Found = dict[str, Any]


class Feature:
    """One feature of patch_model (module docstring).

    Attributes:
        name: the PatchConfig switch that asks for it; also its key in Found.
    """

    name: str = ""

    def wanted(self, config: PatchConfig) -> bool:
        return bool(getattr(config, self.name))

    def probe(self, model: nn.Module, config: PatchConfig, found: Found) -> Any:
        """What apply needs, read from `model` (`found`: the probes of the features before
        this one). Default: nothing to read."""
        del model, config, found
        return None

    def apply(
        self, model: nn.Module, config: PatchConfig, probed: Any, report: ReportParts
    ) -> None:
        raise NotImplementedError

    def blocked(self, model: nn.Module) -> list[str]:
        """Why the feature cannot be removed from `model` now (empty: it can)."""
        del model
        return []

    def remove(self, model: nn.Module) -> list[str]:
        """Takes the feature off; returns what was restored (module names or "<feature>")."""
        raise NotImplementedError

    def describe(self, model: nn.Module, report: ReportParts) -> None:
        raise NotImplementedError
