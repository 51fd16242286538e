"""torch.compile of patched models: one graph (fullgraph=True) where the model itself compiles
as one, the same loss and every gradient as the eager patched model (float32, 1e-5).

Graphs are counted by torch's own CompileCounterWithBackend. Some tests compile with the
aot_eager backend (dynamo, AOTAutograd, the operators' fake implementations and autograd
formulas), the others with inductor, the default backend.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

from hf_models import VOCAB, tiny_causal_lm
from tiledmlp import patch_model
from tiledmlp.config.stacks import stack_keywords

from conftest import assert_close_rel

# The stack the families compile with fullgraph=True (tiled layers: their own tests below);
# activation offloading's saved-tensor hooks are not traced by dynamo (see
# test_offloading_compiles_in_five_graphs_for_one_layer).
FULLGRAPH_KEYWORDS = {"tiled_loss": True, "tiled_norms": True}


def _model(
    family: str, keywords: dict[str, bool] | None, checkpointing: bool, layers: int = 2
) -> Any:
    model = tiny_causal_lm(family)
    if layers < len(model.model.layers):  # fewer layers: a shorter trace
        del model.model.layers[layers:]
        model.config.num_hidden_layers = layers
    if keywords is not None:
        patch_model(model, num_tiles=3, **keywords)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _step(model: Any, ids: torch.Tensor) -> torch.Tensor:
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return loss.detach()


def _compiled_against_eager(
    family: str,
    keywords: dict[str, bool] | None,
    backend: str,
    *,
    fullgraph: bool = True,
    checkpointing: bool = False,
    layers: int = 2,
) -> int:
    """Compiles the patched model, checks loss and grads against the eager patched model, and
    returns the number of graphs compiled (torch's counters hold the graph breaks)."""
    eager = _model(family, keywords, checkpointing, layers)
    model = copy.deepcopy(eager)
    ids = torch.randint(3, VOCAB, (2, 23), generator=torch.Generator().manual_seed(0))
    ref = _step(eager, ids)
    torch._dynamo.reset()
    counters.clear()
    counter = CompileCounterWithBackend(backend)
    # transformers' checkpointed layers set a context variable inside the checkpoint; dynamo
    # refuses that side effect unless told it need not be replayed in the recompute
    with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=checkpointing):
        loss = _step(torch.compile(model, backend=counter, fullgraph=fullgraph), ids)
    assert_close_rel(loss, ref, "loss")
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert p.grad is not None, name
        assert_close_rel(p.grad, q.grad, name)
    return counter.frame_count


@pytest.mark.slow  # the quick representatives: tests/ops/test_library.py
def test_compiled_llama_with_tiled_mlps_and_loss_is_one_graph() -> None:
    assert _compiled_against_eager("llama", stack_keywords("tiled_mlp_loss"), "aot_eager") == 1


FAMILIES = ["llama", "qwen3", "gemma3"]
STACKS = ["tiled_mlp", "tiled_mlp_loss", "tiled_mlp_loss_norms"]
# Each family and each stack once under inductor (the diagonal), every pair through AOTAutograd:
# inductor's first compile of a step is 30-40 s of a core, its C++ kernels built cold.
INDUCTOR = set(zip(FAMILIES, STACKS))


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("stack", STACKS)
def test_fullgraph_families_and_stacks(family: str, stack: str) -> None:
    keywords = FULLGRAPH_KEYWORDS if stack == "tiled_mlp_loss_norms" else stack_keywords(stack)
    backend = "inductor" if (family, stack) in INDUCTOR else "aot_eager"
    assert _compiled_against_eager(family, keywords, backend) == 1


@pytest.mark.slow
def test_fullgraph_inductor_under_activation_checkpointing() -> None:
    frames = _compiled_against_eager("llama", FULLGRAPH_KEYWORDS, "inductor", checkpointing=True)
    assert frames == 1


@pytest.mark.slow
def test_qwen3_moe_patched_is_one_graph() -> None:
    # The experts block takes the per-tile checkpoints (ops/mlp/traced.py). The untiled model
    # does not compile with fullgraph=True: transformers' router-logit capture takes a lock.
    frames = _compiled_against_eager("qwen3_moe", FULLGRAPH_KEYWORDS, "inductor", layers=1)
    assert frames == 1


@pytest.mark.slow  # ~10 s; the quick representative: tests/patching/test_attention_core.py
def test_tiled_layers_under_checkpointing_are_one_graph() -> None:
    # The blocks trace as per-tile checkpoints inside the layer's checkpoint, the attention as
    # one SDPA call (without checkpointing: tests/patching/test_attention_core.py).
    frames = _compiled_against_eager(
        "llama", {"tiled_layers": True}, "aot_eager", checkpointing=True, layers=1
    )
    assert frames == 1


@pytest.mark.slow
def test_offloading_compiles_in_five_graphs_for_one_layer() -> None:
    # Activation offloading enters saved_tensors_hooks around each checkpointed layer, whose
    # __init__ dynamo refuses to trace (torch.autograd is on its skip list): graph breaks around
    # the layer, 5 graphs for 1 layer, exact; fullgraph=True raises. A change in torch shows here.
    keywords = {"tiled_loss": True, "activation_offloading": True}
    frames = _compiled_against_eager(
        "llama", keywords, "aot_eager", fullgraph=False, checkpointing=True, layers=1
    )
    reasons = dict(counters["graph_break"])
    assert frames == 5, reasons
    assert reasons and all("saved_tensors_hooks.__init__" in reason for reason in reasons), reasons
    with pytest.raises(torch._dynamo.exc.Unsupported, match="saved_tensors_hooks"):
        _compiled_against_eager("llama", keywords, "aot_eager", checkpointing=True, layers=1)
