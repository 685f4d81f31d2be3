"""The `timm:<model>` workload, on timm's own tiny `test_*` models (random weights: nothing is downloaded).

The tests that need timm are skipped only where it is not installed; `make install` installs it, so they run in CI.
(`pytest.importorskip("timm")` would not do: beside a CPU torch, `import timm` raises RuntimeError, not ImportError,
until `workloads.timm_models.import_timm` works around it.)
"""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from bench.core.errors import UsageError
from strategies.checkpoint import UnitCheckpointer, segment_plan
from workloads import timm_models
from workloads.framework.loader import resolve_workload

needs_timm = pytest.mark.skipif(importlib.util.find_spec("timm") is None,
                                reason="timm is not installed (make install installs it)")

ROOT = Path(__file__).resolve().parent.parent
CHAINING_MODELS = ["test_resnet", "test_vit", "test_efficientnet", "test_convnext"]


pytestmark = pytest.mark.usefixtures("one_thread")


def train_step(workload, model, batch_size=2):
    """One forward, loss and backward on a fresh batch; the loss."""
    images, labels = workload.make_batch(batch_size, "synthetic")
    model.train()
    loss = workload.loss(workload.run_model(model, images).float(), labels)
    loss.backward()
    return loss


# --- with timm ---------------------------------------------------------------------------------------------

@needs_timm
def test_the_bare_part_names_the_model():
    workload = resolve_workload("timm:test_resnet")
    assert workload.settings == {"model": "test_resnet", "num_classes": 10, "img_size": 0}
    assert workload.spec() == "timm:test_resnet"
    assert workload.input_size() == (3, 160, 160)  # test_resnet's pretrained config
    assert workload.describe()["input_size"] == "3x160x160"
    assert resolve_workload("timm:test_vit:num_classes=3:img_size=64").settings["num_classes"] == 3


@needs_timm
@pytest.mark.parametrize("model_name", CHAINING_MODELS)
def test_a_training_step_has_finite_loss_and_gradients(model_name):
    workload = resolve_workload(f"timm:{model_name}")
    model = workload.build_model()
    loss = train_step(workload, model)
    assert torch.isfinite(loss)
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
    workload.make_optimizer(model).step()
    assert all(torch.isfinite(p).all() for p in model.parameters())


@needs_timm
def test_weights_and_batches_come_from_the_seed():
    workload = resolve_workload("timm:test_resnet")
    first, again = workload.build_model().state_dict(), workload.build_model().state_dict()
    assert all(torch.equal(first[k], again[k]) for k in first)
    (images, labels), (images_again, labels_again) = workload.make_batch(3, "synthetic"), workload.make_batch(3)
    assert torch.equal(images, images_again) and torch.equal(labels, labels_again)
    assert images.shape == (3, 3, 160, 160) and labels.dtype == torch.long and 0 <= labels.min() <= labels.max() < 10
    with pytest.raises(UsageError, match="data source"):
        workload.make_batch(3, "captcha")


@needs_timm
@pytest.mark.parametrize("model_name", ["test_resnet", "test_vit"])
def test_img_size_sets_the_batch_and_the_models_that_take_it(model_name):
    # test_vit takes img_size (its position embedding follows); test_resnet does not and takes any size
    workload = resolve_workload(f"timm:{model_name}:img_size=64")
    images, _ = workload.make_batch(2)
    assert images.shape == (2, 3, 64, 64)
    assert workload.build_model().eval()(images).shape == (2, 10)


@needs_timm
@pytest.mark.parametrize("model_name", CHAINING_MODELS)
def test_checkpoint_units_chain_from_the_trunks_input_to_its_output(model_name):
    workload = resolve_workload(f"timm:{model_name}")
    model = workload.build_model().eval()
    units = workload.checkpoint_units(model)
    assert len(units) >= 4 and workload.units_chain
    seen = {}
    units[0].register_forward_pre_hook(lambda module, args: seen.setdefault("input", args[0]))
    units[-1].register_forward_hook(lambda module, args, output: seen.setdefault("output", output))
    x, _ = workload.make_batch(1)
    with torch.no_grad():
        model(x)
        y = seen["input"]
        for unit in units:
            y = unit(y)
    torch.testing.assert_close(y, seen["output"], rtol=0, atol=0)


