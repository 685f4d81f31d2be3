"""The deep MLP of the memory-saving article: options, data, a gradient in every layer, and activations linear in
depth."""

import pytest
import torch
from torch import nn

from bench.core.errors import UsageError
from bench.measure.memory import LiveTensorTracker
from workloads.framework.loader import resolve_workload

SMALL = "deep_mlp:layers=50"


def test_defaults_are_the_articles_network():
    workload = resolve_workload("deep_mlp")
    assert workload.settings == {"layers": 1000, "width": 10}
    model = workload.build_model()
    assert isinstance(model, nn.Sequential) and len(model) == 1000
    assert all(type(layer) is nn.Linear and layer.in_features == layer.out_features == 10 for layer in model)
    assert sum(p.numel() for p in model.parameters()) == 110_000


def test_options_set_depth_and_width():
    workload = resolve_workload("deep_mlp:layers=5:width=3")
    model = workload.build_model()
    assert len(model) == 5 and model[0].weight.shape == (3, 3)
    assert workload.spec() == "deep_mlp:layers=5:width=3"
    x, y = workload.make_batch(4, "synthetic")
    assert x.shape == y.shape == (4, 3) and model(x).shape == (4, 3)


@pytest.mark.parametrize("spec", ["deep_mlp:layers=abc", "deep_mlp:layers=0", "deep_mlp:width=-1",
                                  "deep_mlp:depth=3", "deep_mlp:layers"])
def test_bad_options_are_usage_errors(spec):
    with pytest.raises(UsageError):
        resolve_workload(spec)


def test_only_synthetic_data():
    workload = resolve_workload(SMALL)
    with pytest.raises(UsageError):
        workload.make_batch(2, "captcha")


def test_same_seed_same_batch_and_weights():
    workload = resolve_workload(SMALL)
    x1, y1 = workload.make_batch(8, "synthetic")
    x2, y2 = workload.make_batch(8, "synthetic")
    assert torch.equal(x1, x2) and torch.equal(y1, y2) and not torch.equal(x1, y1)
    a, b = workload.build_model().state_dict(), workload.build_model().state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    workload.seed = 1
    assert not torch.equal(workload.make_batch(8, "synthetic")[0], x1)
    assert not torch.equal(workload.build_model().state_dict()["0.weight"], a["0.weight"])


def test_every_layer_gets_a_gradient_at_the_default_depth():
    # PyTorch's default init would leave 836 of the 1000 layers with exactly zero weight gradients.
    workload = resolve_workload("deep_mlp")
    model = workload.build_model()
    x, y = workload.make_batch(8, "synthetic")
    loss = workload.loss(model(x).float(), y)
    loss.backward()
    assert torch.isfinite(loss) and loss > 0
    grads = torch.stack([layer.weight.grad.norm() for layer in model])
    assert torch.isfinite(grads).all() and grads.min() > 0.1 * grads.max()
    assert all(layer.bias.grad.abs().sum() > 0 for layer in model)


def test_checkpoint_units_chain_to_the_models_output():
    workload = resolve_workload(SMALL)
    model = workload.build_model()
    units = workload.checkpoint_units(model)
    assert len(units) == 50 and workload.units_chain
    x, _ = workload.make_batch(4, "synthetic")
    out = x
    for unit in units:
        out = unit(out)
    assert torch.equal(out, model(x))


def _train_peak_bytes(layers: int, batch: int = 64) -> int:
    workload = resolve_workload(f"deep_mlp:layers={layers}")
    model = workload.build_model()
    x, y = workload.make_batch(batch, "synthetic")
    tracker = LiveTensorTracker()
    tracker.track(model.parameters(), "params")
    tracker.track([x, y], "batch")
    with tracker:
        tracker.stage = "forward"
        loss = workload.loss(model(x), y)
        tracker.stage = "backward"
        loss.backward()
    return tracker.peak_bytes


def test_live_tensor_peak_grows_linearly_with_depth():
    peaks = {layers: _train_peak_bytes(layers) for layers in (50, 100, 200)}
    assert peaks[200] - peaks[100] == 2 * (peaks[100] - peaks[50])
    # The peak comes as backward starts, before any gradient exists: each layer then holds its weight and bias
    # (110 floats) and the input it saved for backward (batch x width floats).
    assert (peaks[100] - peaks[50]) // 50 == (110 + 64 * 10) * 4
