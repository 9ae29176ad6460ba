"""The release: one version, the license, the changelog, the deprecation filters, and the built package.

The slow test builds the sdist and, from it, the wheel (``python -m build``, offline), checks that the wheel holds
every module, data file, ``py.typed`` marker and entry point, installs it (not editable, without dependencies) into a
fresh virtual environment that sees this environment's third-party packages but not our source tree, and from an
unrelated folder runs the command and a README example there.
"""

import configparser
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile

import pytest
import tomllib

import pyterrier_prob

ROOT = pathlib.Path(__file__).parent.parent
PACKAGES = ("pyterrier_prob", "st_extensions")
#: Files besides the packages that the build reads (pyproject's readme and license-files).
BUILD_INPUTS = ("pyproject.toml", "README.md", "LICENSE")
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf8"))


def package_files() -> set[str]:
    """Every file of the packages as the wheel names it (``pyterrier_prob/cli.py``, ``st_extensions/py.typed``):
    modules and data files alike, bytecode caches left out."""
    return {
        path.relative_to(ROOT).as_posix()
        for package in PACKAGES
        for path in (ROOT / package).rglob("*")
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"
    }


def declared_entry_points() -> dict[str, dict[str, str]]:
    """``{group: {name: target}}`` of pyproject's ``[project.scripts]`` and ``[project.entry-points.*]``."""
    project = pyproject()["project"]
    return {"console_scripts": project["scripts"], **project.get("entry-points", {})}


# --- fast checks --------------------------------------------------------------------------------------------------


