"""Calibration's timed forward passes really compute (mlx is lazy)."""

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
    monkeypatch.setattr(calibrate, "CONTEXTS", (0, 16))
    monkeypatch.setattr(calibrate, "PREFILL_TOKENS", (4, 8))
    monkeypatch.setattr(calibrate, "REPEATS", 1)
    samples = calibrate.prefill_samples(Recording(tiny_model().model), tick=lambda: None)
    assert len(samples) == 4 and len(outputs) == 1 + 1 + 4  # warm-up, one context, the samples
    assert [id(o) in evaluated for o in outputs] == [True] * len(outputs)
