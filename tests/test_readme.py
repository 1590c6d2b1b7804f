"""The README's commands run and the docs' links lead somewhere (docs/contributing.md, "The README and the
docs: commands and links that stay true").

- Every relative link in README.md and docs/*.md names a file that exists (and a heading there, given a
  ``#fragment``); repository paths in backticks and results files named alone exist.
- Every line of a ``bash`` block in the README is accounted for: a set-up command whose steps are what
  ``.ci/run`` runs (and the demo, run here with a shortened config), a ``megatrain-jax`` command run here on
  the CPU with tiny fixtures in place of the user's paths, or a command marked ``# GPU only`` (parsed, not run).
- The README's ``fit`` example runs, shrunk by exact text replacements.
"""

from __future__ import annotations

import copy
import glob
import json
import re
import shlex
import shutil
from pathlib import Path

import numpy as np
import pytest

from megatrain_jax.cli import main
from megatrain_jax.cli.commands import build_parser

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]
GPU_ONLY = "# GPU only"

# Repository folders whose paths the docs write in backticks, from the repository root.
REPO_DIRS = ("experiments/", "tests/", "megatrain_jax/", "scripts/", "docs/", "examples/", "kernels/", ".ci/")
RESULTS_DIRS = (REPO / "experiments" / "results", REPO / "tests" / "assets" / "measured")
RESULTS_NAME = re.compile(r"(?:h100|h200|gh200|cpu)[\w.-]*\.(?:json|log)")


# ------------------------------------------------------------------------------------------ reading markdown
def prose_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of the lines outside fenced code blocks."""
    out, fenced = [], False
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            out.append((n, line))
    return out


def blocks(path: Path, language: str) -> list[tuple[int, list[str]]]:
    """The fenced blocks of ``language``: (line number of their first line, their lines)."""
    found, lang, body, start = [], None, [], 0
    for n, line in enumerate(path.read_text().splitlines(), 1):
        fence = line.strip()
        if fence.startswith("```"):
            if lang is None:
                lang, body, start = fence[3:].strip(), [], n + 1
            else:
                if lang == language:
                    found.append((start, body))
                lang = None
        elif lang is not None:
            body.append(line)
    return found


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces to ``-``."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a page's headings; a repeated heading gets ``-1``, ``-2``, ... as on GitHub."""
    found, seen = set(), {}
    for _, line in prose_lines(path):
        if m := re.match(r"#{1,6} (.+)", line):
            base = slug(m.group(1))
            repeat = seen.get(base, 0)
            seen[base] = repeat + 1
            found.add(base if repeat == 0 else f"{base}-{repeat}")
    return found


def test_slug_is_githubs():
    assert slug("`fit` in ten lines") == "fit-in-ten-lines"
    assert slug("Every shipped config, as a user runs it") == "every-shipped-config-as-a-user-runs-it"
    assert slug("Capacity mode: bfloat16 masters") == "capacity-mode-bfloat16-masters"


# ------------------------------------------------------------------------------------------ links and paths
@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_relative_links_lead_to_files_and_headings(page):
    prose = "\n".join(line for _, line in prose_lines(page))
    numbers = [n for n, _ in prose_lines(page)]
    broken = []
    for m in re.finditer(r"\]\(([^)\s]+)\)", prose):  # a target never wraps; its text may
        target, n = m.group(1), numbers[prose.count("\n", 0, m.start())]
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        file, _, fragment = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            broken.append(f"{page.name}:{n}: {target} (no such file)")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            broken.append(f"{page.name}:{n}: {target} (no heading #{fragment} in {dest.name})")
    assert not broken, "\n".join(broken)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_repository_paths_and_results_files_named_exist(page):
    missing = []
    for n, line in prose_lines(page):
        for name in re.findall(r"`([^`\s]+)`", line):
            name = name.rstrip(".,;:")
            if "..." in name or "<" in name:  # a placeholder, not a path
                continue
            if name.startswith(REPO_DIRS):
                path = name.split("::")[0]
                found = glob.glob(str(REPO / path)) if "*" in path else (REPO / path).exists()
                if not found:
                    missing.append(f"{page.name}:{n}: {name}")
            elif RESULTS_NAME.fullmatch(name) and not any((d / name).exists() for d in RESULTS_DIRS):
                missing.append(f"{page.name}:{n}: {name} (in neither experiments/results/ nor tests/assets/measured/)")
    assert not missing, "\n".join(missing)


