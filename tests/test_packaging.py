"""Installing kvtier puts one import package, ``kvtier``, into site-packages."""

import ast
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # starts processes or loads the real model

REPO = Path(__file__).resolve().parents[1]
PRODUCT = ("tiers", "engine", "costmodel")


def source_packages() -> set[str]:
    """Every folder of the product that holds a module, as an import name."""
    return {"kvtier"} | {
        "kvtier." + ".".join(module.parent.relative_to(REPO).parts)
        for top in PRODUCT
        for module in (REPO / top).rglob("*.py")
    }


def test_every_subpackage_is_listed_for_setuptools():
    """``[tool.setuptools] packages`` names each package of the source tree: an unlisted
    one works in an editable install and is missing from the wheel."""
    setuptools = (REPO / "pyproject.toml").read_text().split("[tool.setuptools]", 1)[1]
    listed = ast.literal_eval(re.search(r"^packages = (\[.*?\])$", setuptools, re.M).group(1))
    assert set(listed) == source_packages()


def test_wheel_installs_only_the_kvtier_package(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(REPO)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    (wheel,) = tmp_path.glob("kvtier-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"kvtier"}
    for package in source_packages() - {"kvtier"}:
        assert package.replace(".", "/") + "/__init__.py" in names
    assert not any(n.startswith(("kvtier/tests/", "kvtier/bench/")) for n in names)
    static = REPO / "engine" / "serve" / "static"  # the dashboard's page, script, style and Chart.js: package data
    assert {f"kvtier/engine/serve/static/{f.name}" for f in static.iterdir()} <= set(names)


def test_source_tree_and_install_import_the_same_package():
    code = "import kvtier, kvtier.tiers.page as p; from kvtier import Engine; print(kvtier.__file__, p.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, check=True).stdout
    package_file, page_file = out.split()
    assert Path(package_file) == REPO / "__init__.py"
    assert Path(page_file) == REPO / "tiers" / "page.py"


def test_the_suite_runs_from_a_checkout_whatever_its_folder_is_called(tmp_path):
    """pytest imports the checkout's own ``__init__.py`` under the folder's name (the
    repository root is the package): a clone into ``kv.tier-2`` (or ``mktemp -d``'s
    ``tmp.XXXX``) must run the tests as ``main`` does."""
    clone = tmp_path / "kv.tier-2"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True, capture_output=True, timeout=120)
    for path in (REPO / "__init__.py", REPO / "tests"):  # the working tree as it is, committed or not
        target = clone / path.relative_to(REPO)
        if path.is_dir():
            subprocess.run(["cp", "-r", f"{path}/.", str(target)], check=True)
        else:
            target.write_bytes(path.read_bytes())
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "0", "tests/engine/test_flights.py"],
        cwd=clone,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:]
