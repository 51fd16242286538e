"""Kernels other libraries put in a model before patch_model sees it, and who owns each job.

Liger-Kernel (`apply_liger_kernel_to_<family>(model=...)`, `AutoLigerKernelForCausalLM`) swaps
forwards on instances or classes: its SwiGLU/GeGLU MLPs, RMSNorm, fused linear cross-entropy
(a forward on the causal LM) and its own tiled MLPs (`LigerTiledSwiGLUMLP`). transformers'
hub kernels (`kernels.kernelize`) replace the forward of classes marked with
`use_kernel_forward_from_hub` and record the repository on the instance (`_kernel_repo`).

Recognised by where a module's forward comes from, never by name alone:
- a Liger MLP: tiled like any MLP, the report saying so: where detection recognises the
  formula (transformers' MLP with Liger's forward bound on it), the fast path replaces Liger's
  elementwise kernel with the same arithmetic; a Liger MLP class (no activation module to
  read) takes the generic path, its own forward recomputed per tile;
- a Liger tiled MLP: already tiled, left alone (tiling it again would run tiles of tiles);
- Liger's RMSNorm: already lean (it keeps its input and one float per token), left alone;
- a hub kernel on any module: left alone (its forward is someone else's kernel; wrapping it
  would tile a function whose saved tensors we cannot see);
- Liger's fused linear cross-entropy: the tiled loss, when asked for, owns the loss (it
  replaces the forward Liger installed, which then no longer runs); without tiled_loss,
  Liger's computes it.

Invariant: each job (an MLP, a norm, the loss) has one owner, named in the report; nothing here
changes the model.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = [
    "hub_kernel_of",
    "left_alone",
    "liger_kind",
    "liger_loss",
    "replaced_note",
]

_LIGER = "liger_kernel."


def _forward_owner(module: nn.Module) -> tuple[str, str] | None:
    """(module, class qualname) of the code `module.forward` runs: the instance's own forward
    where one was set, else its class's."""
    forward = module.__dict__.get("forward")
    func = getattr(forward, "__func__", forward) if forward is not None else type(module).forward
    where = getattr(func, "__module__", None)
    qualname = getattr(func, "__qualname__", "")
    if not isinstance(where, str) or not isinstance(qualname, str):
        return None
    return where, qualname.rsplit(".", 1)[0] if "." in qualname else type(module).__name__


def liger_kind(module: nn.Module) -> str | None:
    """The Liger class whose forward `module` runs (e.g. "LigerSwiGLUMLP", "LigerRMSNorm",
    "LigerTiledSwiGLUMLP"), or None when it runs no Liger forward. A module patched by
    tiledmlp is judged by the forward it replaced."""
    from tiledmlp.patching.state import STATE

    state = module.__dict__.get(STATE)
    owner: tuple[str, str] | None
    if state is not None:
        saved = state.saved
        if saved is None:
            owner = (type(module).__module__, type(module).__name__)
        else:
            func = getattr(saved, "__func__", saved)
            owner = (
                getattr(func, "__module__", ""),
                getattr(func, "__qualname__", "").split(".")[0],
            )
    else:
        owner = _forward_owner(module)
    if owner is None:
        return None
    where, cls = owner
    if where.startswith(_LIGER):
        return cls
    if type(module).__module__.startswith(_LIGER):
        return type(module).__name__
    return None


def hub_kernel_of(module: nn.Module) -> str | None:
    """The hub repository whose kernel `module` runs (kernels.kernelize), or None."""
    repo = module.__dict__.get("_kernel_repo")
    if repo is None:
        return None
    for attr in ("repo_id", "_repo_id", "repo_path", "layer_name"):
        value = getattr(repo, attr, None)
        if value is not None:
            return str(value)
    return type(repo).__name__


def left_alone(module: nn.Module, what: str) -> str | None:
    """Why `module` (an MLP or a norm, `what`) must not be tiled because another library's
    kernel already does the job (module docstring); None when it may be tiled."""
    hub = hub_kernel_of(module)
    if hub is not None:
        return (
            f"{type(module).__name__}: runs a hub kernel ({hub}, kernels.kernelize); left alone "
            f"(tiling would wrap a kernel whose saved tensors it cannot see)"
        )
    kind = liger_kind(module)
    if kind is None:
        return None
    if "Tiled" in kind:
        return f"{kind}: Liger's own tiled {what}, already tiled; left alone"
    if what == "norm" and "Norm" in kind:
        return (
            f"{kind}: Liger's {what} is already lean (it keeps its input and one float per "
            "token); left alone"
        )
    return None


def replaced_note(module: nn.Module, path: str) -> str | None:
    """For a module tiledmlp tiles (on `path`, "fast" or "generic") over a Liger forward: the
    report's note saying who computes it."""
    kind = liger_kind(module)
    if kind is None or "Tiled" in kind:
        return None
    if path == "fast":
        return (
            f"tiled over {kind} (the tiled MLP computes the same activation; Liger's kernel no "
            "longer runs)"
        )
    return f"tiled over {kind} (its own forward, Liger's kernel included, runs per tile)"


def liger_loss(forward: Any) -> str | None:
    """The Liger module whose loss forward `forward` (a causal LM's forward, bound or not) is,
    e.g. "liger_kernel.transformers.model.llama"; None when it is not Liger's."""
    func = getattr(forward, "__func__", forward)
    where = getattr(func, "__module__", None)
    if isinstance(where, str) and where.startswith(_LIGER):
        return where
    return None
