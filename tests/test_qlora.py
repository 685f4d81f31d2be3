"""qlora (LoRA over torchao's 4-bit NF4 base weights), lora's targets (all-linear, attention and MLP at a rank), and
torchtune's pure bfloat16 (bf16_weights with a fused or foreach AdamW): exact byte counts on the CPU at tiny sizes.

The NF4 byte counts are derived by hand from torchao's layout (nf4_tensor.py): a weight of N values in a dtype of
s bytes, blocks of 64 and scaler blocks of 256 by default, holds N/2 bytes of 4-bit codes (two per uint8), N/64
int8 block scales, N/(64*256) scales of those in the dtype (256 of them when there is only one scaler block: the
view torchao keeps of its (1, 256) intermediate is already contiguous), one mean and the 16-level table in the dtype.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

from bench.core.errors import UsageError
from bench.measure.memory import LiveTensorTracker
from bench.run.runner import run_case, verify
from bench.run.session import Session
from strategies import parse_strategy
from small_cases import bound as _bound, measured as _memory, small_case as _case

needs_peft_and_torchao = pytest.mark.skipif(
    any(importlib.util.find_spec(name) is None for name in ("transformers", "peft", "torchao")),
    reason="transformers, peft or torchao not installed")
TINY_LLAMA = "hf:tiny-llama:seq_len=16"  # hidden 32, MLP 64, 4 heads of 8, 2 key/value heads, 2 layers
TINY_GPT2 = "hf:tiny-gpt2:seq_len=16"  # width 32, MLP 128, Conv1D layers (weights stored as (in, out))
QLORA_TINY = "qlora:scaler_block=8"  # tiny-llama's weights have 8 to 32 blocks of 64: too few for 256 per scale


def _tracked_bytes(tensors) -> int:
    tracker = LiveTensorTracker()
    tracker.track(tensors, "params")
    return tracker.live_bytes


# --- torchao's NF4 layout, counted by the live-tensor tracker -------------------------------------------------

@needs_peft_and_torchao
@pytest.mark.parametrize("shape,dtype,scaler_block,expected", [
    # 2 scaler blocks: 16384 codes + 512 block scales + (2 scales + mean + 16 levels) * 4
    ((256, 128), torch.float32, 256, 16384 + 512 + (2 + 1 + 16) * 4),
    # 1 scaler block: its scale's storage is the 256 entries torchao computed it from
    ((128, 128), torch.float32, 256, 8192 + 256 + (256 + 1 + 16) * 4),
    # bfloat16: 2 bytes per scale, mean and level
    ((2048, 512), torch.bfloat16, 256, 524288 + 16384 + (64 + 1 + 16) * 2),
    ((32, 32), torch.float32, 8, 512 + 16 + (2 + 1 + 16) * 4),
])
def test_nf4_weight_storage_is_counted_exactly(shape, dtype, scaler_block, expected):
    from strategies.qlora import nf4_module, nf4_weight_bytes

    weight = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)
    quantized = nf4_module().to_nf4(weight, 64, scaler_block)
    # the tracker sees the tensors inside the wrapper subclass, not its face's float bytes
    assert _tracked_bytes([nn.Parameter(quantized, requires_grad=False)]) == expected
    assert nf4_weight_bytes(weight.numel(), weight.element_size(), 64, scaler_block) == expected


# --- qlora ----------------------------------------------------------------------------------------------------

@needs_peft_and_torchao
def test_qlora_base_weights_are_nf4_and_count_their_bytes_exactly():
    case = _case(TINY_LLAMA, QLORA_TINY)
    session = Session(case, _bound(case))
    from strategies.qlora import FrozenNF4Linear

    quantized = [m for m in session.base_model.modules() if isinstance(m, FrozenNF4Linear)]
    assert len(quantized) == 14  # q, k, v, o, gate, up, down in 2 layers; not the embedding nor the head
    plain = [p for p in session.parameters() if not any(p is m.weight for m in quantized)]
    # per layer, blocks of 64, scaler blocks of 8, float32 (see the module's docstring):
    # q, o (32x32): 512 + 16 + (2+1+16)*4 = 604; k, v (16x32, one scaler block): 256 + 8 + (8+1+16)*4 = 364;
    # gate, up, down (64x32): 1024 + 32 + (4+1+16)*4 = 1140
    nf4_bytes = 2 * (2 * 604 + 2 * 364 + 3 * 1140)
    assert _tracked_bytes(session.parameters()) == nf4_bytes + 4 * sum(p.numel() for p in plain)
    # only the adapters train: rank 8 on every projection, r * (in + out) each
    trainable = [p for p in session.parameters() if p.requires_grad]
    assert sum(p.numel() for p in trainable) == 2 * 8 * (2 * 64 + 2 * 48 + 3 * 96)
    assert {id(p) for g in session.optimizer.param_groups for p in g["params"]} == {id(p) for p in trainable}


@needs_peft_and_torchao
def test_qlora_quantises_every_projection_of_the_layers_adapted_or_not():
    """torchtune's QLoRA (and bitsandbytes' 4-bit loading): a projection without an adapter is frozen NF4 too; the
    embedding and the output head, outside the decoder layers, are not."""
    from strategies.qlora import FrozenNF4Linear

    case = _case(TINY_LLAMA, f"{QLORA_TINY}:targets=q_proj/v_proj")
    strategy = _bound(case)
    model = Session(case, strategy).base_model
    nf4 = sorted({name.split(".")[-1] for name, m in model.named_modules() if isinstance(m, FrozenNF4Linear)})
    assert nf4 == ["base_layer", "down_proj", "gate_proj", "k_proj", "o_proj", "up_proj"]
    assert strategy.quantized == 14 and strategy.describe()["qlora.targets"] == "q_proj/v_proj"
    assert type(model.lm_head) is nn.Linear and model.lm_head.weight.dtype == torch.float32
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == 2 * 8 * (64 + 48)  # q, v adapters


@needs_peft_and_torchao
def test_qlora_row_differs_by_design_with_its_measured_difference():
    case = _case(TINY_LLAMA, QLORA_TINY)
    strategy = _bound(case)
    row = {**verify(case, strategy), "strategy_settings": strategy.describe()}
    assert row["matches_baseline"] is False and row["params_without_grad"] == 21, row  # 14 NF4, 5 norms, 2 others
    assert row["message"].startswith("does not match the baseline by design: QLoRA: the base weights of 14 layers "
                                     "(18,432 values) are stored in 4-bit NF4"), row["message"]
    # the rounding to 4 bits shows in the weights compared after the step (about 9% of their norm here)
    assert 0.03 < row["max_param_rel_diff"] < 0.3 and "weights after one step rel diff" in row["message"], row
    assert 0 < row["loss_rel_diff"] < 1e-2, row
    assert row["strategy_settings"]["qlora.targets"] == "q_proj/k_proj/v_proj/o_proj/gate_proj/up_proj/down_proj"
    assert row["strategy_settings"]["qlora.nf4_weights"] == 14


@needs_peft_and_torchao
def test_qlora_conv1d_layer_computes_with_the_dequantised_weight():
    """GPT-2's Conv1D stores its weight as (in, out): qlora's layer computes x @ W with torchao's dequantisation,
    in forward and in backward, and keeps the weight's name (verification compares it with the baseline's)."""
    case = _case(TINY_GPT2, QLORA_TINY)
    session = Session(case, _bound(case))
    layer = session.base_model.transformer.h[0].attn.c_attn.base_layer
    assert layer.transposed and tuple(layer.weight.shape) == (32, 96)
    x = torch.randn(3, 32, requires_grad=True)
    dense = layer.weight.get_original_weight()
    out = layer(x)
    torch.testing.assert_close(out, x @ dense + layer.bias)
    out.sum().backward()
    torch.testing.assert_close(x.grad, torch.ones(3, 96) @ dense.t())
    names = [n for n, _ in session.base_model.named_parameters()]
    assert "transformer.h.0.attn.c_attn.base_layer.weight" in names


@needs_peft_and_torchao
def test_qlora_peak_is_below_lora_s_on_the_same_targets():
    lora = _memory(TINY_LLAMA, "lora:targets=all-linear")
    qlora = _memory(TINY_LLAMA, QLORA_TINY)
    assert qlora["peak_mem_bytes"] < lora["peak_mem_bytes"], (qlora, lora)
    # 18,432 float32 values (73,728 bytes) become 10,712 bytes of NF4
    assert lora["peak_params_bytes"] - qlora["peak_params_bytes"] == 73728 - 10712, (qlora, lora)


@needs_peft_and_torchao
def test_qlora_says_which_weight_torchao_cannot_quantise_and_checks_its_options():
    row = run_case(_case(TINY_LLAMA, "qlora"), env={})  # 1,024 values: not a multiple of 64*256
    assert row["status"] == "unsupported", row
    assert "qlora cannot quantise model.layers.0.self_attn.q_proj" in row["message"], row["message"]
    assert "block*scaler_block = 64*256" in row["message"], row["message"]
    row = run_case(_case("deep_mlp:layers=2:width=16", "qlora"), env={})
    assert row["status"] == "unsupported" and "is not an hf: architecture" in row["message"], row
    with pytest.raises(UsageError, match="qlora:block=63 must be a positive even number"):
        parse_strategy("qlora:block=63").build()
    with pytest.raises(UsageError, match="conflicts|lora"):
        parse_strategy("qlora+lora").build()


@needs_peft_and_torchao
def test_qlora_fake_engine_predicts_the_cpu_count_to_the_byte():
    """torchao's quantisation runs on fake weights: the NF4 tensors' inner tensors have the CPU's shapes."""
    from bench.analysis.predict import tracked_step

    spec = f"{QLORA_TINY}+checkpoint"
    case = _case(TINY_LLAMA, spec)
    assert tracked_step(case, spec, "fake").peak_bytes == tracked_step(case, spec, "cpu").peak_bytes


