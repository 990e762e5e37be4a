"""Sessions mirror CI one to one. `nox -s tests` is what `.ci/run` runs (via the
README's test command); the others are on demand."""

import nox


nox.options.sessions = ["lint", "tests"]
nox.options.default_venv_backend = "venv"

FAKE_DEVICES = {
    "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
    "JAX_PLATFORMS": "cpu",
}


@nox.session
def tests(session: nox.Session) -> None:
    """The default suite (everything not marked slow), with every extra it uses
    installed: a test skipped for a missing extra fails (docs/testing.md)."""
    session.install("-e", ".[test,hf,ray]")
    session.run(
        "pytest",
        "-m",
        "not slow",
        "--durations=10",
        *session.posargs,
        env={**FAKE_DEVICES, "EQTRAIN_REQUIRE_EXTRAS": "1"},
    )


@nox.session
def slow(session: nox.Session) -> None:
    """Long tests only (the Ray launcher's among them)."""
    session.install("-e", ".[test,hf,ray]")
    # exit code 5 = no test collected: there may be no slow test yet
    session.run(
        "pytest",
        "-m",
        "slow",
        *session.posargs,
        env={**FAKE_DEVICES, "EQTRAIN_REQUIRE_EXTRAS": "1"},
        success_codes=[0, 5],
    )


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff==0.17.6")
    session.run("ruff", "format", "--check", ".")
    session.run("ruff", "check", ".")


@nox.session
def examples(session: nox.Session) -> None:
    """Each example script with --smoke."""
    session.install("-e", ".")
    import pathlib

    for script in sorted(pathlib.Path("examples").glob("*.py")):
        session.run(
            "python",
            str(script),
            "--smoke",
            "--run-dir",
            f".nox/runs/{script.stem}",
            env={"JAX_PLATFORMS": "cpu"},
        )
    # The ready configs: checked and planned (no training) on 8 simulated devices.
    # (finetune_hf.toml needs the export of pretrain_stdlib.toml: train that first.)
    for config in sorted(pathlib.Path("examples/configs").glob("*.toml")):
        if "init_from" in config.read_text():
            continue
        session.run(
            "eqtrain",
            "fit",
            str(config),
            "--dry-run",
            env={**FAKE_DEVICES, "JAX_PLATFORMS": "cpu"},
        )


@nox.session
def docs(session: nox.Session) -> None:
    session.install("-e", ".[docs]")
    session.run("mkdocs", "build", "--strict")


@nox.session
def benchmarks(session: nox.Session) -> None:
    """The overhead benchmark (prints JSON lines with ratios)."""
    session.install("-e", ".")
    session.run(
        "python",
        "benchmarks/overhead.py",
        *session.posargs,
        env={"JAX_PLATFORMS": "cpu"},
    )
