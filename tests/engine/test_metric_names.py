"""One naming of every metric: ``kvtier stats --prometheus`` and the server's ``/metrics``
expose each series under the same name and type (counters end in ``_total``, gauges
do not), both parsed here with prometheus_client's own parser."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvtier.engine.engine import Engine, EngineConfig
from kvtier.engine.request import SamplingParams
from kvtier.engine.serve.app import KVTierServer, ServerConfig
from kvtier.tiers.hierarchy import StoreConfig

from .. import cli
from .conftest import text_prompt

pytestmark = pytest.mark.slow  # starts processes or loads the real model

PAGE = 16


def families(text: str) -> dict[str, tuple[str, set[str]]]:
    """Family name -> (type, the names of its samples), as a scraper reads them."""
    return {f.name: (f.type, {s.name for s in f.samples}) for f in text_string_to_metric_families(text)}


def test_cli_and_server_name_and_type_every_series_alike(loaded, tmp_path):
    store = StoreConfig(l1_bytes=1 << 30, l2_bytes=1 << 30, l3_bytes=1 << 30, store_dir=tmp_path)
    engine = Engine(loaded, EngineConfig(page_size=PAGE, store=store))
    prompt = text_prompt(loaded, 5 * PAGE + 3)
    engine.generate([prompt], SamplingParams(max_tokens=2))
    engine.generate([prompt], SamplingParams(max_tokens=2))  # pages hit in L1: every counter has moved
    served = families(KVTierServer(engine, ServerConfig("m")).metrics.render().decode())
    engine.close()
    done = cli.run(["stats", "--prometheus", "--store", str(tmp_path)])
    assert done.returncode == 0, done.stderr
    stored = families(done.stdout)

    # the store's only own series is the size of its file; everything else the server has too
    assert set(stored) - set(served) == {"kvtier_tier_file_bytes"}
    for name in stored.keys() & served.keys():
        assert stored[name] == served[name], name
    for name, (kind, samples) in {**served, **stored}.items():
        if kind == "counter":
            assert samples == {f"{name}_total", f"{name}_created"} or samples == {f"{name}_total"}, name
        elif kind == "gauge":
            assert samples == {name} and not name.endswith("_total"), name
    # the series the README greps for
    assert served["kvtier_prompt_tokens"][0] == stored["kvtier_prompt_tokens"][0] == "counter"
    assert served["kvtier_tier_pages"][0] == stored["kvtier_tier_pages"][0] == "gauge"
    assert served["kvtier_link_pages"][0] == "counter"
    assert served["kvtier_ttft_seconds"][0] == "histogram"
