"""Trains a tiny model with each framework's real command, with and without tiledmlp, on the CPU.

For each framework (ms-swift's `swift sft`, axolotl's `axolotl train`, TRL's SFTTrainer) this
script makes a virtual environment (torch first, then the framework with the repository's
constraints, then tiledmlp with the one install line the docs give for that framework, which
must not move the framework's pins), then runs a few optimizer steps of a tiny Llama at batch
sizes 1 and 2, once without tiledmlp and once with its MLPs and loss tiled, and compares:
  - the losses of every step and the parameters after training (fp32; equal to 1e-5 relative);
  - that the tiled loss ran (tiledmlp's tiled loss functions were called) and the logits never
    formed (no Linear produced a vocabulary-wide output), while the untiled run formed them;
  - what tiledmlp reported (its report's `loss: tiled`).
The probe (probe/sitecustomize.py) records those facts inside the framework's own process.

It writes one JSON record (default benchmarks/results/frameworks.json): the date, the machine, and per
framework its versions, the install line, the checks and their result. docs/guides/
integrations.md's compatibility table is generated from that record
(`python scripts/frameworks/table.py`), and tests/package/test_framework_table.py checks
that the two agree.

    python scripts/frameworks/run.py                      # all three, venvs reused if present
    python scripts/frameworks/run.py --only swift --fresh # one framework, a new venv

Needs network access to the package index (or its mirror) the first time; each venv takes a
few minutes to install, each run about half a minute on two CPU cores.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from table import EXTRAS, install_line  # noqa: E402  (this folder: the install lines' source)

ROOT = Path(__file__).resolve().parents[2]
PROBE = Path(__file__).resolve().parent / "probe"
CONSTRAINTS = ROOT / "constraints.txt"
VOCAB = 258  # the byte tokenizer's: 256 bytes, bos, eos
STEPS = 3
BATCHES = (1, 2)
RTOL = 1e-5

# framework -> (what pip installs, the module whose version is reported, the tiledmlp extra
# installed beside it: table.py's EXTRAS, the one source of the docs' install lines)
FRAMEWORKS = {
    name: (spec, dist, EXTRAS[name])
    for name, spec, dist in (
        ("swift", "ms-swift==4.6.0", "ms-swift"),
        ("axolotl", "axolotl==0.19.0", "axolotl"),
        ("trl", "trl peft", "trl"),
    )
}
PINNED = ("transformers", "trl", "peft", "accelerate")


def _sh(cmd: list[str], log: Path, env: dict[str, str] | None = None, cwd: Path | None = None,
        timeout: int = 3600) -> int:  # fmt: skip
    with open(log, "a") as f:
        f.write(f"\n$ {' '.join(cmd)}\n")
        f.flush()
        return subprocess.run(
            cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=cwd, timeout=timeout
        ).returncode


def _freeze(venv: Path) -> dict[str, str]:
    out = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "list", "--format=json"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    # names as pip normalises them (ms_swift and ms-swift are one package)
    return {p["name"].lower().replace("_", "-"): p["version"] for p in json.loads(out.stdout)}


def make_venv(name: str, venvs: Path, fresh: bool, install: bool = True) -> dict:
    """The venv of `name` (made when missing or `fresh`); what installing tiledmlp beside the
    framework changed among PINNED (None: tiledmlp not installed now, `install` False)."""
    spec, _, extra = FRAMEWORKS[name]
    venv = venvs / name
    log = venvs / f"{name}.log"
    if fresh and venv.exists():
        shutil.rmtree(venv)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    started = time.time()
    if not (venv / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        if _sh([*pip, "torch==2.13.0", "-c", str(CONSTRAINTS)], log):
            raise SystemExit(f"{name}: installing torch failed; see {log}")
        if _sh([*pip, *spec.split(), "-c", str(CONSTRAINTS)], log):
            raise SystemExit(f"{name}: installing {spec} failed; see {log}")
    before = _freeze(venv)
    if not install:
        return {"install_s": None, "moved": None, "trl_extra_moves": None, "versions": before}
    line = f"pip install -c constraints.txt {ROOT}[{extra}]"
    if _sh([*pip, f"{ROOT}[{extra}]", "-c", str(CONSTRAINTS)], log):
        raise SystemExit(f"{name}: `{line}` failed; see {log}")
    after = _freeze(venv)
    # and the trl extra: what it would install beside the framework (pip's dry run)
    dry = subprocess.run(
        [*pip[:-1], "--dry-run", f"{ROOT}[trl]", "-c", str(CONSTRAINTS)],
        capture_output=True, text=True,
    )  # fmt: skip
    would = [w for line in dry.stdout.splitlines() if line.startswith("Would install")
             for w in line.split()[2:]]  # fmt: skip
    trl_extra = {
        w.rsplit("-", 1)[0].lower(): w.rsplit("-", 1)[1]
        for w in would
        if w.rsplit("-", 1)[0].lower() in PINNED
    }
    if dry.returncode:
        trl_extra = {"pip": f"failed: {dry.stderr.strip().splitlines()[-1:]}"}
    moved = {
        pkg: [before.get(pkg), after.get(pkg)]
        for pkg in PINNED
        if before.get(pkg) != after.get(pkg) and before.get(pkg) is not None
    }
    return {
        "install_s": round(time.time() - started, 1),
        "moved": moved,
        "trl_extra_moves": trl_extra,
        "versions": after,
    }


def make_assets(venv: Path, work: Path) -> None:
    """A tiny Llama (random weights, byte tokenizer with a chat template) and its data."""
    script = f"""
