"""The documentation is tested: its Python blocks run, its commands are the ones CI runs, and it
speaks of the product only.

Every ```python block of README.md and docs/ runs: the blocks of one page in order, in one fresh
interpreter (later blocks see what earlier ones defined), in a temporary directory. A block that
cannot run in one CPU process (it needs torchrun, a GPU or a checkpoint on disk) is preceded by
`<!-- docs-test: skip, tested by tests/PATH -->`, naming the test file that covers what it shows;
that file must exist.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
_FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.M | re.S)
_SKIP = re.compile(r"<!--\s*docs-test:\s*skip, tested by (\S+)\s*-->\s*$")


def code_blocks(page: Path, language: str) -> list[tuple[int, str, str | None]]:
    """(line, code, skip reason or None) of each fenced block of `language` on a page."""
    text = page.read_text()
    blocks = []
    for match in _FENCE.finditer(text):
        if match.group(1) != language:
            continue
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        skip = _SKIP.search(before)
        line = text.count("\n", 0, match.start()) + 1
        blocks.append((line, match.group(2), skip.group(1) if skip else None))
    return blocks


# The documentation must not teach transformers' deprecated checkpointing names (5.x warns on
# gradient_checkpointing_enable and TrainingArguments(gradient_checkpointing=...)).
_DEPRECATED_CHECKPOINTING = "error:`gradient_checkpointing:FutureWarning"
_DOCS_BLOCKS = {code for page in PAGES[1:] for _, code, _ in code_blocks(page, "python")}


def runnable_blocks(page: Path) -> list[tuple[int, str]]:
    """The blocks of a page that test_python_blocks_run runs: not skipped, and for the README
    not a copy of a block of docs/ (that one runs on its own page)."""
    return [
        (line, code)
        for line, code, skip in code_blocks(page, "python")
        if skip is None and not (page.name == "README.md" and code in _DOCS_BLOCKS)
    ]


_RUNNABLE = [p for p in PAGES if runnable_blocks(p)]


@pytest.mark.slow  # each page's blocks in a fresh interpreter, training included
@pytest.mark.parametrize("page", _RUNNABLE, ids=lambda p: str(p.relative_to(ROOT)))
def test_python_blocks_run(page: Path, tmp_path: Path) -> None:
    script = [f"# {page.name}:{line}\n{code}" for line, code in runnable_blocks(page)]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(
        [sys.executable, "-W", _DEPRECATED_CHECKPOINTING, "-c", "\n".join(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, (
        f"{page.relative_to(ROOT)}: its python blocks failed\n{done.stderr[-3000:]}"
    )


def test_readme_python_blocks_are_run() -> None:
    """The README's quickstart is a copy of Getting started's, which runs; none is left out."""
    for line, _, skip in code_blocks(ROOT / "README.md", "python"):
        assert skip is None, f"README.md:{line}: every README block must run"


def test_skipped_blocks_name_an_existing_test() -> None:
    for page in PAGES:
        for line, _, skip in code_blocks(page, "python"):
            if skip is not None:
                target = ROOT / skip.split("::")[0]
                assert target.is_file(), f"{page.name}:{line}: names {skip}, which does not exist"


def test_readme_test_command_is_what_ci_runs() -> None:
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    marker = next(i for i, line in enumerate(ci) if "The README's test command, verbatim" in line)
    command = ci[marker + 1].strip()
    readme = [code for _, code, _ in code_blocks(ROOT / "README.md", "bash")]
    assert any(command == code.strip() for code in readme), (
        f"README.md has no bash block equal to .ci/run's test command:\n{command}"
    )


def test_readme_is_short() -> None:
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= 160, f"README.md has {lines} lines; keep it at most 160 (move text to docs/)"


# Words about how the product was made, not about the product.
_DEVELOPMENT_WORDS = re.compile(
    r"\bthe seeds\b|\bseeds'|\bseed's|_seeds_|seed_option|seed_flags|\blent\b|\bissue \d+|\bissue's\b",
    re.I,
)
# In prose, also "session" (in code it names a step's offloading session).
_PROSE_WORDS = re.compile(r"\bsessions?\b", re.I)


def _text_files() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "mkdocs.yml"]
    for folder, patterns in (
        ("docs", ("*.md",)),
        ("src", ("*.py",)),
        ("tests", ("*.py",)),
        ("examples", ("*.py", "*.sh", "*.json")),
        ("benchmarks", ("*.md", "*.py")),
    ):
        for pattern in patterns:
            files += sorted((ROOT / folder).rglob(pattern))
    return [f for f in files if f != Path(__file__).resolve()]  # this file names the words


def test_no_words_about_how_the_product_is_developed() -> None:
    hits = []
    for path in _text_files():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            prose = path.suffix != ".py" and _PROSE_WORDS.search(line)
            if _DEVELOPMENT_WORDS.search(line) or prose:
                hits.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not hits, "words about how the product is developed:\n" + "\n".join(hits)


def test_readme_links_resolve() -> None:
    text = (ROOT / "README.md").read_text()
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" in target:
            continue
        assert (ROOT / target).exists(), f"README.md links to {target}, which does not exist"


_TEST_REF = re.compile(r"`((?:tests/)?(?:\w+/)*test_\w+\.py)(?:::(\w+))?")


def _cited_test(file: str) -> Path | None:
    """The test file a page cites: a `tests/...` path as written, a bare `test_x.py` by its name
    (test file names are unique across tests/)."""
    if file.startswith("tests/"):
        path = ROOT / file
        return path if path.is_file() else None
    found = sorted((ROOT / "tests").rglob(file))
    return found[0] if len(found) == 1 else None


def test_named_tests_exist() -> None:
    """Every `test_x.py::test_name` the documentation cites exists (a prefix for `name_*`)."""
    missing = []
    for page in PAGES:
        for file, name in _TEST_REF.findall(page.read_text()):
            path = _cited_test(file)
            if path is None:
                missing.append(f"{page.name}: {file}")
            elif name and f"def {name}" not in path.read_text():
                missing.append(f"{page.name}: {file}::{name}")
    assert not missing, "the documentation cites tests that do not exist:\n" + "\n".join(missing)


def test_install_hints_name_extras_that_exist() -> None:
    """tiledmlp installs from a checkout (`pip install -e ".[extra]"`); a hint naming
    `tiledmlp[extra]` points at a package index entry that does not exist."""
    import tomllib

    extras = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    )
    bad = []
    for path in _text_files():
        text = path.read_text()
        bad += [
            f"{path.relative_to(ROOT)}: tiledmlp[{m}]"
            for m in re.findall(r"tiledmlp\[([\w,]+)\]", text)
        ]
        for group in re.findall(r"-e ['\"]?\.\[([\w,-]+)\]", text):
            bad += [
                f"{path.relative_to(ROOT)}: unknown extra {e}"
                for e in group.split(",")
                if e not in extras
            ]
    assert not bad, "install hints that do not work:\n" + "\n".join(bad)


def test_the_documented_patch_model_signature_is_the_real_one() -> None:
    import ast
    import inspect

    import tiledmlp

    text = (ROOT / "docs" / "guides" / "patching.md").read_text()
    block = next(c for _, c, _ in code_blocks(ROOT / "docs" / "guides" / "patching.md", "text"))
    assert block.startswith("patch_model("), block
    call = ast.parse(block.split(" -> ")[0].replace("*, ", ""), mode="eval").body
    documented = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
    params = inspect.signature(tiledmlp.patch_model).parameters
    assert list(params)[:2] == ["model", "config"] and params["config"].default is None
    assert documented.pop("config") is None
    # The keywords are PatchConfig's schema: the same names, and each documented default is
    # the schema's default (giving it changes nothing).
    assert sorted(documented) == sorted(tiledmlp.PatchConfig.keywords()), (
        f"docs/guides/patching.md documents {sorted(documented)}, the schema has "
        f"{sorted(tiledmlp.PatchConfig.keywords())}"
    )
    default = tiledmlp.PatchConfig()
    for name, value in documented.items():
        assert tiledmlp.PatchConfig.from_kwargs({name: value}) == default, (
            f"docs/guides/patching.md documents {name}={value!r}, not the default"
        )
    real = ["config", *documented]
    assert all(f"`{name}`" in text for name in real), "every option has a row in the table"


def test_every_documented_command_line_parses() -> None:
    """Each `tiledmlp ...` line of a bash block in the README and docs/ names flags that exist
    (parsed as the CLI parses it; nothing runs)."""
    import shlex

    from tiledmlp.cli import _build_parser, normalise_argv

    parser = _build_parser()
    bad = []
    for page in PAGES:
        for line_no, code, _ in code_blocks(page, "bash"):
            for line in code.replace("\\\n", " ").splitlines():
                words = shlex.split(line.split("#")[0])
                if not words or words[0] != "tiledmlp":
                    continue
                try:
                    _, unknown = parser.parse_known_args(normalise_argv(words[1:]))
                except SystemExit:
                    unknown = ["(a value argparse refused)"]
                if unknown:
                    bad.append(f"{page.relative_to(ROOT)}:{line_no}: {line.strip()} -> {unknown}")
    assert not bad, "documented commands that do not parse:\n" + "\n".join(bad)


# A README command that runs for more than a minute says how long it took (measured, and where).
_LONG_COMMANDS = re.compile(r"^tiledmlp (train .*--max-steps|plan|bench)")
_TIME = re.compile(r"\b\d+(\.\d+)? ?(s|min|minutes|seconds|h)\b")


def test_the_readmes_longer_commands_say_how_long_they_take() -> None:
    missing = []
    for _, code, _ in code_blocks(ROOT / "README.md", "bash"):
        for line in code.splitlines():
            command, _, comment = line.partition("#")
            if _LONG_COMMANDS.match(command.strip()) and not _TIME.search(comment):
                missing.append(line.strip())
    assert not missing, "README commands without a time:\n" + "\n".join(missing)


def test_no_page_says_the_gpu_is_unmeasured_where_gpu_records_exist() -> None:
    records = sorted((ROOT / "benchmarks" / "results" / "gpu").rglob("records.jsonl"))
    assert records, "the GPU records are committed under benchmarks/results/gpu/"
    stale = [
        f"{page.relative_to(ROOT)}:{n}: {line.strip()}"
        for page in PAGES
        for n, line in enumerate(page.read_text().splitlines(), 1)
        if re.search(r"(on a GPU|GPU error).{0,40}not (been )?measured yet", line, re.I)
    ]
    assert not stale, "pages that call measured GPU figures unmeasured:\n" + "\n".join(stale)


def test_no_block_promises_to_write_nothing() -> None:
    """A block with TrainingArguments makes its output folder (the Trainer creates it, even
    with save_strategy "no"), so no block's comment may say it writes nothing."""
    promising = [
        (page, line)
        for page in _RUNNABLE
        for line, code in runnable_blocks(page)
        if re.search(r"#.*\bwrites nothing\b", code)
    ]
    assert not promising, f"blocks that say they write nothing (the Trainer writes): {promising}"