def test_the_readme_links_its_headline_numbers_to_results_files():
    """Each row of the headline table links the results file its numbers come from (or says 'same')."""
    text = README.read_text()
    start = text.index("## Headline numbers")
    table = text[start:text.index("\n## ", start)]  # up to the next section
    rows = [r for r in table.splitlines() if r.startswith("|") and not r.startswith(("| what", "|---"))]
    assert len(rows) >= 8
    for row in rows:
        source = row.rstrip(" |").rsplit("|", 1)[1]
        assert source.strip() == "same" or re.search(r"\]\((experiments/results|tests/assets/measured)/\w+\.json\)",
                                                      source), row


def headline_rows(column: str = "measured") -> list[tuple[str, Path]]:
    """(the ``column`` cell, the results file it cites) for each row of the README's headline table; 'same' is
    the row above's file."""
    text = README.read_text()
    start = text.index("## Headline numbers")
    table = text[start:text.index("\n## ", start)]
    out, cited, header = [], None, None
    for row in table.splitlines():
        if not row.startswith("|") or row.startswith("|---"):
            continue
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if row.startswith("| what"):
            header = cells
            continue
        link = re.search(r"\]\(([^)]+\.json)\)", cells[-1])
        cited = REPO / link.group(1) if link else cited
        out.append((cells[header.index(column)], cited))
    return out


# A figure in a measured cell: digits (thousands with commas), an optional unit that scales it ("B": billions
# of parameters) or makes it a ratio ("×"). Numbers inside names (Llama-3-8B, Qwen2.5-14B, 256K) are not figures.
FIGURE = re.compile(r"(?<![\w.\-])(\d{1,3}(?:,\d{3})+|\d+(?:\.\d+)?)(?:\*\*)?(×|B\b)?(?![\w.\-])")


def numbers_in(value) -> list[float]:
    """Every number a results file holds: its numeric leaves and the numbers written in its strings."""
    if isinstance(value, bool):
        return []
    if isinstance(value, (int, float)):
        return [float(value)] if np.isfinite(value) else []
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list):
        return [n for v in value for n in numbers_in(v)]
    if isinstance(value, str):
        return [float(m) for m in re.findall(r"\d+(?:\.\d+)?", value)]
    return []


def test_each_headline_number_is_in_the_file_it_cites():
    """Every figure in the headline table's measured cells is one the cited results file holds, as written
    (rounded to the digits shown; billions for "B"); a ratio ("×", above or below 1) is the quotient of two
    figures of its cell, or of two of the file's numbers where the cell gives fewer."""
    wrong = []
    for measured, cited in headline_rows():
        held = sorted(set(numbers_in(json.loads(cited.read_text()))))
        figures = [(m.group(1), m.group(2)) for m in FIGURE.finditer(measured)]
        plain = [float(text.replace(",", "")) for text, unit in figures if unit is None]
        for text, unit in figures:
            digits = len(text.split(".")[1]) if "." in text else 0
            figure = float(text.replace(",", ""))
            if unit == "×":  # the quotient of the cell's own figures where it gives two, else of the file's
                pool = plain if len(plain) >= 2 else held
                found = any(round(a / b, digits) == figure for a in pool for b in pool if b > 0 and a != b)
            else:
                scale = 1e9 if unit == "B" else 1.0
                found = any(round(v / scale, digits) == figure for v in held)
            if not found:
                wrong.append(f"{text}{unit or ''} in '{measured[:70]}' is not in {cited.relative_to(REPO)}")
    assert not wrong, "\n".join(wrong)


WHERE = re.compile(r"(?<![\w.\-])(\d+(?:\.\d+)?)(%| GB)?(?![\w.\-])")