import json, torch, transformers as tr
from tiledmlp.train.tokenizer import byte_tokenizer
torch.manual_seed(0)
cfg = tr.LlamaConfig(vocab_size={VOCAB}, hidden_size=32, intermediate_size=48,
    num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, pad_token_id=0,
    bos_token_id=256, eos_token_id=257, max_position_embeddings=512)
tr.LlamaForCausalLM(cfg).save_pretrained({str(work / "model")!r})
tok = byte_tokenizer()
tok.chat_template = ("{{% for m in messages %}}{{{{ m['role'] }}}}: {{{{ m['content'] }}}}\\n"
                     "{{% endfor %}}{{% if add_generation_prompt %}}assistant: {{% endif %}}")
tok.save_pretrained({str(work / "model")!r})
with open({str(work / "text.jsonl")!r}, "w") as f, open({str(work / "chat.jsonl")!r}, "w") as g:
    for i in range(16):
        text = f"the quick brown fox {{i}} jumps over the lazy dog"
        f.write(json.dumps({{"text": text}}) + "\\n")
        g.write(json.dumps({{"messages": [{{"role": "user", "content": f"fox {{i}}?"}},
                                        {{"role": "assistant", "content": text}}]}}) + "\\n")
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}  # the byte tokenizer's code
    subprocess.run([str(venv / "bin" / "python"), "-c", script], check=True, env=env)


def _swift(venv: Path, work: Path, out: Path, batch: int, tiled: bool, env: dict) -> list[str]:
    cmd = [
        str(venv / "bin" / "swift"), "sft", "--model", str(work / "model"),
        "--model_type", "llama", "--template", "default", "--dataset", str(work / "chat.jsonl"),
        "--tuner_type", "full", "--torch_dtype", "float32", "--max_length", "192",
        "--max_steps", str(STEPS), "--per_device_train_batch_size", str(batch),
        "--gradient_accumulation_steps", "1", "--learning_rate", "0.1", "--optim", "sgd",
        "--lr_scheduler_type", "constant", "--warmup_ratio", "0", "--logging_steps", "1",
        "--save_strategy", "no", "--eval_strategy", "no", "--split_dataset_ratio", "0",
        "--dataloader_num_workers", "0", "--dataset_num_proc", "1", "--seed", "0",
        "--output_dir", str(out), "--report_to", "none",
    ]  # fmt: skip
    if tiled:
        written = subprocess.run(
            [str(venv / "bin" / "python"), "-m", "tiledmlp", "swift-plugin", "--tiled-loss",
             "--num-tiles", "2", "--out", str(out / "plugin" / "tiledmlp_swift_plugin.py")],
            capture_output=True, text=True, env=env,
        )  # fmt: skip
        plugin = written.stdout.strip()
        if written.returncode or not plugin.endswith(".py"):
            raise SystemExit(f"tiledmlp swift-plugin failed: {written.stderr.strip()}")
        cmd += ["--external_plugins", plugin]
    return cmd


_AXOLOTL = """\
base_model: {model}
datasets:
  - path: {data}
    ds_type: json
    type: completion
sequence_len: 64
micro_batch_size: {batch}
gradient_accumulation_steps: 1
max_steps: {steps}
learning_rate: 0.1
optimizer: sgd
lr_scheduler: constant
output_dir: {out}
dataset_prepared_path: {out}/prepared
val_set_size: 0
save_strategy: "no"
logging_steps: 1
bf16: false
fp32: true
seed: 0
"""
_AXOLOTL_PLUGIN = """\
plugins:
  - tiledmlp.integrations.axolotl.TiledMLPPlugin
tiledmlp: true
tiledmlp_tiled_loss: true
tiledmlp_num_tiles: 2
"""


