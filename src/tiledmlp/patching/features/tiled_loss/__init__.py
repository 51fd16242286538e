"""The tiled loss feature (tiled_loss=True): a causal LM's training loss through
tiled_cross_entropy, the logits never formed at once.

    forward.py   the forward installed on the causal LM, its per-patch state, install / remove
    head.py      what a causal LM does between its hidden states and its loss (kept positions,
                 logit scale, soft-capping, targets), as the tiled loss reproduces it
    probe.py     does the patched loss equal the model's own on random ids?

This module is the door: the feature, and what integrations need of a loss-patched model
(decoder_of, lifted, loss_patched, replaced_forward, softcap_of). Integrations register with
the feature object (TILED_LOSS): the server of TRL's `fused_lm_head=True` calls, handed to each
patch it installs, and hooks called when a probed model's loss is patched (TRL readies its
trainers' slot). A model whose result is declared instead of probed (the planner's fake model,
never trained) is patched without calling them.

Probe: the patched loss must equal the model's own on random ids (forward.py's probe_loss), run
without the sequence-parallel attention (the probe passes no position_ids), which is taken off
for it and put back. Apply: the loss forward, from a passed probe; where the probe refused, the
report carries the reason (and, without tiled MLPs, patch_model raises it).

Invariant: the loss is routed through tiled_cross_entropy only after the probe (or a caller's
declaration, the planner's) says it equals the model's own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from tiledmlp.config.patch import PatchConfig
from tiledmlp.patching.features.base import Feature, Found
from tiledmlp.patching.features.tiled_loss.forward import (
    LossProbe,
    decoder_of,
    install_loss,
    lifted,
    loss_description,
    loss_patched,
    probe_loss,
    replaced_forward,
    unpatch_loss,
)
from tiledmlp.patching.features.tiled_loss.head import softcap_of
from tiledmlp.patching.report import ReportParts
from tiledmlp.sequence_parallel.install import install as install_sp
from tiledmlp.sequence_parallel.install import installed_groups as sp_installed
from tiledmlp.sequence_parallel.install import remove as remove_sp

__all__ = [
    "TILED_LOSS",
    "LossProbe",
    "TiledLoss",
    "decoder_of",
    "lifted",
    "loss_patched",
    "replaced_forward",
    "softcap_of",
]


class TiledLoss(Feature):
    """The tiled loss (module docstring). Its probe's result: a LossProbe.

    Attributes:
        fused_head: the server of `fused_lm_head=True` calls an integration registered, or
            None: server(model, args, kwargs, tiles) -> the call's output.
        on_patch: hooks called with the causal LM when a probed model's loss is patched.
    """

    name = "tiled_loss"

    def __init__(self) -> None:
        self.fused_head: Callable[..., Any] | None = None
        self.on_patch: list[Callable[[nn.Module], None]] = []

    def register_fused_head(self, server: Callable[..., Any]) -> None:
        """Sets the server of `fused_lm_head=True` calls on models patched from now on (one at a
        time)."""
        self.fused_head = server

    def register_on_patch(self, hook: Callable[[nn.Module], None]) -> None:
        """Adds a hook called with the causal LM each time a probed model's loss is patched."""
        if hook not in self.on_patch:
            self.on_patch.append(hook)

    def probe(self, model: nn.Module, config: PatchConfig, found: Found) -> LossProbe:
        del found
        groups = sp_installed(model)
        if groups is not None:
            remove_sp(model)
        try:
            probed = probe_loss(model, config.loss_policy)
        finally:
            if groups is not None:
                install_sp(model, groups)
        if isinstance(probed, str) and not config.tiled_mlp:
            raise ValueError(
                f"patch_model: the loss of {type(model).__name__} cannot be tiled: {probed}"
            )
        return probed

    def apply(
        self, model: nn.Module, config: PatchConfig, probed: LossProbe, report: ReportParts
    ) -> None:
        if isinstance(probed, str):
            report.loss = probed
            return
        new = install_loss(model, config.loss_policy, probed, self.fused_head)
        if new and probed is not None:  # a probed model, to be trained: integrations ready it
            for hook in self.on_patch:
                hook(model)
        report.loss = loss_description(model) or "tiled"

    def remove(self, model: nn.Module) -> list[str]:
        return ["<loss>"] if unpatch_loss(model) else []

    def describe(self, model: nn.Module, report: ReportParts) -> None:
        described = loss_description(model)
        if described is not None:
            report.loss = described


TILED_LOSS = TiledLoss()
