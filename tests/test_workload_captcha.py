"""The captcha ResNet-18 and its data, as the article defines them."""

import torch

from workloads import get_workload

from workloads.framework import captcha_data
from workloads.captcha_resnet18 import BasicBlock, CaptchaResNet18


def test_parameter_count_is_the_articles_resnet18():
    # ResNet-18 body with a 3x3 stem (1,728 weights instead of 9,408) and a 512 -> 144 linear head.
    model = get_workload("captcha_resnet18").build_model()
    assert sum(p.numel() for p in model.parameters()) == 11_242_704
    assert sum(1 for m in model.modules() if isinstance(m, BasicBlock)) == 8


def test_output_is_a_softmax_per_character():
    model = get_workload("captcha_resnet18").build_model().eval()
    out = model(torch.rand(5, 3, 56, 24))
    assert out.shape == (5, 144)
    torch.testing.assert_close(out.reshape(5, 4, 36).sum(-1), torch.ones(5, 4))


def test_stages_chain_to_the_same_output():
    model = get_workload("captcha_resnet18").build_model().eval()
    x = torch.rand(2, 3, 56, 24)
    y = x
    stages = model.stages()
    for stage in stages:
        y = stage(y)
    assert len(stages) == 10  # stem, 8 blocks, head
    assert torch.equal(y, model(x))
    # Stages share the model's parameters rather than copying them.
    assert {id(p) for s in stages for p in s.parameters()} <= {id(p) for p in model.parameters()}


def test_same_seed_gives_same_weights():
    w = get_workload("captcha_resnet18")
    a, b = w.build_model().state_dict(), w.build_model().state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    # The article's module names, so its saved state_dicts load.
    assert "layer4.1.conv2.0.weight" in a and "fc_model.weight" in a and "identity.0.weight" in "".join(a)


def test_captcha_data_is_deterministic_and_shaped_like_the_article():
    images, targets, codes = captcha_data.generate(6, seed=3)
    again, _, codes_again = captcha_data.generate(6, seed=3)
    assert torch.equal(images, again) and codes == codes_again
    other, _, _ = captcha_data.generate(6, seed=4)
    assert not torch.equal(images, other)
    assert images.shape == (6, 3, 56, 24) and images.dtype == torch.float32
    assert 0.0 <= images.min() and images.max() <= 1.0
    assert targets.shape == (6, 144) and torch.equal(targets.sum(1), torch.full((6,), 4.0))
    assert [captcha_data.tensor_to_code(t) for t in targets] == codes
    assert all(len(c) == 4 and set(c) <= set(captcha_data.ALPHA_NUMS) for c in codes)


def test_captcha_data_is_cached_on_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMBENCH_CACHE", str(tmp_path))
    first = captcha_data.load(3, seed=0)
    assert len(list(tmp_path.glob("*.pt"))) == 1
    second = captcha_data.load(3, seed=0)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])


def test_synthetic_batch_has_the_same_shapes():
    x, y = get_workload("captcha_resnet18").make_batch(7, "synthetic")
    assert x.shape == (7, 3, 56, 24) and y.shape == (7, 144)
    assert torch.equal(y.reshape(7, 4, 36).sum(-1), torch.ones(7, 4))