def _axolotl(venv: Path, work: Path, out: Path, batch: int, tiled: bool, env: dict) -> list[str]:
    text = _AXOLOTL.format(
        model=work / "model", data=work / "text.jsonl", out=out, batch=batch, steps=STEPS
    )
    config = out / "config.yml"
    config.write_text(text + (_AXOLOTL_PLUGIN if tiled else ""))
    return [str(venv / "bin" / "axolotl"), "train", str(config), "--launcher", "python"]


_TRL = """\
import sys
from datasets import load_dataset
from trl import SFTConfig, SFTTrainer
if {tiled}:
    import tiledmlp
    tiledmlp.enable(tiled_loss=True, num_tiles=2)
args = SFTConfig(output_dir={out!r}, max_steps={steps}, per_device_train_batch_size={batch},
                 gradient_accumulation_steps=1, learning_rate=0.1, optim="sgd",
                 lr_scheduler_type="constant", logging_steps=1, save_strategy="no",
                 report_to="none", seed=0, max_length=64, use_cpu=True,
                 dataloader_num_workers=0, bf16=False, fp16=False)
data = load_dataset("json", data_files={data!r}, split="train")
SFTTrainer(model={model!r}, args=args, train_dataset=data).train()
"""


def _trl(venv: Path, work: Path, out: Path, batch: int, tiled: bool, env: dict) -> list[str]:
    code = _TRL.format(
        tiled=tiled, out=str(out), steps=STEPS, batch=batch,
        data=str(work / "text.jsonl"), model=str(work / "model"),
    )  # fmt: skip
    script = out / "train.py"
    script.write_text(code)
    return [str(venv / "bin" / "python"), str(script)]


COMMANDS = {"swift": _swift, "axolotl": _axolotl, "trl": _trl}
TESTED = {
    "swift": "`swift sft` (full fine-tuning) with the plugin from `tiledmlp swift-plugin`",
    "axolotl": "`axolotl train` with the plugin (`tiledmlp_tiled_loss`, 2 tiles)",
    "trl": "SFTTrainer after `tiledmlp.enable(tiled_loss=True)`",
}


def run_one(name: str, venv: Path, work: Path, batch: int, tiled: bool, src: bool) -> dict:
    out = work / f"{name}-b{batch}-{'tiled' if tiled else 'plain'}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    probe = out / "probe.json"
    env = {
        **os.environ,
        "PYTHONPATH": f"{PROBE}:{ROOT / 'src'}" if src else str(PROBE),
        "FRAMEWORK_PROBE_OUT": str(probe),
        "FRAMEWORK_PROBE_VOCAB": str(VOCAB),
        "PATH": f"{venv / 'bin'}:{os.environ.get('PATH', '')}",
        "CUDA_VISIBLE_DEVICES": "",
        "AXOLOTL_DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
    }
    cmd = COMMANDS[name](venv, work, out, batch, tiled, env)
    started = time.time()
    rc = _sh(cmd, out / "log.txt", env=env, cwd=out, timeout=1800)
    record = json.loads(probe.read_text()) if probe.exists() else {}
    record.update(rc=rc, seconds=round(time.time() - started, 1), log=str(out / "log.txt"))
    return record