def test_the_version_lives_in_one_place():
    config = pyproject()
    assert "version" not in config["project"] and "version" in config["project"]["dynamic"]
    assert config["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "pyterrier_prob.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", pyterrier_prob.__version__)
    defined = [p for p in map(ROOT.joinpath, package_files()) if p.suffix == ".py" and "__version__ =" in p.read_text()]
    assert defined == [ROOT / "pyterrier_prob" / "__init__.py"]


def test_version_option(capsys):
    from pyterrier_prob.cli import build_parser, main

    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"pyterrier-prob {pyterrier_prob.__version__}\n"
    with pytest.raises(SystemExit) as stop:  # after a command too, and listed in its help
        build_parser("mol").parse_args(["--version"])
    assert stop.value.code == 0 and capsys.readouterr().out == f"pyterrier-prob {pyterrier_prob.__version__}\n"
    assert "--version" in build_parser("pebr", commands=True).format_help()


def test_license_changelog_and_readme_name_this_release():
    config = pyproject()["project"]
    assert config["license"] == "Apache-2.0" and config["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text(encoding="utf8")
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text
    changelog = (ROOT / "CHANGELOG.md").read_text(encoding="utf8")
    assert re.search(rf"^## \[{re.escape(pyterrier_prob.__version__)}\] - \d{{4}}-\d{{2}}-\d{{2}}$", changelog, re.M)
    assert not re.search(r"(?i)\b(?:issue|PR|pull request)\s*#\d+", changelog)
    wheels = re.findall(r"pyterrier_prob-([\w.]+)-py3-none-any\.whl", (ROOT / "README.md").read_text(encoding="utf8"))
    assert wheels and set(wheels) == {pyterrier_prob.__version__}


def test_packages_are_typed():
    for package in PACKAGES:
        assert (ROOT / package / "py.typed").is_file(), package
        assert "py.typed" in pyproject()["tool"]["setuptools"]["package-data"][package]


def _warn_from(module: str, category: type[Warning]) -> None:
    """Raise a warning as code of ``module`` does (``warnings.warn`` attributes it to the caller's module)."""
    exec("import warnings\nwarnings.warn('planted', category)", {"__name__": module, "category": category})


@pytest.mark.parametrize("category", [DeprecationWarning, PendingDeprecationWarning, FutureWarning])
@pytest.mark.parametrize("module", ["pyterrier_prob.planted", "st_extensions.losses.planted"])
def test_a_deprecation_in_our_code_fails_the_tests(module, category):
    """pyproject's filterwarnings: a deprecated call made by our modules is an error under pytest."""
    with pytest.raises(category, match="planted"):
        _warn_from(module, category)


@pytest.mark.parametrize("category", [DeprecationWarning, PendingDeprecationWarning])
def test_a_deprecation_inside_a_library_is_not_ours_to_fail_on(category):
    _warn_from("transformers.planted", category)  # no error: the library's own code is not ours to fix


# --- the built package ----------------------------------------------------------------------------------------------


def build(tmp_path: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """``(sdist, wheel)`` built offline (``--no-isolation``: this environment's setuptools) from a copy of the
    source, so that the build writes nothing into the working tree; the wheel is built from the sdist."""
    src, dist = tmp_path / "src", tmp_path / "dist"
    src.mkdir(parents=True)
    for name in BUILD_INPUTS:
        shutil.copy2(ROOT / name, src / name)
    for package in PACKAGES:
        shutil.copytree(ROOT / package, src / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    proc = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(src)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"python -m build failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    (sdist,), (wheel,) = dist.glob("*.tar.gz"), dist.glob("*.whl")
    return sdist, wheel


def check_archives(sdist: pathlib.Path, wheel: pathlib.Path) -> None:
    version = pyterrier_prob.__version__
    assert wheel.name == f"pyterrier_prob-{version}-py3-none-any.whl"
    expected = package_files()
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        info = f"pyterrier_prob-{version}.dist-info"
        entry_points = configparser.ConfigParser(delimiters=("=",))
        entry_points.optionxform = str  # names are case-sensitive
        entry_points.read_string(z.read(f"{info}/entry_points.txt").decode())
        metadata = z.read(f"{info}/METADATA").decode()
    assert not expected - names, f"the wheel misses {sorted(expected - names)}"
    assert {f"{package}/py.typed" for package in PACKAGES} <= names
    assert f"{info}/licenses/LICENSE" in names
    assert f"\nVersion: {version}\n" in metadata and "\nLicense-Expression: Apache-2.0\n" in metadata
    found = {group: dict(entry_points[group]) for group in entry_points.sections()}
    assert found == declared_entry_points()
    assert found["console_scripts"]["pyterrier-prob"] == "pyterrier_prob.cli:main"
    with tarfile.open(sdist) as t:
        in_sdist = {name.split("/", 1)[1] for name in t.getnames() if "/" in name}
    missing = {*expected, *BUILD_INPUTS} - in_sdist
    assert not missing, f"the sdist misses {sorted(missing)}"


def fresh_venv(folder: pathlib.Path, wheel: pathlib.Path) -> pathlib.Path:
    """A new virtual environment with ``wheel`` installed (not editable, no dependencies) that sees this
    environment's site-packages through a ``.pth`` line: a folder named there joins ``sys.path`` without its own
    ``.pth`` files being run, so the editable install's finder (our source tree) stays out. Its ``bin`` folder."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True, timeout=120)
    python = folder / "bin" / "python"
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    pathlib.Path(site, "base_environment.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    # --ignore-installed: the editable install's metadata is visible; pip must neither skip nor uninstall it
    install = [python, "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed", "--no-compile"]
    proc = subprocess.run(
        [*install, "--disable-pip-version-check", str(wheel)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return folder / "bin"


def run_in(bin_dir: pathlib.Path, cwd: pathlib.Path, *command: str, timeout: int = 300) -> str:
    """Run ``command`` (its first word a program of ``bin_dir``) from ``cwd``, as a user of that environment would;
    its stdout, after asserting exit status 0."""
    dropped = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    argv = [str(bin_dir / command[0]), *command[1:]]
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{command} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc.stdout


def readme_block(marker: str) -> str:
    blocks = [code for code in FENCE.findall((ROOT / "README.md").read_text(encoding="utf8")) if marker in code]
    assert len(blocks) == 1, f"expected one README python block with {marker!r}"
    return blocks[0]


@pytest.mark.slow
def test_the_wheel_installs_and_runs_outside_the_source_tree(tmp_path, small_beir):
    sdist, wheel = build(tmp_path / "build")
    check_archives(sdist, wheel)
    bin_dir = fresh_venv(tmp_path / "venv", wheel)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    where = run_in(
        bin_dir,
        elsewhere,
        "python",
        "-c",
        "import sys, pyterrier_prob, st_extensions; print(pyterrier_prob.__file__); print(st_extensions.__file__); "
        "print(any('__editable__' in type(f).__module__ for f in sys.meta_path))",
    ).split()
    site = (tmp_path / "venv").resolve()
    assert all(pathlib.Path(p).resolve().is_relative_to(site) for p in where[:2]), where
    assert where[2] == "False", "the editable install's finder was loaded"

    assert "pebr" in run_in(bin_dir, elsewhere, "pyterrier-prob", "--help")
    assert run_in(bin_dir, elsewhere, "pyterrier-prob", "--version") == f"pyterrier-prob {pyterrier_prob.__version__}\n"

    folder, _ = small_beir
    argv = ["pyterrier-prob", "pebr", "--dataset", str(folder), "--steps", "2", "--batch-size", "4"]
    argv += ["--max-seq-length", "32", "--ks", "5", "20", "--table3-ps", "0.9", "--output", "out", "--quiet"]
    printed = run_in(bin_dir, elsewhere, *argv, timeout=600)
    assert "results written to" in printed and (elsewhere / "out" / "results.md").is_file()
    cpu = json.loads((elsewhere / "out" / "summary.json").read_text(encoding="utf8"))["cpu"]
    assert cpu["omp_wait_policy"] == "PASSIVE" and cpu["batch_scheduled"] in (True, False)  # set by the command

    (elsewhere / "block.py").write_text(readme_block("ShardedSearcher("), encoding="utf8")
    assert "documents above the threshold found" in run_in(bin_dir, elsewhere, "python", "block.py")


def test_deprecated_tokenize_log_is_caught(_no_deprecated_tokenize):
    """The suite-wide guard (``tests/conftest.py``) sees the message sentence-transformers logs when a module
    overrides the deprecated ``tokenize`` instead of ``preprocess``."""
    from sentence_transformers.base.modules.input_module import InputModule

    class OldStyle(InputModule):
        def tokenize(self, texts, **kwargs):
            return {"n": len(texts)}

        def forward(self, features):
            return features

        def save(self, *args, **kwargs):
            pass

    assert OldStyle().preprocess(["a", "b"]) == {"n": 2}
    assert any("OldStyle overrides `tokenize`" in m for m in _no_deprecated_tokenize.messages)
    _no_deprecated_tokenize.messages.clear()  # planted here: this test must not fail the guard
