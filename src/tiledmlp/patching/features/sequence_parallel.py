"""The sequence parallelism feature (sequence_parallel_size=P or sequence_parallel_group):
Ulysses attention over P ranks (tiledmlp.sequence_parallel).

Probe: the process groups (made, or the model's own when it is already sequence-parallel at
that size), checked before any collective of a forward. Apply: the Ulysses attention, unless
the model already runs it.

Invariant: a model is sequence-parallel over one group size at a time; asking for another is an
error until unpatch_model.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from tiledmlp.config.patch import PatchConfig
from tiledmlp.patching.features.base import Feature, Found
from tiledmlp.patching.report import ReportParts
from tiledmlp.sequence_parallel.groups import SequenceParallelGroups, make_groups
from tiledmlp.sequence_parallel.install import install as install_sp
from tiledmlp.sequence_parallel.install import installed_groups as sp_installed
from tiledmlp.sequence_parallel.install import remove as remove_sp

__all__ = ["SEQUENCE_PARALLEL", "SequenceParallel"]


class SequenceParallel(Feature):
    """Sequence parallelism (module docstring). Its probe's result: the groups to install, or
    None (size 1: nothing to do)."""

    name = "sequence_parallel"

    def wanted(self, config: PatchConfig) -> bool:
        return config.sequence_parallel_size is not None or (
            config.sequence_parallel_group is not None
        )

    def probe(
        self, model: nn.Module, config: PatchConfig, found: Found
    ) -> SequenceParallelGroups | None:
        del found
        size, group = config.sequence_parallel_size, config.sequence_parallel_group
        current = sp_installed(model)
        if current is not None:
            if size is not None and size != current.sp_size:
                raise ValueError(
                    f"patch_model: the model is already sequence-parallel over "
                    f"{current.sp_size} ranks, asked for {size}; unpatch_model(model) first"
                )
            return current
        if size == 1 and group is None:
            return None
        return make_groups(size if size is not None else _group_size(group), group)

    def apply(
        self,
        model: nn.Module,
        config: PatchConfig,
        probed: SequenceParallelGroups | None,
        report: ReportParts,
    ) -> None:
        del config
        if probed is None:
            return
        if sp_installed(model) is None:
            install_sp(model, probed)
        report.sequence_parallel = (
            f"Ulysses over {probed.sp_size} ranks (data-parallel size {probed.dp_size})"
        )

    def remove(self, model: nn.Module) -> list[str]:
        return ["<sequence parallelism>"] if remove_sp(model) else []

    def describe(self, model: nn.Module, report: ReportParts) -> None:
        groups = sp_installed(model)
        if groups is not None:
            report.sequence_parallel = f"Ulysses over {groups.sp_size} ranks"


SEQUENCE_PARALLEL = SequenceParallel()


def _group_size(group: Any) -> int:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            "patch_model: sequence_parallel_group given but no process group is initialised; "
            "call torch.distributed.init_process_group first (e.g. run under torchrun)"
        )
    return int(dist.get_world_size(group))