def compare(plain: dict, tiled: dict) -> list[str]:
    """What is wrong with `tiled` against `plain` (empty: the tiled run is right)."""
    problems = []
    for what, r in (("without tiledmlp", plain), ("with tiledmlp", tiled)):
        if r.get("rc") != 0 or "losses" not in r:
            problems.append(f"the run {what} failed (exit {r.get('rc')}; see {r.get('log')})")
    if problems:
        return problems
    a, b = tiled["losses"], plain["losses"]
    if len(a) != len(b) or len(a) != STEPS:
        problems.append(f"{len(a)} losses logged with tiledmlp, {len(b)} without ({STEPS} steps)")
    for step, (x, y) in enumerate(zip(a, b), 1):
        if abs(x - y) > RTOL * abs(y):
            problems.append(f"step {step}: loss {x!r} with tiledmlp, {y!r} without")
    for name, (s, q) in plain["param_sums"].items():
        t = tiled["param_sums"].get(name)
        if t is None:
            problems.append(f"parameter {name} missing with tiledmlp")
        elif abs(t[0] - s) > RTOL * max(abs(q), 1.0) or abs(t[1] - q) > RTOL * abs(q):
            problems.append(f"parameter {name} differs after training: {t} vs {[s, q]}")
    if tiled["tiled_loss_calls"] == 0:
        problems.append("the tiled loss never ran")
    if tiled["vocab_outputs"]:
        problems.append(
            f"the logits formed {tiled['vocab_outputs']} time(s) with tiledmlp "
            f"(up to {tiled['vocab_rows_max']} rows)"
        )
    if "loss: tiled" not in (tiled.get("report") or ""):
        problems.append(f"tiledmlp's report does not say `loss: tiled`: {tiled.get('report')!r}")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=sorted(FRAMEWORKS), action="append")
    parser.add_argument("--venvs", default=str(ROOT.parent / f"{ROOT.name}-venvs"),
                        help="where the virtual environments live (outside the repository)")  # fmt: skip
    parser.add_argument("--fresh", action="store_true", help="remake the venvs")
    parser.add_argument("--from-source", action="store_true",
                        help="while developing: run tiledmlp from src/ instead of installing "
                        "it again (the record then says nothing about the pins)")  # fmt: skip
    parser.add_argument(
        "--record", default=str(ROOT / "benchmarks" / "results" / "frameworks.json")
    )
    parser.add_argument("--work", default=None, help="scratch folder (default: a temporary one)")
    args = parser.parse_args()
    venvs = Path(args.venvs)
    venvs.mkdir(parents=True, exist_ok=True)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="frameworks-"))
    record_path = Path(args.record)
    record = json.loads(record_path.read_text()) if record_path.exists() else {}
    record.update(
        date=time.strftime("%Y-%m-%d", time.gmtime()),
        machine=f"{platform.machine()}, {os.cpu_count()} CPU cores, no GPU",
        python=platform.python_version(),
        steps=STEPS,
        rtol=RTOL,
    )
    frameworks = record.setdefault("frameworks", {})
    failed = False
    for name in args.only or list(FRAMEWORKS):
        venv_info = make_venv(name, venvs, args.fresh, install=not args.from_source)
        versions = venv_info["versions"]
        _, dist, extra = FRAMEWORKS[name]
        fw_work = work / name
        fw_work.mkdir(parents=True, exist_ok=True)
        make_assets(venvs / name, fw_work)
        entry = {
            "version": versions.get(dist),
            "versions": {p: versions.get(p) for p in ("torch", *PINNED)},
            "install": install_line(name, constraints=True),
            "tested": TESTED[name],
            "pins_moved": venv_info["moved"],
            "trl_extra_moves": venv_info["trl_extra_moves"],
            "batches": {},
        }  # fmt: skip
        problems_all = [f"installing tiledmlp moved {p}: {v[0]} -> {v[1]}"
                        for p, v in (venv_info["moved"] or {}).items()]  # fmt: skip
        problems_all += [f"the trl extra would install {p} {v}"
                         for p, v in (venv_info["trl_extra_moves"] or {}).items()]  # fmt: skip
        if venv_info["moved"] is None:
            problems_all.append("tiledmlp ran from src/ (--from-source): the pins were not checked")
        for batch in BATCHES:
            plain = run_one(name, venvs / name, fw_work, batch, False, args.from_source)
            tiled = run_one(name, venvs / name, fw_work, batch, True, args.from_source)
            problems = compare(plain, tiled)
            if plain.get("vocab_outputs", 0) == 0 and name != "trl":
                # the probe must see the logits where they form, or its "never formed" is empty
                problems.append("the probe saw no logits in the run without tiledmlp")
            entry["batches"][str(batch)] = {
                "losses_plain": plain.get("losses"),
                "losses_tiled": tiled.get("losses"),
                "tiled_loss_calls": tiled.get("tiled_loss_calls"),
                "logits_formed_plain": plain.get("vocab_outputs"),
                "logits_formed_tiled": tiled.get("vocab_outputs"),
                "seconds": [plain.get("seconds"), tiled.get("seconds")],
                "problems": problems,
            }
            problems_all += [f"batch {batch}: {p}" for p in problems]
            print(f"{name} batch {batch}: {'ok' if not problems else '; '.join(problems)}",
                  flush=True)  # fmt: skip
        entry["result"] = "pass" if not problems_all else "fail"
        entry["problems"] = problems_all
        frameworks[name] = entry
        failed |= bool(problems_all)
        record_path.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    print(f"wrote {record_path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
