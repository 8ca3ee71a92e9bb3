"""Calibration: its timed forward passes really compute (mlx is lazy); the quick grid
fits its time budget."""

import mlx.core as mx

import kvtier.costmodel.calibrate as calibrate
from kvtier.engine.models.load import load_model
from kvtier.tiers.page import GLOBAL, LayerKind, PageGeometry

from ..engine.kind_models import write_model
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


def test_a_hybrid_models_links_are_also_timed_with_its_snapshots(tmp_path):
    """A snapshot (here 64 KiB, sixteen times a page) is restored from L2 and from L3 in
    calibration: the links' samples reach its size, which the snapshot spacing prices."""
    state = LayerKind("state", arrays=(("float32", (1, 128, 128)),))
    geometry = PageGeometry(1, 1, 16, 16, "float32", (state, GLOBAL))  # 4 KiB pages, 64 KiB snapshots
    ticks = []
    samples = calibrate.snapshot_samples(geometry, tmp_path, lambda: ticks.append(1), repeats=1)
    assert [(link, nbytes) for link, nbytes, _ in samples][0] == ("L2->L1", geometry.snapshot_nbytes)
    (link, read, seconds) = samples[1]
    assert link == "L3->L1" and geometry.snapshot_nbytes < read < geometry.snapshot_nbytes + 4096  # and its header
    assert seconds > 0 and len(ticks) == 2
    assert calibrate.snapshot_samples(PageGeometry(1, 1, 16, 16, "float32"), tmp_path, lambda: None) == []


def test_the_calibration_of_a_hybrid_model_samples_its_snapshot_size(tmp_path):
    loaded = load_model(str(write_model(tmp_path / "lfm2", "lfm2")))
    geometry = loaded.geometry(16)
    ticks = []
    profile = calibrate.calibrate(loaded.model, geometry, tmp_path / "store", lambda: ticks.append(1), quick=True)
    assert len(ticks) == calibrate.steps(quick=True, snapshots=True) == calibrate.steps(quick=True) + 2
    for name in ("L2->L1", "L3->L1"):
        sizes = [nbytes for nbytes, _ in profile.links[name].samples]
        assert len(sizes) == len(calibrate.QUICK_PAGE_COUNTS) + 1
        assert min(abs(n - geometry.snapshot_nbytes) for n in sizes) < 4096, (name, sizes)