# --- lora: targets and rank -----------------------------------------------------------------------------------

@needs_peft_and_torchao
def test_lora_adapts_attention_and_mlp_projections_at_a_rank():
    spec = "lora:r=4:targets=q_proj/k_proj/v_proj/o_proj/gate_proj/up_proj/down_proj"
    case = _case(TINY_LLAMA, spec)
    strategy = _bound(case)
    session = Session(case, strategy)
    # r * (in + out): q, o 4*(32+32); k, v 4*(32+16); gate, up, down 4*(32+64); two layers
    assert strategy.trainable == 2 * 4 * (2 * 64 + 2 * 48 + 3 * 96) == 4096
    assert sum(p.numel() for p in session.parameters() if p.requires_grad) == 4096
    # the preset adapts the same modules, and not the output head
    preset = _bound(_case(TINY_LLAMA, "lora:r=4:targets=all-linear"))
    Session(_case(TINY_LLAMA, "lora:r=4:targets=all-linear"), preset)
    assert preset.describe()["lora.targets"] == strategy.describe()["lora.targets"] == spec.split("targets=")[1]
    gpt2 = _bound(_case(TINY_GPT2, "lora:targets=all-linear"))
    Session(_case(TINY_GPT2, "lora:targets=all-linear"), gpt2)
    assert gpt2.describe()["lora.targets"] == "c_attn/c_proj/c_fc"


