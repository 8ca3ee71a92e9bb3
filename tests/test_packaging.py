"""Installing kvtier puts one import package, ``kvtier``, into site-packages."""

import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_wheel_installs_only_the_kvtier_package(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(REPO)],
                   check=True, capture_output=True, timeout=600)
    (wheel,) = tmp_path.glob("kvtier-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"kvtier"}
    for sub in ("tiers", "engine", "costmodel"):
        assert f"kvtier/{sub}/__init__.py" in names
    assert not any(n.startswith(("kvtier/tests/", "kvtier/bench/")) for n in names)


def test_source_tree_and_install_import_the_same_package():
    code = "import kvtier, kvtier.tiers.page as p; from kvtier import Engine; print(kvtier.__file__, p.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, check=True).stdout
    package_file, page_file = out.split()
    assert Path(package_file) == REPO / "__init__.py"
    assert Path(page_file) == REPO / "tiers" / "page.py"
