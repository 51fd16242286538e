"""How a model library's attention reaches the Ulysses wrapper: a small object passed in.

Sequence parallelism wraps the attention function a decoder calls by name (its config's
attention implementation). Naming a new function, finding the model's own function by name and
finding a model's text decoder config are the model library's business: the library's layer
(Hugging Face transformers: patching/hf_attention.py) registers an `AttentionBackend` with
`use_attention_backend` when it is imported (the package facade defers that import until a
backend is first asked for: ops/tiling/deferred.py), and this package only calls it.

Invariant: nothing here imports a model library; the backend is asked for the original
attention function on every call (a function registered later is found).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tiledmlp.ops.tiling.deferred import load_deferred

__all__ = ["AttentionBackend", "attention_backend", "use_attention_backend"]


@dataclass(frozen=True)
class AttentionBackend:
    """A model library's attention registry, as the Ulysses wrapper uses it.

    Attributes:
        register: (name, attention function, mask function) -> None: makes `name` an attention
            implementation a config may name, calling the attention function, whose masks the
            mask function builds.
        function: name -> the library's attention function of that name.
        text_config: a model's config -> its text decoder's config (the config itself for a
            plain decoder).
    """

    register: Callable[[str, Callable[..., Any], Callable[..., Any]], None]
    function: Callable[[str], Callable[..., Any]]
    text_config: Callable[[Any], Any]


_BACKEND: list[AttentionBackend] = []


def use_attention_backend(backend: AttentionBackend) -> None:
    """Makes `backend` the one sequence parallelism uses (replacing any before it)."""
    _BACKEND[:] = [backend]


def attention_backend() -> AttentionBackend:
    """The registered backend.

    Raises:
        RuntimeError: none is registered (importing tiledmlp registers Hugging Face's).
    """
    if not _BACKEND:
        load_deferred()  # the patching layer registers Hugging Face's (ops/tiling/deferred.py)
    if not _BACKEND:
        raise RuntimeError(
            "tiledmlp: sequence parallelism has no attention backend; import tiledmlp (which "
            "registers Hugging Face transformers' attention interface) before installing it"
        )
    return _BACKEND[0]
