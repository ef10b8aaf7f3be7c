"""Packaging: the distribution name, one version, the torch floor, and what the wheel ships.

The torch floor (``MIN_TORCH``, ``torch>=`` in pyproject.toml) is reasoned from the APIs the
code calls (``dist.P2POp(..., group_peer=...)`` appeared in torch 2.6), not run on an old torch
here; these tests check that the declared floor and the import-time check agree and that the
check refuses an older version.
"""

from __future__ import annotations

import ast
import importlib
import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import tokenring

tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from 3.11")

ROOT = Path(__file__).resolve().parent.parent
DISTRIBUTION = "tokenring-attention"


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_torch_floor_in_pyproject_is_the_one_checked_at_import() -> None:
    deps = _pyproject()["project"]["dependencies"]
    torch_deps = [d for d in deps if re.match(r"torch\b", d)]
    assert torch_deps == [f"torch>={tokenring.MIN_TORCH}"]


@pytest.mark.parametrize("version", ["2.6.0", "2.6.0+cu124", "2.7.1", "2.13.0+cpu", "10.0.0"])
def test_torch_check_accepts_the_floor_and_newer(version: str) -> None:
    tokenring._check_torch(version)


@pytest.mark.parametrize("version", ["2.5.1+cu121", "2.4.0", "1.13.1", "not-a-version"])
def test_torch_check_refuses_older_naming_both_versions(version: str) -> None:
    with pytest.raises(ImportError) as info:
        tokenring._check_torch(version)
    assert f"torch >= {tokenring.MIN_TORCH}" in str(info.value)
    assert f"torch {version} is installed" in str(info.value)


def test_import_runs_the_check() -> None:
    """``import tokenring`` on a torch that reports 2.5.1 fails before anything else touches
    torch (a stand-in module with only ``__version__`` is enough to get there)."""
    code = (
        "import sys, types; sys.modules['torch'] = types.SimpleNamespace(__version__='2.5.1'); "
        "import tokenring"
    )
    run = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"},
    )
    assert run.returncode != 0
    assert "ImportError: tokenring needs torch >= " in run.stderr, run.stderr


def _run_python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin", **env},
    )


def test_import_reads_the_floor_from_metadata_without_importing_torch(tmp_path: Path) -> None:
    """With torch not imported, the check reads the installed distribution's version: a
    torch 2.5.1 dist-info ahead on the path is refused, and torch is not imported for it."""
    info = tmp_path / "torch-2.5.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.5.1\n")
    code = (
        "import sys\ntry:\n    import tokenring\nexcept ImportError as exc:\n"
        "    print(exc)\nprint('torch' in sys.modules)"
    )
    run = _run_python(code, PYTHONPATH=f"{tmp_path}:{ROOT / 'src'}")
    assert run.returncode == 0, run.stderr
    message, torch_imported = run.stdout.splitlines()
    assert "tokenring needs torch >= " in message and "torch 2.5.1 is installed" in message
    assert torch_imported == "False"


_LAZY_FACTS = """
import json, sys, types
import tokenring
facts = {"version": tokenring.__version__, "torch_after_import": "torch" in sys.modules}
facts["not_listed"] = sorted(set(tokenring.__all__) - set(dir(tokenring)))
facts["torch_after_dir"] = "torch" in sys.modules
import tokenring.launch  # the submodule first: the name stays the function
facts["launch_is_function"] = isinstance(tokenring.launch, types.FunctionType)
namespace = {}
exec("from tokenring import *", namespace)
facts["not_star"] = sorted(set(tokenring.__all__) - set(namespace))
facts["none"] = [n for n in tokenring.__all__ if getattr(tokenring, n) is None]
facts["modules"] = sorted(v.__name__ for v in vars(tokenring).values()
                          if isinstance(v, types.ModuleType) and v.__name__.startswith("tokenring"))
print(json.dumps(facts))
"""


def test_import_is_lazy_and_every_public_name_loads_the_library() -> None:
    """Note [Lazy package] in tokenring: ``import tokenring`` imports no torch; ``dir``
    lists every public name; the first public name loads the library, and then all of them
    resolve (``launch`` to the function even when ``tokenring.launch`` the module was
    imported first); loading binds the submodules ``_MODULES`` names, as the eager package
    did."""
    run = _run_python(_LAZY_FACTS)
    assert run.returncode == 0, run.stderr
    facts = json.loads(run.stdout)
    assert facts["version"] == tokenring.__version__
    assert facts["torch_after_import"] is False and facts["torch_after_dir"] is False
    assert facts["not_listed"] == []
    assert facts["launch_is_function"] is True
    assert facts["not_star"] == [] and facts["none"] == []
    assert facts["modules"] == sorted(f"tokenring.{m}" for m in tokenring._MODULES)


