"""Calibration: its timed forward passes really compute (mlx is lazy); the quick grid
fits its time budget."""

import mlx.core as mx

import kvtier.costmodel.calibrate as calibrate

from ..engine.tiny import tiny_model


def arrays(tree) -> list:
    if isinstance(tree, (list, tuple)):
        return [a for item in tree for a in arrays(item)]
    return [tree] if isinstance(tree, mx.array) else []


def test_every_forward_pass_of_calibration_is_evaluated(monkeypatch):
    """An output mlx never evaluates was never computed: the warm-up (and every timed
    pass) must be evaluated, or the first timed pass pays the kernels' warm-up."""
    outputs, evaluated, real_eval = [], set(), mx.eval

    class Recording:
        """The model, keeping every output it returns."""

        def __init__(self, model) -> None:
            self.model = model

        def __call__(self, *args, **kwargs):
            outputs.append(self.model(*args, **kwargs))
            return outputs[-1]

        def __getattr__(self, name):
            return getattr(self.model, name)

    def spy_eval(*args):
        evaluated.update(id(a) for a in arrays(args))
        real_eval(*args)

    monkeypatch.setattr(calibrate.mx, "eval", spy_eval)
    monkeypatch.setattr(calibrate, "REPEATS", 1)
    samples = calibrate.prefill_samples(
        Recording(tiny_model().model), tick=lambda: None, prefill_tokens=(4, 8), contexts=(0, 16)
    )
    assert len(samples) == 4 and len(outputs) == 1 + 1 + 4  # warm-up, one context, the samples
    assert [id(o) in evaluated for o in outputs] == [True] * len(outputs)


def test_the_quick_prefill_grid_shrinks_to_the_time_it_may_take():
    """On a slow BLAS the quick calibration's prompts are shorter, never more passes."""
    model = tiny_model().model
    longest = calibrate.quick_grid(model, budget_s=1e9)
    shortest = calibrate.quick_grid(model, budget_s=0.0)
    s, t = max(calibrate.QUICK_SCALES), min(calibrate.QUICK_SCALES)
    assert longest == ((s, 2 * s, 4 * s), (0, 4 * s))
    assert shortest == ((t, 2 * t, 4 * t), (0, 4 * t))


def test_the_quick_calibration_ticks_once_per_sample_and_fits(tmp_path):
    loaded = tiny_model()
    ticks = []
    profile = calibrate.calibrate(loaded.model, loaded.geometry(16), tmp_path, lambda: ticks.append(1), quick=True)
    assert len(ticks) == calibrate.steps(quick=True)
    assert profile.calibrated and len({(n, p) for n, p, _ in profile.compute.samples}) == 6  # as the fit needs
    for link in profile.links.values():
        assert len(link.samples) == len(calibrate.QUICK_PAGE_COUNTS)
    for model in (profile.compute, *profile.links.values()):
        assert model.plausible(model.coef)
