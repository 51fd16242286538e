"""How a model library's attention reaches the Ulysses wrapper: a small object passed in.

Sequence parallelism wraps the attention function a decoder calls by name (its config's
attention implementation). Naming a new function, finding the model's own function by name and
finding a model's text decoder config are the model library's business: the library's layer
(Hugging Face transformers: patching/hf_attention.py) provides an `AttentionBackend`, declared
in tiledmlp/registrations.py and imported from there when a backend is first asked for; this
package only calls it.

Invariant: nothing here imports a model library itself; the backend is asked for the original
attention function on every call (a function registered later is found).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tiledmlp.registrations import ATTENTION_BACKEND, provided

__all__ = ["AttentionBackend", "attention_backend"]


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


def attention_backend() -> AttentionBackend:
    """The declared backend (tiledmlp/registrations.py), its module imported on first use."""
    backend: AttentionBackend = provided(ATTENTION_BACKEND)
    return backend