# --- pure bfloat16 as torchtune trains: bf16 weights, gradients and AdamW state, fused or foreach ---------------

@needs_peft_and_torchao
@pytest.mark.parametrize("impl", ["fused", "foreach"])
def test_pure_bf16_adamw_state_is_two_bfloat16_moments_per_parameter(impl):
    case = _case(TINY_GPT2, f"bf16_weights+optimizer:impl={impl}", batch=1)
    strategy = _bound(case)
    session = Session(case, strategy)
    session.forward_backward()
    params = session.parameters()
    assert all(p.dtype == torch.bfloat16 and p.grad.dtype == torch.bfloat16 for p in params)
    session.optimizer.step()
    assert strategy.describe()["optimizer.impl"] == impl
    # exp_avg and exp_avg_sq: 2 x 2 bytes per parameter; and one float32 step count per tensor (on the CPU)
    numel = sum(p.numel() for p in params)
    assert _tracked_bytes(session.optimizer_state()) == 2 * 2 * numel + 4 * len(params)
    measured = _memory(TINY_GPT2, f"bf16_weights+optimizer:impl={impl}", batch=1)
    assert measured["peak_optimizer_bytes"] == 2 * 2 * numel + 4 * len(params)
    assert measured["peak_params_bytes"] == 2 * numel
