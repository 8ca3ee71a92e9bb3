"""A burst of prompts on an engine with an L3 starts as one batch: each request's L3 read
runs off the step loop, and with nothing running the requests whose reads are done wait
for the others' (``EngineConfig.join_wait_s``, ``engine/l3_wait.py``); started apart,
mlx-lm's ``BatchGenerator`` pads a late request's first prefill chunk and the rest of
the others' prompts to one length."""

from __future__ import annotations

from kvtier.costmodel.models import ComputeModel
from kvtier.costmodel.plan import Profile
from kvtier.engine.engine import Engine, EngineConfig
from kvtier.engine.request import SamplingParams
from kvtier.tiers.hierarchy import StoreConfig

from .conftest import text_prompt

PAGE = 16
PARAMS = SamplingParams(max_tokens=2)


def test_requests_whose_reads_are_done_wait_for_a_slower_read_and_start_together(loaded, tmp_path):
    stored = text_prompt(loaded, 6 * PAGE + 5, seed=39)
    with Engine(loaded, EngineConfig(page_size=PAGE, store=StoreConfig(store_dir=tmp_path))) as first:
        first.generate([stored], PARAMS)  # closed: its pages are in L3 only
    read_s = 0.6
    slow = {"L3": 6 * loaded.geometry(PAGE).nbytes / read_s}  # its read takes 0.6 s, the others' none
    config = EngineConfig(page_size=PAGE, store=StoreConfig(store_dir=tmp_path, throttle=slow), join_wait_s=60)
    burst = [text_prompt(loaded, 6 * PAGE + 5, seed=40 + i) for i in range(4)] + [stored]
    with Engine(loaded, config) as engine:
        # recomputing priced at 0.02 s a token: the slow read is in time (its deadline is then)
        engine.profile = Profile(Profile.defaults().links, ComputeModel([0.0, 0.02, 0.0]))
        requests = engine.generate(burst, PARAMS)
    assert requests[-1].sources()["L3"] > 0 and requests[0].sources()["recomputed"] == len(burst[0])
    joined = [r.t_admit for r in requests]
    assert None not in joined
    # admitted in one step, after the slow read: not the fast ones first and it a read later
    assert max(joined) - min(joined) < read_s / 2, [t - min(joined) for t in joined]