def _type_checking_imports() -> dict[str, tuple[str, ...]]:
    """What ``tokenring/__init__.py`` imports under ``if TYPE_CHECKING:`` (what mypy sees)."""
    tree = ast.parse((ROOT / "src" / "tokenring" / "__init__.py").read_text())
    (block,) = [
        node
        for node in tree.body
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
    ]
    return {
        node.module: tuple(alias.name for alias in node.names)
        for node in block.body
        if isinstance(node, ast.ImportFrom) and node.module is not None
    }


def test_the_names_type_checkers_see_are_the_names_loaded() -> None:
    loaded = {
        module: tuple(importlib.import_module(module).__all__) if names is None else names
        for module, names in tokenring._EXPORTS.items()
    }
    assert _type_checking_imports() == loaded
    exported = [name for names in loaded.values() for name in names]
    assert sorted(exported) == sorted(set(tokenring.__all__) - {"MIN_TORCH"})
    assert len(exported) == len(set(exported))


def test_distribution_name_and_single_version_source() -> None:
    project = _pyproject()
    assert project["project"]["name"] == DISTRIBUTION
    assert "version" not in project["project"]
    assert project["project"]["dynamic"] == ["version"]
    dynamic = project["tool"]["setuptools"]["dynamic"]["version"]
    assert dynamic == {"attr": "tokenring.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", tokenring.__version__)


def _project_texts() -> list[tuple[Path, str]]:
    paths = [ROOT / "README.md", *sorted((ROOT / "src").rglob("*.py"))]
    paths += sorted((ROOT / "examples").glob("*.py")) + sorted((ROOT / "tests").glob("*.py"))
    return [(p, p.read_text()) for p in paths if p != Path(__file__).resolve()]


def test_install_hints_name_the_distribution_and_real_extras() -> None:
    extras = set(_pyproject()["project"]["optional-dependencies"])
    wrong = re.compile(r"pip install ['\"]?tokenring(?![\w-])")  # the unrelated project
    ours = re.compile(re.escape(DISTRIBUTION) + r"\[([\w,]+)\]")
    problems = []
    num_hints = 0
    for path, text in _project_texts():
        for lineno, line in enumerate(text.splitlines(), 1):
            if wrong.search(line):
                problems.append(f"{path.relative_to(ROOT)}:{lineno}: {line.strip()}")
            for match in ours.finditer(line):
                num_hints += 1
                unknown = set(match.group(1).split(",")) - extras
                if unknown:
                    problems.append(f"{path.relative_to(ROOT)}:{lineno}: extras {unknown}")
    assert not problems, "\n".join(problems)
    assert num_hints >= 5  # README, hf, plot, the console and simulate name their extra


def test_wheel_ships_types_license_and_metadata(tmp_path: Path) -> None:
    """``pip wheel`` of a copy of the tree (so no build output lands in the checkout)."""
    setuptools = pytest.importorskip("setuptools", reason="the build backend is setuptools")
    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip(f"building needs setuptools >= 77; found {setuptools.__version__}")
    tree = tmp_path / "tree"
    tree.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, tree / name)
    shutil.copytree(ROOT / "src", tree / "src", ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "wheels"
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    run = subprocess.run(
        [*cmd, "-w", str(out), str(tree)], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stdout + run.stderr
    wheel = out / f"tokenring_attention-{tokenring.__version__}-py3-none-any.whl"
    assert wheel.exists(), sorted(p.name for p in out.iterdir())
    info = f"tokenring_attention-{tokenring.__version__}.dist-info"
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        metadata = z.read(f"{info}/METADATA").decode()
        license_text = z.read(f"{info}/licenses/LICENSE").decode()
        entry_points = z.read(f"{info}/entry_points.txt").decode()
    assert {"tokenring/py.typed", "tokenring/__init__.py", "tokenring/api.py"} <= names
    fields = [line.split(": ", 1) for line in metadata.splitlines() if ": " in line]
    assert ["Name", DISTRIBUTION] in fields
    assert ["Version", tokenring.__version__] in fields
    assert ["License-Expression", "Apache-2.0"] in fields
    assert ["Requires-Dist", f"torch>={tokenring.MIN_TORCH}"] in fields
    assert ["Classifier", "Typing :: Typed"] in fields
    assert "tokenring = tokenring.cli:main" in entry_points
    # the full license text, not a pointer to it
    assert license_text == (ROOT / "LICENSE").read_text()
    for part in ("Apache License", "Version 2.0, January 2004", "9. Accepting Warranty"):
        assert part in license_text
    assert "END OF TERMS AND CONDITIONS" in license_text