@needs_timm
def test_units_are_the_blocks_timm_names():
    workload = resolve_workload("timm:test_resnet")
    units = workload.checkpoint_units(workload.build_model())
    assert len(units) == 4  # test_resnet: one block in each of layer1..layer4
    assert all(type(u).__name__ in ("BasicBlock", "Bottleneck") for u in units)
    vit = resolve_workload("timm:test_vit")
    assert [type(u).__name__ for u in vit.checkpoint_units(vit.build_model())] == ["Block"] * 6
    convnext = resolve_workload("timm:test_convnext")
    kinds = {type(u).__name__ for u in convnext.checkpoint_units(convnext.build_model())}
    assert "ConvNeXtBlock" in kinds and "ConvNeXtStage" not in kinds  # stages opened into their blocks


@needs_timm
def test_units_that_do_not_chain_are_checkpointed_one_by_one():
    # test_vit_relpos calls its blocks with a shared relative-position bias as a keyword argument
    workload = resolve_workload("timm:test_vit_relpos")
    units = workload.checkpoint_units(workload.build_model())
    assert len(units) >= 2 and workload.units_chain is False
    assert resolve_workload("timm:test_vit_relpos").units_chain is False  # another instance, as the runner makes


@needs_timm
def test_a_model_without_numbers_gets_the_units_a_real_one_gets(monkeypatch):
    """On the meta device (predict's engines; fake tensors alike) the chain check has no numbers to compare, and
    used to fall back to test_convnext's 4 stages, not chaining: the plan is made on a real CPU copy instead."""
    workload = resolve_workload("timm:test_convnext")

    def planned_units(model):
        monkeypatch.setattr(timm_models, "_unit_plans", {})
        names = {id(module): name for name, module in model.named_modules()}
        return [names[id(unit)] for unit in workload.checkpoint_units(model)], workload.units_chain

    on_cpu = planned_units(workload.build_model())
    with torch.device("meta"):
        meta_model = workload.build_model()
    random_state = torch.get_rng_state()
    assert planned_units(meta_model) == on_cpu and len(on_cpu[0]) == 16 and on_cpu[1]
    assert torch.equal(torch.get_rng_state(), random_state)


@needs_timm
@pytest.mark.parametrize("model_name", ["test_convnext", "test_vit_relpos"])
def test_checkpointing_the_units_leaves_loss_and_gradients_unchanged(model_name):
    workload = resolve_workload(f"timm:{model_name}")
    plain, checkpointed = workload.build_model(), workload.build_model()
    units = workload.checkpoint_units(checkpointed)
    checkpointer = UnitCheckpointer(checkpointed)
    for group in segment_plan(len(units), 3, workload.units_chain):
        checkpointer.install([units[i] for i in group])
    torch.manual_seed(1)
    expected = train_step(workload, plain)
    torch.manual_seed(1)
    got = train_step(workload, checkpointed)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    for (name, a), b in zip(plain.named_parameters(), checkpointed.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=0, msg=name)


@needs_timm
def test_an_unknown_model_is_one_line_that_names_it_and_how_to_list_them():
    with pytest.raises(UsageError) as error:
        resolve_workload("timm:resnt18")
    message = str(error.value)
    assert "'resnt18'" in message and "timm.list_models('*resn*')" in message and "resnet18" in message
    assert "\n" not in message
    with pytest.raises(UsageError, match="'test_resnet.nope'"):  # a known model with an unknown pretrained tag
        resolve_workload("timm:test_resnet.nope")
    with pytest.raises(UsageError, match="num_classes must be at least 1"):
        resolve_workload("timm:test_resnet:num_classes=0")


# --- without timm ------------------------------------------------------------------------------------------

def test_without_timm_the_workload_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "timm", None)  # `import timm` now fails as if it were not installed
    with pytest.raises(UsageError) as error:
        resolve_workload("timm:resnet18")
    message = str(error.value)
    assert "pip install 'membench[timm]'" in message and "make install" in message and "\n" not in message


def test_the_module_imports_without_timm():
    code = ("import sys; sys.modules['timm'] = None; import workloads.timm_models; "
            "from workloads import WORKLOADS; assert 'timm' in WORKLOADS")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


class Skip(nn.Module):
    """Blocks whose first output also feeds the last: a UNet-like skip, so the blocks do not chain."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, x):
        first = self.blocks[0](x)
        return self.blocks[2](self.blocks[1](first)) + first


def test_blocks_whose_outputs_feed_elsewhere_do_not_chain():
    assert timm_models.plan_units(Skip(), (4,)) == (("blocks.0", "blocks.1", "blocks.2"), False)
    chain = nn.Sequential()
    chain.add_module("blocks", nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)))
    assert timm_models.plan_units(chain, (4,)) == (("blocks.0", "blocks.1", "blocks.2"), True)
    assert timm_models.plan_units(nn.Linear(4, 4), (4,)) == ((), False)  # nothing to checkpoint