# A time the docs give is a measurement: it names the machine it was taken on (in its
# paragraph, or earlier in its section, as benchmarks.md's "*Machine: ...*" lines do); on the
# first-hour pages (README, getting started) its paragraph or footnote also says the load.
_A_TIME = re.compile(
    r"(?<![\w.\-/])\d[\d,]*(?:\.\d+)?(?:\s?(?:-|to)\s?\d[\d,]*(?:\.\d+)?)?\s?"
    r"(?:ms|s|min|minutes?|seconds?|hours?)\b(?![\w/-])"
)
_MACHINE = re.compile(r"H100|H200|A100|\bGPU|\bCPU|\bcores?\b|EPYC|\bmachine\b", re.I)
_LOAD = re.compile(r"\bload\b|\bidle\b|\bbusy\b", re.I)
# a duration that is a setting, not a measurement ("otherwise wait 30 minutes", a timeout)
_SETTING = re.compile(r"(timeout|default|wait|every|within|after)\W*(\w+\W+){0,3}$", re.I)


def _paragraphs(text: str) -> list[tuple[tuple[str, ...], str]]:
    """(the headings above it, outermost first; the paragraph's text) for each paragraph of a
    Markdown page: runs of lines between blank lines, a fenced block whole."""
    out: list[tuple[tuple[str, ...], str]] = []
    heads: list[tuple[int, str]] = []
    lines: list[str] = []
    fence = False
    for line in [*text.splitlines(), ""]:
        if line.startswith("```"):
            fence = not fence
        if not fence and line.startswith("#"):
            level = len(line) - len(line.lstrip("#"))
            heads = [h for h in heads if h[0] < level] + [(level, line)]
            continue
        if line.strip() or fence:
            lines.append(line)
        elif lines:
            out.append((tuple(h for _, h in heads), "\n".join(lines)))
            lines = []
    return out


