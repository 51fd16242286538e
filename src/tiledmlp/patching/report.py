"""PatchReport: what patch_model did to a model, and the parts each feature fills in.

Every feature (patching/features/) writes its own part of a ReportParts, when it is applied
(patch_model) and when it describes the model as it is now (patch_report); ReportParts.report()
assembles the frozen PatchReport.

Invariant: a report's text depends only on its fields; each feature fills only its own fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tiledmlp.config.tiled import TiledMLPConfig
from tiledmlp.patching.state import LAYER_KIND

__all__ = ["PatchReport", "ReportParts"]


@dataclass(frozen=True)
class PatchReport:
    """What patch_model did: a snapshot, taken when it ran. A model changed since (PEFT
    adapters injected into its MLPs, say, which move them to the generic path at their next
    call) is described as it is now by patch_report(model).

    Attributes:
        patched: qualified names of the modules now tiled (including ones already patched).
        paths: name -> "fast: <kind>" or "generic: <kind>".
        skipped: (name, reason) for candidates left untiled.
        config: the tile policy applied.
        loss: with tiled_loss=True, "tiled" when the training loss now runs through
            tiled_cross_entropy ("tiled, except calls with logits_to_keep as ..." naming the
            forms frameworks pass that run the model's own loss, and why; the others are in the
            debug log), else the reason it does not; None when not asked.
        offloading: with activation_offloading=True, what is offloaded (and, where
            transformers' own offload=True is on too, that ours owns the job); without it,
            transformers' offloading where that is on; else None.
        sequence_parallel: with sequence_parallel_size, what the attention now runs as (Ulysses
            over P ranks, wrapping the model's own implementation); None when not asked.
        attention_kernel: with attention_kernel other than a plain "auto", what each decoder
            layer's attention call runs; None when not asked.
        native: who owns a job where another library's piece was in place (Liger-Kernel's
            MLP forwards tiled over, its fused linear cross-entropy, TRL's fused LM head):
            one line each (patching/native.py).
    """

    patched: list[str]
    paths: dict[str, str]
    skipped: list[tuple[str, str]] = field(default_factory=list)
    config: TiledMLPConfig = field(default_factory=TiledMLPConfig)
    loss: str | None = None
    offloading: str | None = None
    sequence_parallel: str | None = None
    attention_kernel: str | None = None
    native: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        norms = sum(1 for name in self.patched if self.paths[name] == "generic: norm")
        layers = sum(1 for name in self.patched if self.paths[name] == f"generic: {LAYER_KIND}")
        mlps = len(self.patched) - norms - layers
        parts = [f"{mlps} MLP(s)"] if mlps or not (norms or layers) else []
        parts += [f"{norms} norm(s)"] if norms else []
        parts += [f"{layers} decoder layer(s)"] if layers else []
        what = " and ".join(parts)
        lines = [f"tiled {what} with {self.config}"]
        lines += [f"  {name}: {self.paths[name]}" for name in self.patched]
        lines += [f"  skipped {name}: {why}" for name, why in self.skipped]
        if self.loss is not None:
            lines.append(f"  loss: {self.loss}")
        if self.offloading is not None:
            lines.append(f"  activation offloading: {self.offloading}")
        if self.sequence_parallel is not None:
            lines.append(f"  sequence parallelism: {self.sequence_parallel}")
        if self.attention_kernel is not None:
            lines.append(f"  attention kernel: {self.attention_kernel}")
        lines += [f"  beside native pieces: {line}" for line in self.native]
        return "\n".join(lines)


@dataclass
class ReportParts:
    """A PatchReport being filled in by the features (the same fields, mutable).

    Attributes:
        paths: tiled module name -> "fast: <kind>" or "generic: <kind>".
        skipped: (name, reason) for candidates left untiled.
        config: the tile policy of the tiled modules; None: none seen (the default policy).
        loss: the tiled loss's part (PatchReport.loss).
        offloading: activation offloading's part.
        sequence_parallel: sequence parallelism's part.
        attention_kernel: the attention kernel's part.
        native: who owns a job beside another library's piece (PatchReport.native).
    """

    paths: dict[str, str] = field(default_factory=dict)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    config: TiledMLPConfig | None = None
    loss: str | None = None
    offloading: str | None = None
    sequence_parallel: str | None = None
    attention_kernel: str | None = None
    native: list[str] = field(default_factory=list)

    def empty(self) -> bool:
        """Whether no feature reported anything installed."""
        parts = (self.loss, self.offloading, self.sequence_parallel, self.attention_kernel)
        return not self.paths and all(part is None for part in parts)

    def report(self) -> PatchReport:
        return PatchReport(
            sorted(self.paths),
            dict(self.paths),
            list(self.skipped),
            self.config or TiledMLPConfig(),
            self.loss,
            self.offloading,
            self.sequence_parallel,
            self.attention_kernel,
            list(self.native),
        )
