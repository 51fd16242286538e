"""What `--model` names, checked before any model is built (train/model_source.py): a run folder
holding only checkpoints names its newest one; a Hub id that is not cached, with the Hub out of
reach, is said to be the network at once, with the ways around it."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tiledmlp.train import model_source
from tiledmlp.train.model_source import check_model, unreachable


def _checkpoint(run: Path, step: int, complete: bool = True) -> Path:
    path = run / f"checkpoint-{step}"
    path.mkdir(parents=True)
    if complete:
        (path / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    return path


def test_a_run_folder_of_checkpoints_names_its_newest_complete_one(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _checkpoint(run, 3)
    _checkpoint(run, 7)
    _checkpoint(run, 9, complete=False)  # a save that did not finish is not offered
    with pytest.raises(ValueError) as info:
        check_model(str(run))
    assert str(info.value) == (
        f"--model {run} has no config.json; its newest checkpoint is {run / 'checkpoint-7'}: "
        f"use --model {run / 'checkpoint-7'}"
    )


def test_a_folder_without_config_or_checkpoints_says_what_a_model_folder_holds(
    tmp_path: Path,
) -> None:
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match=r"has no config\.json; expected a model saved with"):
        check_model(str(tmp_path))


@pytest.fixture
def no_hub_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)


def test_an_unreachable_hub_is_said_to_be_the_network(
    monkeypatch: pytest.MonkeyPatch, no_hub_offline: None
) -> None:
    pytest.importorskip("huggingface_hub")
    # port 9 (discard) on this machine: nothing listens, the connection is refused at once
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    with pytest.raises(ValueError) as info:
        check_model("tiledmlp-nobody/not-a-cached-model")
    message = str(info.value)
    assert "\n" not in message
    assert "the Hub (http://127.0.0.1:9) cannot be reached over the network" in message
    assert "HF_HUB_OFFLINE=1" in message and "local model folder" in message
    # the check waits seconds at most, not the download's retries
    assert model_source.PROBE_TIMEOUT_S <= 5


@pytest.fixture
def answering_server() -> Iterator[str]:
    """A local HTTP server that answers every request with 404."""

    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_HEAD(self) -> None:
            self.send_response(404)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), NotFound)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


def test_a_hub_that_answers_is_reachable_whatever_its_status(answering_server: str) -> None:
    assert unreachable(answering_server) is None
    assert unreachable("http://127.0.0.1:9") is not None


def test_a_model_trained_at_another_length_is_noted(tmp_path: Path) -> None:
    from tiledmlp.train.model_source import seq_len_note

    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"seq_len": 4096, "model": "tiny"}))
    assert seq_len_note(str(run), 2048) == (
        f"--model {run} was trained on 4096-token sequences; this run trains on 2048 "
        "(--seq-len 4096 keeps the length)"
    )
    assert seq_len_note(str(run), 4096) is None
    checkpoint = _checkpoint(run, 7)
    (checkpoint / "tiledmlp_run.json").write_text(
        json.dumps({"options": {"seq_len": 1024}, "max_steps": 9})
    )
    assert "trained on 1024-token sequences" in (seq_len_note(str(checkpoint), 2048) or "")
    assert seq_len_note("tiny", 2048) is None  # a preset is trained from scratch


def test_a_config_whose_padding_token_lies_past_its_vocabulary_is_refused_in_one_line(
    tmp_path: Path,
) -> None:
    """torch's embedding would assert deep inside the build; the run says which field."""
    import torch

    config = tmp_path / "config.json"
    fields = {"model_type": "llama", "vocab_size": 512, "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 2}  # fmt: skip
    config.write_text(json.dumps({**fields, "pad_token_id": 32000}))
    with pytest.raises(ValueError) as info:
        model_source.load_model(str(config), "float32", 64, 0, torch.device("cpu"))
    assert str(info.value) == (
        f"--model {config}: pad_token_id 32000 is not a token of the vocabulary (vocab_size "
        "512); set pad_token_id below vocab_size, or null"
    )