def test_each_row_says_where_the_model_lives_from_the_file_it_cites():
    """Every headline row says where the model lives (issue 51), and its figures are the cited file's: a share
    in % (the file's fraction), bytes in GB (one of the file's numbers, or the sum of two: a step's bytes each
    way), counts as written."""
    wrong = []
    for where, cited in headline_rows("where the model lives"):
        if not where:
            wrong.append(f"a row citing {cited.relative_to(REPO)} does not say where the model lives")
            continue
        held = sorted(set(numbers_in(json.loads(cited.read_text()))))
        for m in WHERE.finditer(where):
            digits = len(m.group(1).split(".")[1]) if "." in m.group(1) else 0
            figure, unit = float(m.group(1)), m.group(2)
            if unit == "%":
                found = any(round(100 * v, digits) == figure for v in held if v <= 1)
            elif unit == " GB":
                found = any(round(v / 1e9, digits) == figure for v in held) or any(
                    round((a + b) / 1e9, digits) == figure for a in held for b in held if a > 1e8 and b > 1e8)
            else:
                found = figure in held
            if not found:
                wrong.append(f"{m.group(0)} in '{where[:70]}' is not in {cited.relative_to(REPO)}")
    assert not wrong, "\n".join(wrong)


# ------------------------------------------------------------------------------------------ README commands
def readme_commands() -> list[tuple[int, str]]:
    """(line, command) of every command in the README's bash blocks, continuation lines joined."""
    out = []
    for start, lines in blocks(README, "bash"):
        pending, first = "", 0
        for i, line in enumerate(lines):
            if not pending:
                first = start + i
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            command = (pending + line).strip()
            pending = ""
            if command and not command.startswith("#"):
                out.append((first, " ".join(command.split())))
    return out


def kind(command: str) -> str:
    if command.endswith(GPU_ONLY):
        return "gpu-only"
    if " -m venv .venv && " in command:
        return "setup"
    if command.startswith("megatrain-jax "):
        return "cli"
    return "unknown"


def test_every_readme_command_is_run_or_marked_gpu_only():
    commands = readme_commands()
    unknown = [f"README.md:{n}: {c}" for n, c in commands if kind(c) == "unknown"]
    assert not unknown, ("teach tests/test_readme.py to run these, or end them with '# GPU only' "
                         "(docs/contributing.md):\n" + "\n".join(unknown))
    kinds = {kind(c) for _, c in commands}
    assert {"setup", "cli", "gpu-only"} <= kinds, kinds  # each rule below has something to check


# CI runs the README's set-up commands: .ci/run says so, and these must stay as they are.
DEMO_COMMAND = "python3.12 -m venv .venv && .venv/bin/pip install -e . && .venv/bin/python -m megatrain_jax"
TEST_COMMAND = "python3.12 -m venv .venv && .venv/bin/pip install -e '.[test]' && .venv/bin/python -m pytest -q -n 2"


def _pip_target(step: str) -> tuple[str, set[str]]:
    """``pip install -e '.[a,b]'`` -> ('.', {'a', 'b'})."""
    words = shlex.split(step)
    assert words[:3] == ["pip", "install", "-e"] and len(words) == 4, step
    path, _, extras = words[3].partition("[")
    return path, {e for e in extras.rstrip("]").split(",") if e}


def test_setup_commands_are_what_ci_runs():
    commands = [c for _, c in readme_commands()]
    assert DEMO_COMMAND in commands and TEST_COMMAND in commands
    ci = (REPO / ".ci" / "run").read_text()
    ci_install = next(line.strip() for line in ci.splitlines() if line.strip().startswith("pip install -e "))
    ci_path, ci_extras = _pip_target(ci_install)
    for command in (c for c in commands if kind(c) == "setup"):
        words = command.split(" && ")
        venv = re.sub(r"^(\w+=\S+ )+", "", words[0])  # PYENV_VERSION=... names the interpreter
        assert venv == "python3.12 -m venv .venv" and " -m venv " in ci, command  # CI makes a fresh venv too
        for step in (w.removeprefix(".venv/bin/") for w in words[1:]):
            if step.startswith("pip install -e "):
                path, extras = _pip_target(step)
                assert path == ci_path and extras <= ci_extras, f"{step!r}: CI installs {ci_install!r}"
            elif step.startswith("python -m pytest"):
                assert step in ci, f"{step!r} is not what .ci/run runs"
            else:
                assert step == "python -m megatrain_jax", f"{step!r}: no test runs it"  # test_the_demo_...


