"""The declared registrations (tiledmlp/registrations.py): every entry names an object that
exists and is of its kind, and a malformed entry is refused in one line. The layering test
(test_import_layers.py) lets this table alone import upward; here its targets are held."""

from __future__ import annotations

import pytest

from tiledmlp import registrations
from tiledmlp.registrations import ATTENTION_BACKEND, ENGINE_BACKENDS, ENGINE_CHECKS, provided


def test_every_declared_registration_resolves_to_its_kind() -> None:
    from tiledmlp.sequence_parallel.attention_backend import AttentionBackend, attention_backend

    assert ENGINE_CHECKS and ENGINE_BACKENDS
    for where in (*ENGINE_CHECKS.values(), *ENGINE_BACKENDS.values()):
        assert where.startswith("tiledmlp.integrations.") and callable(provided(where)), where
    assert isinstance(provided(ATTENTION_BACKEND), AttentionBackend)
    assert attention_backend() is provided(ATTENTION_BACKEND)


@pytest.mark.parametrize("where", ["tiledmlp.integrations.fsdp", ":check_mlp", "x:"])
def test_a_registration_not_module_colon_attribute_is_refused(where: str) -> None:
    with pytest.raises(ValueError, match="names 'module:attribute'"):
        registrations.provided(where)