def _measured_times(text: str) -> list[str]:
    return [
        m.group(0)
        for m in _A_TIME.finditer(text)
        if not _SETTING.search(text[max(0, m.start() - 40) : m.start()])
    ]


def test_every_time_in_the_docs_names_its_machine() -> None:
    bad = []
    for page in PAGES:
        seen: dict[tuple[str, ...], str] = {}
        for heads, para in _paragraphs(page.read_text()):
            above = " ".join(seen.get(heads[:k], "") for k in range(len(heads) + 1))
            times = _measured_times(para)
            if times and not _MACHINE.search(para) and not _MACHINE.search(above + " ".join(heads)):
                bad.append(f"{page.relative_to(ROOT)}: {times[:3]} in {para[:80]!r}")
            seen[heads] = seen.get(heads, "") + " " + para
    assert not bad, "times without the machine they were measured on:\n" + "\n".join(bad)


def test_the_first_hours_times_name_machine_and_load() -> None:
    bad = []
    for page in (ROOT / "README.md", ROOT / "docs" / "getting-started.md"):
        paragraphs = [para for _, para in _paragraphs(page.read_text())]
        footnote = next((p for p in paragraphs if p.startswith("\\*")), "")
        for para in paragraphs:
            times = _measured_times(para)
            said = para + (footnote if re.search(r"\d ?(s|min)\*", para) else "")
            if times and not (_MACHINE.search(said) and _LOAD.search(said)):
                bad.append(f"{page.relative_to(ROOT)}: {times[:3]} in {para[:80]!r}")
    assert not bad, "first-hour times without their machine and load:\n" + "\n".join(bad)


def test_the_time_check_finds_a_bare_time() -> None:
    page = "# A\n\nThe first job takes about 12 seconds.\n\n## B\n\nIt waits 30 minutes.\n"
    assert [_measured_times(p) for _, p in _paragraphs(page)] == [["12 seconds"], []]
    assert not _MACHINE.search(page)
    table = "*Machine: the 2-core CPU.*\n\n| a | b |\n|---|---|\n| x | 9.9 s |\n"
    assert _measured_times(_paragraphs(table)[1][1]) == ["9.9 s"]
