"""The commands the documentation shows run as written: those of the README's
bash blocks and of each example config's header (its indented command lines and
the `eqtrain ...` its prose names), read from the files, so that a changed
document runs its new commands. They run with the installed `eqtrain`, from a
copy of the repository's layout (README.md, examples/) as working directory, so
`runs/` lands there as it would in a checkout.

What is not run as written, and why, is said where it is decided: the README's
set-up and test lines (`README_NOT_RUN`), its placeholders (`PLACEHOLDERS`),
and the training length (`_short`)."""

import dataclasses
import functools
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest


ROOT = Path(__file__).parent.parent
EQTRAIN = Path(sys.executable).parent / "eqtrain"  # the installed console script
CONFIGS = sorted((ROOT / "examples" / "configs").glob("*.toml"))
# The README lines that are not `eqtrain` commands. The set-up ones made the
# environment these tests run in (CI's install of ".[test,hf,ray]" holds "."'s);
# the suite's own command is CI's (`.ci/run`, checked below), which these tests
# are part of, and so is `nox -s ... tests`: running either would recurse.
README_NOT_RUN = (
    r"python3 -m venv \.venv",
    r"\.venv/bin/pip install -e \S+",
    r"\.venv/bin/python -m pytest",
    r"nox -s [\w ]+",
)
# Arguments a reader replaces with their own (a config, a model directory): the
# commands naming them cannot run as written, so they are checked to parse
# (`test_placeholder_commands_parse`) instead.
PLACEHOLDERS = ("run.toml", "path/to/hf_model")


# Appended to each `eqtrain fit` that trains, but the README's first command (the
# default run, 300 steps: 63 s here on a quiet hour, 6 min on a loaded one with the
# CPU probe), which runs as written: `--set loop.steps=N`, the README's own
# override, N = the config's warmup + 1 (a schedule's warmup must end before its
# last step), at least 2. At their written sizes the others take about as long
# each (arithmetic_sft.toml took 500 s and grpo.toml 131 s on the loaded hour):
# together, longer than the whole default suite. The configs, paths,
# prerequisites, working directory, environment, evaluation at the end,
# checkpoints and exports stay as written.
def _short(command):
    if command.args[0] != "fit" or command.dry or command.args == ("fit",):
        return ()
    warmup = _config(command.config).optim.warmup_steps or 0
    return ("--set", f"loop.steps={max(2, warmup + 1)}")


TIMEOUT = 900  # seconds per command: the first `eqtrain fit` measuring the CPU
# settings took 430 s on a loaded 2-core machine (probe and 2 steps)


@dataclasses.dataclass(frozen=True)
class Command:
    """One documented `eqtrain` command."""

    source: str  # the file it is written in
    text: str  # as written (without its comment)
    env: tuple[tuple[str, str], ...]  # its NAME=value prefixes
    args: tuple[str, ...]  # after `eqtrain`

    @property
    def config(self) -> str | None:
        """The config of an `eqtrain fit`: its .toml argument, else None."""
        tomls = [a for a in self.args[1:] if a.endswith(".toml")]
        return tomls[0] if self.args[0] == "fit" and tomls else None

    @property
    def dry(self) -> bool:
        return any(a in ("--dry-run", "--memory-budget") for a in self.args)

    @property
    def placeholder(self) -> bool:
        return any(a in PLACEHOLDERS for a in self.args)


def _bash_blocks(text):
    return re.findall(r"```bash\n(.*?)```", text, flags=re.S)


def _joined(lines):
    """Shell lines with their backslash continuations joined."""
    out, held = [], ""
    for line in lines:
        held += line.strip()
        if held.endswith("\\"):
            held = held[:-1] + " "
        elif held:
            out.append(held)
            held = ""
    return out


def _parts(line):
    """The commands of one shell line: its words (the comment dropped), split
    at `&&`."""
    parts = [[]]
    for word in shlex.split(line, comments=True):
        if word == "&&":
            parts.append([])
        else:
            parts[-1].append(word)
    return [p for p in parts if p]


def _command(words, source):
    """`words` as a `Command` if they run `eqtrain` (perhaps as .venv/bin/eqtrain,
    after NAME=value prefixes), else None."""
    env = []
    while re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        env.append(tuple(words.pop(0).split("=", 1)))
    if Path(words[0]).name != "eqtrain":
        return None
    text = shlex.join([*(f"{k}={v}" for k, v in env), "eqtrain", *words[1:]])
    return Command(source, text, tuple(env), tuple(words[1:]))


