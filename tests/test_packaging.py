"""The package as pip installs it: a built wheel holds meshdsl and everything it finds at run time.

The wheel is built offline from a copy of the source files (``pip wheel --no-deps
--no-build-isolation``, with the setuptools of this environment), and its file list checked:
every package under meshdsl/, the models as ``meshdsl/models``, the layouts and device profiles
as package data, and nothing installed at the top level but ``meshdsl`` (no ``models``). That a
wheel installed into a fresh environment runs from an empty folder is CI's check (.ci/run).
"""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ["pyproject.toml", "setup.py", "README.md", "meshdsl", "models", "layouts"]


def _wheel(tmp_path: Path) -> zipfile.ZipFile:
    source = tmp_path / "source"
    source.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(ROOT / name, source / name)
    out = tmp_path / "dist"
    command = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "--no-index",
        "-q",
        "-w",
        str(out),
        str(source),
    ]
    built = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = out.glob("meshdsl-*.whl")
    return zipfile.ZipFile(wheel)


def test_wheel_holds_the_package_models_and_layouts_and_no_top_level_models(tmp_path):
    names = set(_wheel(tmp_path).namelist())
    packages = [p.parent.relative_to(ROOT) for p in (ROOT / "meshdsl").rglob("__init__.py")]
    expected = {f"{p.as_posix()}/__init__.py" for p in packages}
    expected |= {f"meshdsl/models/{p.name}" for p in (ROOT / "models").glob("*.py")}
    expected |= {f"meshdsl/layouts/{p.name}" for p in (ROOT / "layouts").glob("*.toml")}
    expected |= {
        f"meshdsl/planner/profiles/{p.name}" for p in (ROOT / "meshdsl" / "planner" / "profiles").glob("*.json")
    }
    assert {"meshdsl/models/transformer.py", "meshdsl/layouts/dp_tp.toml", "meshdsl/model/loader.py"} <= names
    assert not expected - names, f"the wheel lacks {sorted(expected - names)}"
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"meshdsl"}, f"the wheel installs top-level {sorted(tops - {'meshdsl'})}"
    info = next(n for n in names if n.endswith(".dist-info/top_level.txt"))
    assert _wheel_text(tmp_path, info).split() == ["meshdsl"]
    entry = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "meshdsl = meshdsl.cli:main" in _wheel_text(tmp_path, entry)


def _wheel_text(tmp_path: Path, name: str) -> str:
    (wheel,) = (tmp_path / "dist").glob("meshdsl-*.whl")
    return zipfile.ZipFile(wheel).read(name).decode()