def test_the_demo_runs_as_the_readme_says(tmp_path, monkeypatch, capsys):
    """``python -m megatrain_jax`` with the demo config shortened: it writes runs/demo/metrics.jsonl, and a
    second run writes runs/demo-2."""
    from megatrain_jax.cli import run
    demo = copy.deepcopy(run.DEMO)
    demo["model"]["layers"] = 2
    demo["data"].update(seq_len=32, batch_size=4, demo_tokens=20000, eval_fraction=0.05)
    demo["train"].update(steps=3, log_every=1, eval_every=3, eval_batches=1)
    demo["log"] = {"progress": "lines", "tensorboard": False}
    monkeypatch.setattr(run, "DEMO", demo)
    monkeypatch.chdir(tmp_path)
    assert main([]) == 0
    rows = [json.loads(x) for x in (tmp_path / "runs" / "demo" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and np.isfinite(rows[-1]["loss"])
    assert main([]) == 0 and (tmp_path / "runs" / "demo-2" / "metrics.jsonl").exists()
    assert "done: loss" in capsys.readouterr().out


# What the test puts in place of the paths a user would have, and the overrides appended to shrink a run
# (the last value of a key is the one applied; the tiny fixture's max_positions is 128, and the plan's packed rows of
# the demo corpus hold documents of up to 257 tokens).
CHAT_LINES = 60
SMALLER = {"train": ["data.seq_len=48", "data.batch_size=2", "train.steps=3", "data.prefetch=0",
                     "log.progress=lines", "log.tensorboard=false"],
           "plan": ["data.seq_len=48"]}


@pytest.fixture
def user_files(tmp_path):
    """A Hugging Face folder with a tokenizer and chat template (the tiny Llama fixture), a chat JSONL, and
    where the export goes."""
    from test_instruct import CONVERSATION, small_vocab_tokenizer, write_jsonl
    model = tmp_path / "models" / "llama"
    shutil.copytree(REPO / "tests" / "fixtures" / "hf" / "llama", model)
    small_vocab_tokenizer(model, json.loads((model / "config.json").read_text())["vocab_size"])
    lines = [CONVERSATION] + [{"messages": [{"role": "user", "content": "what is two plus two"},
                                           {"role": "assistant", "content": "four " * (1 + i % 3)}]}
                              for i in range(CHAT_LINES - 1)]
    data = write_jsonl(tmp_path / "chat.jsonl", lines)
    return {"/models/llama": str(model), "chat.jsonl": str(data), "/models/llama-sft": str(tmp_path / "export")}


def test_the_readme_cli_commands_run_on_tiny_fixtures(user_files, tmp_path, monkeypatch, capsys):
    """Each ``megatrain-jax`` command of the README, in order, as written but for the user's paths and the
    overrides in SMALLER; then what the README says the run leaves behind."""
    monkeypatch.chdir(tmp_path)
    cache = f"data.cache_dir={tmp_path / 'cache'}"  # keep the tokenized data out of ~/.cache
    ran = []
    for n, command in readme_commands():
        if kind(command) != "cli":
            continue
        argv = shlex.split(command, comments=True)[1:]
        for i, arg in enumerate(argv):
            key, eq, value = arg.partition("=")
            if eq and value in user_files:
                argv[i] = f"{key}={user_files[value]}"
            elif not eq and arg in user_files:
                argv[i] = user_files[arg]
        assert argv[0] in SMALLER, f"README.md:{n}: add '{argv[0]}' to SMALLER in tests/test_readme.py"
        extra = SMALLER[argv[0]] + ([cache] if argv[0] == "train" else [])
        assert main([*argv, *extra]) == 0, f"README.md:{n}: {command}\n{capsys.readouterr().err}"
        ran.append(argv[0])
    assert ran == ["plan", "train"], ran
    out = capsys.readouterr().out
    assert "fits" in out and "done: loss" in out
    export = Path(user_files["/models/llama-sft"])
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):  # "transformers loads it as is"
        assert (export / name).exists(), name
    assert list(export.glob("*.safetensors"))
    rows = [json.loads(x) for x in (tmp_path / "runs" / "default" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3]
    assert any("eval_loss" in r for r in rows)  # data.eval_fraction held examples out and evaluated them


def test_gpu_only_commands_parse_and_name_files_that_exist():
    for n, command in readme_commands():
        if kind(command) != "gpu-only":
            continue
        words = shlex.split(command, comments=True)
        assert words[0] == "megatrain-jax", f"README.md:{n}: only megatrain-jax commands are checked: {command}"
        build_parser().parse_args(words[1:])  # exits (fails the test) on arguments the CLI does not take
        for word in words[1:]:
            path = word.partition("=")[2] or word
            if path.startswith(REPO_DIRS):
                assert (REPO / path).exists(), f"README.md:{n}: {path}"


# ------------------------------------------------------------------------------------------ the fit example
# Exact text of the README's example -> what the test runs instead: a tiny model, a tiny file, 3 steps.
FIT_SMALLER = {
    'mj.preset("7b", layers=16)': 'mj.preset("tiny", layers=2)',
    "seq_len=2048, batch_size=16": "seq_len=32, batch_size=4",
    "resident_layers=8": "resident_layers=1",
    "steps=2000,": "steps=3,",
    "checkpoint_every=200": "checkpoint_every=2",
}


def fit_example(tmp_path: Path, monkeypatch):
    """The README's fit example, shrunk (``FIT_SMALLER``), compiled to run in ``tmp_path`` with its data file."""
    from megatrain_jax.data import demo_tokens, write_tokens
    (start, lines), = blocks(README, "python")
    code = "\n".join(lines)
    assert len(lines) <= 14, "the README promises fit in about ten lines"
    for old, new in FIT_SMALLER.items():
        assert code.count(old) == 1, f"README.md:{start}: the fit example no longer has {old!r}; update FIT_SMALLER"
        code = code.replace(old, new)
    monkeypatch.chdir(tmp_path)  # the example's relative paths: data/train.bin, runs/3p5b/ckpt
    (tmp_path / "data").mkdir()
    write_tokens("data/train.bin", demo_tokens(256, 20000)[0], 256)
    return compile(code, f"{README}:{start}", "exec")


def test_the_fit_example_runs(tmp_path, monkeypatch, capsys):
    scope: dict = {}
    exec(fit_example(tmp_path, monkeypatch), scope)
    history = scope["history"]
    assert len(history["loss"]) == 3 and np.isfinite(history["loss"]).all()
    loss, tokens_per_s = capsys.readouterr().out.split()[-2:]
    assert np.isclose(float(loss), history["loss"][-1]) and float(tokens_per_s) > 0
    assert sorted(p.name for p in (tmp_path / "runs" / "3p5b" / "ckpt").iterdir() if p.name.isdigit()) == ["2", "3"]


def test_the_fit_example_runs_again_with_nothing_left_to_train(tmp_path, monkeypatch, capsys):
    """Run a second time, the example resumes from its last checkpoint (resume=True) with no step left to
    train: its history has no records, and reads the last step's metrics as they were recorded."""
    code = fit_example(tmp_path, monkeypatch)
    first: dict = {}
    exec(code, first)
    capsys.readouterr()
    again: dict = {}
    exec(code, again)
    history = again["history"]
    assert len(history) == 0 and history.resumed["step"] == 3
    assert history["loss"] == [pytest.approx(first["history"]["loss"][-1])]
    loss, tokens_per_s = capsys.readouterr().out.split()[-2:]
    assert np.isclose(float(loss), first["history"]["loss"][-1]) and float(tokens_per_s) > 0