def readme_lines():
    """Every command of the README's bash blocks, as lists of words."""
    blocks = _bash_blocks((ROOT / "README.md").read_text())
    return [p for b in blocks for line in _joined(b.splitlines()) for p in _parts(line)]


def readme_commands():
    found = (_command(list(words), "README.md") for words in readme_lines())
    return [c for c in found if c is not None]


def _header_lines(path):
    """A config's leading comment block, without the `#`s."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line[1:])
    return lines


def header_commands(path):
    """The commands of a config's header: indented lines (code, as in Markdown)
    and `eqtrain ...` in backquotes in the prose, in the order written."""
    source = f"examples/configs/{path.name}"
    texts, held = [], ""
    for line in _header_lines(path):
        if held or re.match(r" {4,}\S", line):
            held += line.strip()
            if held.endswith("\\"):
                held = held[:-1] + " "
            else:
                texts.append(held)
                held = ""
        else:
            texts += re.findall(r"`(eqtrain [^`]+)`", line)
    commands = [_command(w, source) for t in texts for w in _parts(t)]
    assert None not in commands, (source, texts)  # a header shows only eqtrain's
    return commands


DOCUMENTS = {"README.md": readme_commands()} | {
    f"examples/configs/{p.name}": header_commands(p) for p in CONFIGS
}


# -- which runs a command reads and writes --------------------------------------


def _run_of(path):
    """`runs/NAME` for a path inside it, else None."""
    parts = Path(path).parts
    return "/".join(parts[:2]) if len(parts) >= 2 and parts[0] == "runs" else None


@functools.cache
def _config(path):
    """The resolved config `eqtrain fit` reads (the default run's without one)."""
    from eqtrain import config as config_lib

    return config_lib.load(None if path is None else ROOT / path, [])


def run_dir(command):
    """The run an `eqtrain fit` trains (or, dry, reports on)."""
    return _config(command.config).run_dir


def reads(command):
    """The runs a command needs to exist: a fit's `model.init_from` (and a
    distillation's `task.teacher`), the other commands' `runs/...` arguments (but
    `import`'s OUT, which it makes)."""
    if command.args[0] == "fit":
        config = _config(command.config)
        paths = (config.model.init_from, config.task.teacher)
        return {_run_of(p or "") for p in paths} - {None}
    given = command.args[1:2] if command.args[0] == "import" else command.args[1:]
    return {_run_of(a) for a in given} - {None}


def writes(command):
    if command.args[0] == "fit" and not command.dry:
        return {run_dir(command)}
    if command.args[0] == "import":
        return {_run_of(command.args[2])} - {None}
    return set()


def touches(command):
    """The runs a command is about: it shares a working directory with the
    other commands about them."""
    own = {run_dir(command)} if command.args[0] == "fit" else set()
    return reads(command) | writes(command) | own


def chains():
    """The runnable commands, each once (the README's first, then the headers' in
    file order), grouped into chains of commands about the same runs: each chain
    runs in its own copy, in that order."""
    ordered, seen = [], set()
    for command in (c for cs in DOCUMENTS.values() for c in cs if not c.placeholder):
        if (command.env, command.args) not in seen:
            seen.add((command.env, command.args))
            ordered.append(command)
    groups = []
    for command in ordered:
        runs = touches(command)
        joined = [g for g in groups if runs & set().union(*map(touches, g))]
        merged = [c for g in joined for c in g] + [command]
        groups = [g for g in groups if g not in joined] + [merged]
    return sorted(groups, key=lambda g: ordered.index(g[0]))


def _chain_id(commands):
    names = []
    for command in commands:
        names += [Path(r).name for r in sorted(touches(command))]
    return "+".join(dict.fromkeys(names)) or commands[0].text


CHAINS = chains()


# -- the checks -------------------------------------------------------------------


def test_readme_test_command_is_what_ci_runs():
    """The README's test block is `.ci/run`'s last line: CI runs it (these tests
    included), so it is compared, not run from here."""
    block = next(
        b for b in _bash_blocks((ROOT / "README.md").read_text()) if "pytest" in b
    )
    ci = [
        line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.strip()
    ]
    assert block.strip() == ci[-1].strip()


def test_every_readme_line_is_run_or_accounted_for():
    other = [shlex.join(w) for w in readme_lines() if _command(list(w), "") is None]
    unknown = [o for o in other if not any(re.fullmatch(p, o) for p in README_NOT_RUN)]
    assert not unknown, f"not run and not in README_NOT_RUN: {unknown}"
    # the first block's `eqtrain fit` is run (the default run's chain)
    assert any(c.args == ("fit",) for chain in CHAINS for c in chain)


def test_each_header_trains_its_config():
    for path in CONFIGS:
        fits = [c.config for c in header_commands(path) if c.args[0] == "fit"]
        assert f"examples/configs/{path.name}" in fits, path.name


@pytest.mark.parametrize("document", list(DOCUMENTS), ids=str)
def test_each_document_states_its_prerequisites(document):
    """Each document alone, in its order, makes every run a command of it reads:
    a reader who follows only it gets there (the chains below share runs between
    documents, so a missing line would not show there)."""
    made = set()
    for command in DOCUMENTS[document]:
        if command.placeholder:
            continue
        missing = reads(command) - made
        assert not missing, f"{document}: `{command.text}` needs {missing} first"
        made |= writes(command)


PLACEHOLDER_COMMANDS = [c for c in DOCUMENTS["README.md"] if c.placeholder]


@pytest.mark.parametrize("command", PLACEHOLDER_COMMANDS, ids=lambda c: c.text)
def test_placeholder_commands_parse(command):
    """A command with a reader's own file in it (run.toml, path/to/hf_model)
    parses: its command exists and every flag written is accepted (click rejects
    an unknown option before it shows the help)."""
    from typer.testing import CliRunner

    from eqtrain.cli import app

    done = CliRunner().invoke(app, [*command.args, "--help"])
    assert done.exit_code == 0, done.output
    assert "Usage: eqtrain" in done.output, done.output


@pytest.fixture(scope="module")
def cpu_cache(tmp_path_factory):
    """A fresh cache for the CLI's CPU settings: the chain that uses it measures
    them as a user's first `eqtrain fit` does, once."""
    return tmp_path_factory.mktemp("eqtrain-cpu-cache")


# The chain run under the CLI's real CPU settings (measured once, in a fresh cache
# directory) instead of the tests' `EQTRAIN_CPU_TUNING=fixed`: GRPO's, since
# `eqtrain fit examples/configs/grpo.toml` once crashed at its first step on a new
# processor, under the settings measured there ("compiler_options can only be
# passed to top-level jax.jit"), while the tests passed.
REAL_SETTINGS_RUN = "runs/grpo"


def _env(command, cpu_cache):
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the tests' 8 devices; a reader's shell has none
    if cpu_cache is not None:
        env.pop("EQTRAIN_CPU_TUNING", None)
        env["EQTRAIN_CACHE_DIR"] = str(cpu_cache)
    return env | dict(command.env)


def _run(command, cwd, cpu_cache):
    """Run `command` (shortened: `_short`) in `cwd`; its time is printed, its
    output shown when it fails."""
    args = [str(EQTRAIN), *command.args, *_short(command)]
    start = time.perf_counter()
    proc = subprocess.Popen(
        args,
        cwd=cwd,
        env=_env(command, cpu_cache),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # the CPU probe's processes end with it
    )
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    took = time.perf_counter() - start
    shown = shlex.join(["eqtrain", *args[1:]])
    print(f"{took:7.1f} s  {shown}")
    assert proc.returncode == 0, (
        f"`{command.text}` ({command.source}), run as `{shown}`, exited with "
        f"{proc.returncode} after {took:.0f} s:\n{out[-1000:]}\n{err[-3000:]}"
    )


@pytest.mark.parametrize("chain", CHAINS, ids=_chain_id)
def test_documented_commands_run(chain, tmp_path, request):
    """Each chain of documented commands runs in order in its own copy of the
    repository's layout."""
    shutil.copy(ROOT / "README.md", tmp_path)
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    real = any(REAL_SETTINGS_RUN in touches(c) for c in chain)
    cpu_cache = request.getfixturevalue("cpu_cache") if real else None
    for command in chain:
        _run(command, tmp_path, cpu_cache)
