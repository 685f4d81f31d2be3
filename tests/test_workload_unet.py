"""The UNet of the memory-saving article and its captcha masks: options, real data, gradients, blocks checkpointable
alone."""

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from bench.core.errors import UsageError
from workloads.framework import unet_data
from workloads.framework.loader import resolve_workload
from workloads.unet import DecoderBlock, EncoderBlock

SMALL = "unet:depth=2:base_channels=4"  # at the default 128x48 images
BATCH = 4


def test_defaults():
    workload = resolve_workload("unet")
    assert workload.settings == {"depth": 4, "base_channels": 16, "image_size": "128x48", "release_skips": False}
    assert (workload.image_width, workload.image_height) == (128, 48)
    assert workload.data_sources[0] == "captcha" and not workload.units_chain
    model = workload.build_model()
    assert sum(p.numel() for p in model.parameters()) == 1_942_577  # the figure the module's docstring quotes


def test_options_set_the_shape():
    workload = resolve_workload("unet:depth=3:base_channels=2:image_size=64x24")
    model = workload.build_model()
    assert len(model.encoders) == 4 and len(model.decoders) == 3
    assert model.encoders[-1].conv[0].out_channels == 2 * 2**3
    x, y = workload.make_batch(2, "synthetic")
    assert x.shape == (2, 3, 24, 64) and y.shape == (2, 1, 24, 64)
    assert model(x).shape == (2, 1, 24, 64)


@pytest.mark.parametrize("spec", ["unet:depth=x", "unet:depth=0", "unet:base_channels=0", "unet:image_size=128",
                                  "unet:image_size=100x48", "unet:depth=5", "unet:image_size=0x0", "unet:size=4"])
def test_bad_options_are_usage_errors(spec):
    with pytest.raises(UsageError):
        resolve_workload(spec)


@pytest.mark.parametrize("data", ["captcha", "synthetic"])
def test_batches_are_shaped_and_deterministic(data):
    workload = resolve_workload(SMALL)
    x, y = workload.make_batch(BATCH, data)
    again = workload.make_batch(BATCH, data)
    assert x.shape == (BATCH, 3, 48, 128) and y.shape == (BATCH, 1, 48, 128)
    assert x.dtype == y.dtype == torch.float32 and 0 <= x.min() and x.max() <= 1
    assert torch.equal(x, again[0]) and torch.equal(y, again[1])
    assert set(y.unique().tolist()) == {0.0, 1.0}
    with pytest.raises(UsageError):
        workload.make_batch(BATCH, "imagenet")


def test_captcha_generation_is_deterministic_from_the_seed():
    images, masks, codes = unet_data.generate(3, seed=5, width=64, height=32)
    again, masks_again, codes_again = unet_data.generate(3, seed=5, width=64, height=32)
    assert torch.equal(images, again) and torch.equal(masks, masks_again) and codes == codes_again
    other, _, _ = unet_data.generate(3, seed=6, width=64, height=32)
    assert not torch.equal(images, other)


def test_captcha_masks_cover_the_glyphs():
    images, masks = resolve_workload(SMALL).make_batch(8, "captcha")
    coverage = masks.mean(dim=(1, 2, 3))
    assert (coverage > 0.05).all() and (coverage < 0.5).all()  # 4 characters, not the whole image
    # Background colours are 238..255 per channel, character colours 10..200: glyph pixels are dark.
    dark = (images.min(dim=1, keepdim=True).values < 0.85).float()
    assert (dark * masks).sum() / masks.sum() > 0.9
    # Noise dots, the noise curve and the smoothing halo are dark too, but cover far less of the background.
    assert (dark * (1 - masks)).sum() / (1 - masks).sum() < 0.3

    def agreement(mask):
        return (dark == mask).float().mean()
    assert agreement(masks) > agreement(masks.roll(1, dims=0)) + 0.2  # another captcha's mask: chance level


def test_captcha_data_is_cached_on_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMBENCH_CACHE", str(tmp_path))
    first = unet_data.load(2, seed=0, width=64, height=32)
    assert [p.name for p in tmp_path.glob("*.pt")] == ["unet-captcha-v1-64x32-seed0-n2.pt"]
    second = unet_data.load(2, seed=0, width=64, height=32)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])


def test_same_seed_same_weights():
    workload = resolve_workload(SMALL)
    a, b = workload.build_model().state_dict(), workload.build_model().state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_loss_and_gradients_are_finite_and_reach_every_parameter():
    workload = resolve_workload(SMALL)
    model = workload.build_model()
    x, y = workload.make_batch(BATCH, "captcha")
    loss = workload.loss(model(x).float(), y)
    loss.backward()
    assert torch.isfinite(loss) and 0.3 < loss < 2  # near log 2 for an untrained logit
    for name, param in model.named_parameters():
        assert torch.isfinite(param.grad).all() and param.grad.abs().sum() > 0, name


def test_checkpoint_units_are_the_blocks_in_call_order():
    workload = resolve_workload(SMALL)
    model = workload.build_model()
    units = workload.checkpoint_units(model)
    assert len(units) == 2 * 2 + 1
    assert [type(u) for u in units] == [EncoderBlock] * 3 + [DecoderBlock] * 2
    called = []
    for unit in units:
        unit.register_forward_hook(lambda module, args, out: called.append(module))
    model(workload.make_batch(2, "synthetic")[0])
    assert called == units
    assert sum(isinstance(m, nn.ReLU) for m in model.modules()) == 2 * len(units)


def _loss_and_grads(model, workload, x, y):
    loss = workload.loss(model(x), y)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def test_inplace_relus_and_each_unit_checkpointed_alone_change_nothing():
    # No block writes over its input, so the skip tensors survive in-place ReLUs and per-block recomputation.
    workload = resolve_workload(SMALL)
    x, y = workload.make_batch(2, "captcha")
    expected = _loss_and_grads(workload.build_model(), workload, x, y)
    model = workload.build_model()
    for module in model.modules():
        if isinstance(module, nn.ReLU):
            module.inplace = True
    for unit in workload.checkpoint_units(model):
        unit.forward = lambda *args, _forward=unit.forward: checkpoint(_forward, *args, use_reentrant=False)
    loss, grads = _loss_and_grads(model, workload, x, y)
    torch.testing.assert_close(loss, expected[0])
    for grad, grad_expected in zip(grads, expected[1]):
        torch.testing.assert_close(grad, grad_expected)


def test_release_skips_gives_the_same_output():
    x, _ = resolve_workload(SMALL).make_batch(2, "synthetic")
    kept = resolve_workload(SMALL).build_model()
    released = resolve_workload(SMALL + ":release_skips=true").build_model()
    assert released.release_skips and not kept.release_skips
    assert torch.equal(kept(x), released(x))
