"""What a `tiledmlp train` run leaves and says beside its model: the curve of its loss and
learning rate (train/curve.py: a PNG with matplotlib, an SVG by the standard library without
it), one line of what it read (train/summary.py's data_line), and no
DeepSpeed banner when DeepSpeed is not used."""

from __future__ import annotations

import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tiledmlp.train.curve import CURVE_FILE, CURVE_SVG, curve_points, draw_curve
from tiledmlp.train.curve_svg import nice_ticks, svg_curve
from tiledmlp.train.data import Corpus, open_corpus, pack
from tiledmlp.train.summary import data_line


def _metrics(path: Path) -> Path:
    lines = [
        {"step": 1, "loss": 5.5, "learning_rate": 2e-3, "grad_norm": 1.0},
        {"step": 2, "loss": 4.0, "learning_rate": 1e-3},
        {"step": 2, "eval_loss": 4.2},
        {"step": 2, "loss": 3.9, "learning_rate": 1e-3},  # a resumed run logs step 2 again
        {"step": 3, "loss": 3.0, "learning_rate": 0.0},
        {"step": 3, "train_runtime": 1.0},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return path


def test_the_curve_is_drawn_from_the_metrics_file(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    metrics = _metrics(tmp_path / "metrics.jsonl")
    points = curve_points(metrics)
    assert points["loss"] == [(1, 5.5), (2, 3.9), (3, 3.0)]
    assert points["eval_loss"] == [(2, 4.2)]
    assert points["learning_rate"] == [(1, 2e-3), (2, 1e-3), (3, 0.0)]
    path, note = draw_curve(metrics, "tiny, 64 tokens")
    assert note is None and path == tmp_path / CURVE_FILE
    png = path.read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000


def test_no_training_loss_draws_nothing_and_says_why(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps({"step": 0, "train_runtime": 1.0}) + "\n")
    assert draw_curve(metrics, "t") == (None, f"no curve drawn: {metrics} holds no training loss")
    assert not (tmp_path / CURVE_FILE).exists()


def test_without_matplotlib_the_curve_is_an_svg(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # as when matplotlib is not installed: importing it fails
    for name in ("matplotlib", "matplotlib.backends", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)
    metrics = _metrics(tmp_path / "metrics.jsonl")
    path, note = draw_curve(metrics, "tiny, 64 tokens")
    assert note is None and path == tmp_path / CURVE_SVG
    assert not (tmp_path / CURVE_FILE).exists()
    root = ET.fromstring(path.read_text())
    assert root.tag == "{http://www.w3.org/2000/svg}svg"


_SVG = "{http://www.w3.org/2000/svg}"


def test_the_svg_has_axes_ticks_labels_and_every_point_inside() -> None:
    loss = [(s, 10.0 * 0.9**s + 2.0) for s in range(1, 51)]
    evals = [(s, 10.0 * 0.9**s + 2.5) for s in (10, 20, 30, 40, 50)]
    lr = [(s, 2e-3 * (1 - s / 50)) for s in range(1, 51)]
    root = ET.fromstring(svg_curve({"loss": loss, "eval_loss": evals, "learning_rate": lr},
                                   "tiny & co, 50 steps"))  # fmt: skip
    texts = [t.text for t in root.iter(_SVG + "text")]
    assert "tiny & co, 50 steps" in texts  # the title, escaped in the file
    for label in ("optimizer step", "loss", "learning rate", "training loss", "eval loss"):
        assert label in texts, texts
    assert {"0", "10", "20", "30", "40", "50"} <= set(texts)  # the steps' ticks
    assert "2.0e-03" in texts and "0" in texts  # the learning rate's
    frames = [r for r in root.iter(_SVG + "rect") if r.get("stroke") == "#333"]
    lines = list(root.iter(_SVG + "polyline"))
    assert len(frames) == 2 and len(lines) == 3  # two panels: loss, eval loss; learning rate
    for frame, polylines in ((frames[0], lines[:2]), (frames[1], lines[2:])):
        x0, y0 = float(frame.get("x", 0)), float(frame.get("y", 0))
        x1, y1 = x0 + float(frame.get("width", 0)), y0 + float(frame.get("height", 0))
        for line in polylines:
            points = [tuple(map(float, p.split(","))) for p in line.get("points", "").split()]
            assert points and all(x0 <= x <= x1 and y0 <= y <= y1 for x, y in points)
    assert len(lines[0].get("points", "").split()) == 50


@pytest.mark.parametrize(
    ("lo", "hi", "integer", "ticks"),
    [
        (1, 50, True, [0, 10, 20, 30, 40, 50]),
        (1, 3, True, [1, 2, 3]),
        (2.1, 10.4, False, [2, 4, 6, 8, 10, 12]),
        (0.0, 2e-3, False, [0, 5e-4, 1e-3, 1.5e-3, 2e-3]),
        (5.0, 5.0, False, [4.4, 4.6, 4.8, 5.0, 5.2, 5.4, 5.6]),  # one value: widened
    ],
)
def test_ticks_are_round_and_hold_the_range(
    lo: float, hi: float, integer: bool, ticks: list[float]
) -> None:
    assert nice_ticks(lo, hi, 6 if integer else 5, integer) == pytest.approx(ticks)


def _byte_encode(doc: str) -> list[int]:
    return [256, *doc.encode(), 257]


def _jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def test_the_data_line_says_how_many_of_how_many_and_the_repeats(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "notes.jsonl", [f"note {i:02d} " * 4 for i in range(40)])
    corpus, docs = open_corpus(path, None, 10**6)
    seqs = pack(docs, _byte_encode, 100, 4, corpus)  # 34 tokens a document: 12 fill 4 x 100
    assert len(seqs) == 4 and (corpus.documents, corpus.available) == (12, 40)
    corpus.repeats = 12 / 4  # 12 steps of one sequence
    line = data_line(corpus.as_dict(), 12)
    assert line == (
        f"data: {path} (jsonl, field text): 12 documents of 40, 408 tokens, 4 sequences, "
        "repeated 3 times to fill 12 steps"
    )


def test_one_document_is_one_document_and_a_cut_corpus_says_where(tmp_path: Path) -> None:
    path = tmp_path / "one.txt"
    path.write_text("x" * 300)
    corpus, docs = open_corpus(path, None, 10**6)
    pack(docs, _byte_encode, 100, 8, corpus)
    corpus.repeats = 1.0
    assert data_line(corpus.as_dict(), 3) == (
        f"data: {path} (text): 1 document of 1, 302 tokens, 3 sequences"
    )
    many = _jsonl(tmp_path / "many.jsonl", ["y" * 50] * 10)
    corpus, docs = open_corpus(many, None, 120)  # --max-data-bytes 120: 3 documents of 50
    pack(docs, _byte_encode, 20, 100, corpus)
    assert "3 documents of the first 3 (--max-data-bytes 120)" in data_line(corpus.as_dict(), 1)


@pytest.mark.parametrize("content", ["", "\n\n", "  \n"])
def test_an_empty_file_is_said_to_hold_no_text(content: str, tmp_path: Path) -> None:
    for name in ("empty.txt", "empty.jsonl"):
        path = tmp_path / name
        path.write_text(content)
        corpus, docs = open_corpus(path, None, 10**6)
        with pytest.raises(ValueError) as info:
            pack(docs, _byte_encode, 64, 4, corpus)
        assert str(info.value) == (
            f"--data {path} holds no text (0 documents); give a file with text in it"
        )


def test_too_little_text_counts_its_tokens_and_documents() -> None:
    corpus = Corpus(files=["a.txt"], format="text", field=None)
    with pytest.raises(ValueError, match=r"the corpus has 5 tokens \(1 document\), fewer than"):
        pack(iter(["abc"]), _byte_encode, 64, 4, corpus)


@pytest.mark.slow
def test_a_run_leaves_its_curve_and_says_what_it_read_without_deepspeeds_banner(
    tmp_path: Path,
) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("matplotlib")
    data = _jsonl(tmp_path / "notes.jsonl", ["a short note about tiles. " * 3] * 40)
    out = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "tiledmlp", "train", "--data", str(data), "--seq-len", "512",
         "--max-steps", "7", "--output-dir", str(out)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    # 40 documents of 78 bytes and 2 markers: 3,200 tokens, 6 sequences of 512 for 7 steps
    assert (
        f"data: {data} (jsonl, field text): 40 documents of 40, 3,200 tokens, 6 sequences, "
        "repeated 1.2 times to fill 7 steps"
    ) in done.stdout
    assert f"curve: {out / CURVE_FILE}" in done.stdout
    assert (out / CURVE_FILE).read_bytes().startswith(b"\x89PNG")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["curve"] == str(out / CURVE_FILE) and summary["curve_note"] is None
    # DeepSpeed is imported by the Trainer whenever installed; its CPU-accelerator banner is
    # about DeepSpeed's own device choice, not this run
    assert "Setting accelerator to CPU" not in done.stdout + done.stderr


@pytest.mark.slow
def test_a_run_without_matplotlib_draws_its_curve_as_svg_and_ends_with_it(
    tmp_path: Path,
) -> None:
    pytest.importorskip("transformers")
    out = tmp_path / "run"
    # the README's install (the hf extra) has no matplotlib: a fresh process where importing
    # it fails, as there
    wrapper = (
        "import sys\n"
        "for name in ('matplotlib', 'matplotlib.backends', 'matplotlib.backends.backend_agg'):\n"
        "    sys.modules[name] = None\n"
        "sys.argv = ['tiledmlp', *sys.argv[1:]]\n"
        "from tiledmlp.cli import console\n"
        "console()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", wrapper, "train", "--seq-len", "64", "--max-steps", "3",
         "--output-dir", str(out)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.rstrip().splitlines()[-1] == f"curve: {out / CURVE_SVG}", done.stdout
    assert not (out / CURVE_FILE).exists()
    root = ET.fromstring((out / CURVE_SVG).read_text())
    assert len(list(root.iter(_SVG + "polyline"))) == 2  # the loss and the learning rate
    assert json.loads((out / "summary.json").read_text())["curve"] == str(out / CURVE_SVG)


def test_deepspeeds_cpu_accelerator_warning_is_dropped_and_nothing_else() -> None:
    import logging

    from tiledmlp.integrations.deepspeed import quiet_accelerator_guess

    quiet_accelerator_guess()
    quiet_accelerator_guess()  # once is enough: the filter is not added twice
    logger = logging.getLogger("DeepSpeed")  # deepspeed/utils/logging.py's logger
    assert len(logger.filters) == len({type(f) for f in logger.filters})

    def kept(message: str) -> bool:
        record = logger.makeRecord("DeepSpeed", logging.WARNING, "real_accelerator.py", 213,
                                   message, (), None)  # fmt: skip
        return bool(logger.filter(record))

    assert not kept(
        "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to "
        "detect it."
    )
    assert kept("ZeRO-3 partitioned 12 parameters")
