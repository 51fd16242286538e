"""The support matrix (benchmarks/coverage.py): tiny configs hold what the full ones hold, a run
reproduces the committed records, and the docs page is the committed records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import coverage, coverage_build, coverage_table
from benchmarks.coverage_build import MAX_PARAMS, NotBuildable, build_tiny, tiny_config


def test_the_docs_page_is_the_committed_records() -> None:
    assert coverage_table.check_page(coverage_table.PAGE.read_text()) == []


def test_the_records_name_their_versions_and_every_popular_architecture() -> None:
    head, records = coverage.load()
    assert set(head) == {"transformers", "torch"}
    cells = {(r["model_type"], r["stack"]) for r in records}
    assert len(cells) == len(records)
    assert len(coverage.POPULAR) >= 40
    assert {(m, s) for m in coverage.POPULAR for s in coverage.STACKS} <= cells


def test_a_changed_record_is_caught_and_rewritten(tmp_path: Path) -> None:
    records = tmp_path / "coverage.jsonl"
    head = {"transformers": "1.0", "torch": "2.0"}
    row = {"model_type": "llama", "class": "LlamaForCausalLM", "stack": "mlp"}
    exact = {**row, "status": "exact", "detail": "", "tiled": {"mlp": 2}, "untiled": []}
    records.write_text(f"{json.dumps(head)}\n{json.dumps(exact)}\n")
    page = tmp_path / "page.md"
    page.write_text("# t\n<!-- coverage-popular -->\n<!-- /coverage-popular -->\n"
                    "<!-- coverage-table -->\nold\n<!-- /coverage-table -->\n")  # fmt: skip
    assert coverage_table.check_page(page.read_text(), records) == [
        "the popular families' table differs from its records",
        "the support matrix differs from its records",
    ]
    coverage_table.write_page(page, records)
    text = page.read_text()
    assert coverage_table.check_page(text, records) == []
    assert "| `llama` | LlamaForCausalLM | exact: mlp x2 |  |  |" in text
    # the popular table first, the same cell; a family without records says so
    assert text.index("| Llama | `llama` | exact: mlp x2 | not run | not run |") < text.index(
        "### Architectures that tile (1)"
    )
    assert "| Qwen3-MoE | `qwen3_moe` | not run | not run | not run |" in text
    refused = {**row, "status": "refused", "detail": "no MLP"}
    records.write_text(f"{json.dumps(head)}\n{json.dumps(refused)}\n")
    assert coverage_table.check_page(text, records) != []


def test_write_records_replaces_only_the_architectures_run(tmp_path: Path) -> None:
    path = tmp_path / "coverage.jsonl"
    old = [
        {"model_type": m, "stack": s, "status": "exact"}
        for m in ("gpt2", "llama")
        for s in ("mlp",)
    ]
    coverage.write_records(old, path)
    coverage.write_records([{"model_type": "llama", "stack": "mlp", "status": "refused"}], path)
    _, got = coverage.load(path)
    assert [(r["model_type"], r["status"]) for r in got] == [
        ("gpt2", "exact"),
        ("llama", "refused"),
    ]


def test_a_tiny_config_keeps_every_kind_of_layer_and_no_dropout() -> None:
    gemma3 = tiny_config("gemma3_text")
    assert set(gemma3.layer_types) == {"sliding_attention", "full_attention"}
    assert gemma3.num_hidden_layers == len(gemma3.layer_types) <= 8
    assert gemma3.hidden_size == 64 and gemma3.attention_dropout == 0.0
    mla = tiny_config("deepseek_v3")
    assert mla.head_dim == mla.qk_rope_head_dim
    assert mla.first_k_dense_replace < mla.num_hidden_layers  # a MoE layer is kept
    gpt2 = tiny_config("gpt2")
    assert gpt2.resid_pdrop == gpt2.embd_pdrop == gpt2.attn_pdrop == 0.0


def test_an_architecture_that_stays_large_is_not_built_and_says_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert build_tiny("llama").params < MAX_PARAMS
    monkeypatch.setattr(coverage_build, "MAX_PARAMS", 1000)  # llama: ~107K at tiny sizes
    with pytest.raises(
        NotBuildable, match=r"^0\.1M parameters at tiny sizes \(model holds 0\.1M\)$"
    ):
        build_tiny("llama")


def test_an_unknown_architecture_is_a_record_not_an_exception() -> None:
    records = coverage.run_architecture("no_such_model", ["mlp"])
    assert records == [
        {
            "model_type": "no_such_model",
            "class": "",
            "stack": "mlp",
            "status": "not buildable",
            "detail": "not a causal LM of the installed transformers",
        }
    ]


def _rerun_matches_the_records(model_types: list[str]) -> None:
    _, committed = coverage.load()
    want = {(r["model_type"], r["stack"]): coverage.comparable(r) for r in committed}
    got = coverage.run_coverage(model_types)
    wrong = [
        f"{r['model_type']} / {r['stack']}: {coverage.comparable(r)} != "
        f"{want.get((r['model_type'], r['stack']))}"
        for r in got
        if coverage.comparable(r) != want.get((r["model_type"], r["stack"]))
    ]
    assert not wrong, "the matrix changed; regenerate it (docs/supported-models.md):\n" + "\n".join(
        wrong
    )


_CHEAP = ["xlm", "minicpm3", "xlstm"]


def test_a_rerun_of_some_architectures_gives_the_committed_records() -> None:
    """A post-norm model with tiled norms, a multi-head-latent-attention model and xLSTM (a
    norm over (batch, seq, heads, head_dim), left untiled): a few seconds of CPU time."""
    _rerun_matches_the_records(_CHEAP)


# Popular architectures rerun only with --all-architectures: kimi_linear's linear attention runs
# transformers' reference chunked kernel on the CPU (flash-linear-attention is CUDA only), 70 to
# 140 s of the suite for one architecture, where every other popular one takes under a second.
_OPT_IN = ["kimi_linear"]
_POPULAR = [m for m in coverage.POPULAR if m not in _CHEAP and m not in _OPT_IN]
_QUARTERS = [_POPULAR[i::4] for i in range(4)]


@pytest.mark.slow  # the popular list in quarters, 3 stacks each: about 5 s of CPU time a quarter
@pytest.mark.parametrize("quarter", range(4))
def test_a_rerun_of_the_popular_architectures_gives_the_committed_records(quarter: int) -> None:
    _rerun_matches_the_records(_QUARTERS[quarter])


def test_every_architecture_gives_the_committed_records(request: pytest.FixtureRequest) -> None:
    """Opt-in (pytest --all-architectures): every causal LM of the installed transformers."""
    if not request.config.getoption("--all-architectures"):
        pytest.skip("every architecture: opt in with --all-architectures")
    from benchmarks.coverage_build import causal_lm_types

    _rerun_matches_the_records(sorted(causal_lm_types()))


def test_a_rerun_compares_the_numbers_its_messages_quote_to_four_digits() -> None:
    """Another transformers release may move a quoted loss in its last float32 digits (xLSTM's
    own loss 38.65808868408203 under one, 38.6580924987793 under the next): the same record;
    a loss that moved in its first four digits, or another reason, is not."""
    reason = "loss: the model's own loss ({}) differs from the LM-head cross-entropy ({})"
    record = {"model_type": "xlstm", "status": "exact", "detail": "", "max_loss_diff": 0.0,
              "untiled": [reason.format(38.65808868408203, 93.62931823730469)]}  # fmt: skip
    rerun = {**record, "max_loss_diff": 1e-7,
             "untiled": [reason.format(38.6580924987793, 93.62932586669922)]}  # fmt: skip
    assert coverage.comparable(rerun) == coverage.comparable(record)
    moved = {**record, "untiled": [reason.format(38.7, 93.62931823730469)]}
    assert coverage.comparable(moved) != coverage.comparable(record)
    other = {**record, "untiled": ["loss: a soft-cap it reads elsewhere"]}
    assert coverage.comparable(other) != coverage.comparable(record)
