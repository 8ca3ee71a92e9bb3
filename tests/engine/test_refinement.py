"""Online refinement learns only from what it can read cleanly: a throttled link times
the throttle's sleep, and a batched step's time is shared by its requests."""

from kvtier.costmodel.models import LinkModel
from kvtier.costmodel.plan import Profile
from kvtier.engine.engine import Engine, EngineConfig
from kvtier.engine.request import SamplingParams
from kvtier.tiers.hierarchy import StoreConfig

from .conftest import text_prompt

PAGE = 64
GREEDY = SamplingParams(max_tokens=4)


def engine_for(loaded, store_dir=None, throttle=None, step=2048) -> Engine:
    store = StoreConfig(
        l1_bytes=1 << 30, l2_bytes=1 << 30, l3_bytes=1 << 30, store_dir=store_dir, throttle=throttle or {}
    )
    return Engine(loaded, EngineConfig(page_size=PAGE, store=store, prefill_step_size=step))


def test_a_throttled_link_is_not_refined_from_its_restores(loaded, tmp_path):
    prompt = text_prompt(loaded, 4 * PAGE + 3, seed=41)
    first = engine_for(loaded, tmp_path)
    first.generate([prompt], GREEDY)
    first.close()
    engine = engine_for(loaded, tmp_path, throttle={"L3": 1 << 30})
    engine.profile = Profile(
        {**Profile.defaults().links, "L3->L1": LinkModel.of(0.0, 1 << 40)}, Profile.defaults().compute
    )  # restoring always wins
    samples = len(engine.profile.links["L3->L1"].samples)
    (request,) = engine.generate([prompt], GREEDY)
    engine.close()
    assert request.sources()["L3"] == 4 * PAGE, "the pages must have crossed the throttled link"
    assert len(engine.profile.links["L3->L1"].samples) == samples


def test_the_unthrottled_link_is_refined_from_the_same_restore(loaded, tmp_path):
    """The control for the test above: without the throttle the same restore is a sample."""
    prompt = text_prompt(loaded, 4 * PAGE + 3, seed=41)
    first = engine_for(loaded, tmp_path)
    first.generate([prompt], GREEDY)
    first.close()
    engine = engine_for(loaded, tmp_path)
    engine.profile = Profile(
        {**Profile.defaults().links, "L3->L1": LinkModel.of(0.0, 1 << 40)}, Profile.defaults().compute
    )
    samples = len(engine.profile.links["L3->L1"].samples)
    (request,) = engine.generate([prompt], GREEDY)
    engine.close()
    assert request.sources()["L3"] == 4 * PAGE
    assert len(engine.profile.links["L3->L1"].samples) == samples + 1


def test_prefill_is_refined_only_from_steps_that_ran_one_request(loaded):
    engine = engine_for(loaded, step=PAGE)
    alone = len(engine.profile.compute.samples)
    engine.generate([text_prompt(loaded, 4 * PAGE + 1, seed=1)], GREEDY)
    after_alone = len(engine.profile.compute.samples)
    assert after_alone > alone, "a request prefilling alone is a clean sample"
    together = [text_prompt(loaded, 4 * PAGE + 1, seed=s) for s in (2, 3)]
    engine.generate(together, GREEDY)  # every prefill step batches both requests
    assert len(engine.profile.compute.samples) == after_alone


def test_a_prefill_is_refitted_on_after_the_requests_first_token(loaded):
    """A refit takes milliseconds: the engine refits after the request's first token,
    not between its prefill and that token (where it would add to its TTFT)."""
    engine = engine_for(loaded, step=PAGE)
    compute = engine.profile.compute
    for n, p in [(64, 0), (128, 0), (64, 128), (256, 64), (32, 512)]:  # one distinct input short of a fit
        compute.observe(n, p, seconds=1e-3 + 1e-4 * n + 1e-9 * n * (p + n / 2))
    unfitted, samples = list(compute.coef), len(compute.samples)
    request = engine.submit(text_prompt(loaded, 4 * PAGE + 1, seed=5), GREEDY)
    while request.t_first_token is None:
        assert compute.coef == unfitted, "refitted before the request's first token"
        engine.step()
    assert len(compute.samples) > samples, "its prefill steps were samples"
    assert compute.coef != unfitted, "refitted in the step that gave the first token"
    engine.run()
    engine.close()
