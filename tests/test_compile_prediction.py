"""Predicting a compiled step: under membench's dispatch modes torch.compile compiles for real
(`ignore_compile_internals`), and on fake tensors the compiled graphs run as they would on real ones. For
`compile:backend=aot_eager_decomp_partition` (inductor's partition on eager kernels) the prediction is the CPU's
measurement at the allocator; inductor is predicted from its own generated code
(strategies/framework/inductor_plan.py), each graph's wrapper read and replayed, and equals inductor's measurement on
the CPU."""

from __future__ import annotations

import functools
import json

import pytest

from bench.analysis.predict import predict_case
from bench.run.isolation import RunOptions
from bench.run.case import Case
from bench.run.runner import run_case
from strategies.compile import cpu_compiler
from strategies.framework.inductor_plan import wrapper_plan

WORKLOAD = "gpt_mini:layers=2:width=64:heads=2:seq_len=32:dropout=0.0"  # no dropout: compiled masks differ
PARTITION = "compile:backend=aot_eager_decomp_partition"
# what the CPU allocator sees beyond the tracked tensors: kernels' own small buffers (12 B in this step)
KERNEL_BUFFERS_BYTES = 64


def _case(spec: str) -> Case:
    return Case(WORKLOAD, spec, "train", 4, "cpu", data="synthetic", warmup=1, steps=1)


@functools.lru_cache(maxsize=None)
def _measured(spec: str) -> dict:
    row = run_case(_case(spec), env={}, options=RunOptions(threads=1))
    assert row["status"] == "ok" and row["memory_method"] == "cpu_allocator_events", row["message"]
    return row


@pytest.mark.parametrize("spec", [PARTITION, f"{PARTITION}:scope=layers", f"{PARTITION}:scope=layers:loss=true"])
def test_the_partitions_prediction_is_its_measurement(spec):
    predicted = predict_case(_case(spec), engine="fake")
    assert predicted["status"] == "ok" and predicted["engine"] == "fake", predicted["message"]
    assert "fusion" not in predicted["message"]  # what it runs is what was predicted
    measured = _measured(spec)["peak_mem_bytes"]
    assert 0 <= measured - predicted["predicted_bytes"] <= KERNEL_BUFFERS_BYTES, (measured, predicted)


def test_the_partition_changes_the_peak_the_eager_step_has():
    eager = predict_case(_case("baseline"), engine="fake")["predicted_bytes"]
    compiled = predict_case(_case(PARTITION), engine="fake")["predicted_bytes"]
    assert compiled != eager  # compiled, not run eagerly under the tracker (what dynamo does under a dispatch mode)


# inductor's wrappers for F.cross_entropy over (2048, 32000) float32 logits, as torch 2.13 generates them on the CPU
LOSS_FORWARD = """def call(self, args):
        primals_1, primals_2 = args
        args.clear()
        buf0 = empty_strided_cpu((2048, 1), (1, 1), torch.float32)
        buf1 = empty_strided_cpu((2048, 1), (1, 2048), torch.float32)
        buf2 = reinterpret_tensor(buf1, (2048, 1), (1, 1), 0); del buf1  # reuse
        buf3 = empty_strided_cpu((), (), torch.int64)
        buf5 = empty_strided_cpu((), (), torch.float32)
        buf4 = empty_strided_cpu((), (), torch.float32)
        buf6 = buf5; del buf5  # reuse
        cpp_fused__log_softmax_nll_loss_forward_view_0(buf2, buf6, primals_1, primals_2, buf0, buf3, buf4)
        return (buf6, primals_1, primals_2, buf0, buf2, buf4, )
"""
LOSS_BACKWARD = """def call(self, args):
        primals_1, primals_2, amax, log, convert_element_type, tangents_1 = args
        args.clear()
        buf0 = empty_strided_cpu((2048, 1), (1, 2048), torch.float32)
        buf1 = empty_strided_cpu((2048, 32000), (32000, 1), torch.float32)
        cpp_fused__log_softmax_backward_data_nll_loss_backward_0(primals_2, tangents_1, primals_1, amax, log, buf0, buf1)
        del amax
        del buf0
        del primals_1
        return (reinterpret_tensor(buf1, (4, 512, 32000), (16384000, 32000, 1), 0), None, )
"""


def test_a_wrappers_buffers_hand_overs_frees_and_returns_are_read_in_order():
    forward = wrapper_plan(LOSS_FORWARD)
    assert forward.events == (("alloc", "buf0", 8192), ("alloc", "buf1", 8192), ("alloc", "buf3", 8),
                              ("alloc", "buf5", 4), ("alloc", "buf4", 4))
    assert forward.returned == {"buf0", "buf1", "buf4", "buf5"}  # buf2 is buf1, buf6 is buf5; buf3 is freed after
    backward = wrapper_plan(LOSS_BACKWARD)
    assert backward.events == (("alloc", "buf0", 8192), ("alloc", "buf1", 2048 * 32000 * 4), ("release", 2, 0),
                               ("free", "buf0", 8192), ("release", 0, 0))
    assert backward.returned == {"buf1"}


def test_a_wrapper_with_a_buffer_a_kernel_allocates_has_no_plan():
    attention = LOSS_FORWARD.replace(
        "        cpp_fused", "        buf9 = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(buf0)\n"
                            "        cpp_fused")
    assert wrapper_plan(attention) is None


@pytest.mark.skipif(cpu_compiler() is None, reason="inductor's vector-ISA check on the CPU needs a C++ compiler")
def test_inductors_wrapper_is_read_without_compiling_its_kernels(monkeypatch):
    """Inductor stops once it has written a graph's wrapper: the module it would load next (which compiles each C++
    kernel, a precompiled header of 150 MB first: 10 s of a cold 8B prediction) is never loaded."""
    import torch
    from torch._inductor.codecache import PyCodeCache
    from torch.fx.experimental.proxy_tensor import make_fx

    from strategies.framework.inductor_plan import wrapper_code

    def never(*args, **kwargs):
        raise AssertionError("inductor loaded its generated module (and compiled its kernels)")

    monkeypatch.setattr(PyCodeCache, "load_by_key_path", never)
    inputs = [torch.ones(8, 16), torch.ones(16, 4)]
    graph = make_fx(lambda x, y: ((x @ y).relu() * 2,))(*inputs)  # in ATen's operators, as AOTAutograd hands it
    code = wrapper_code(graph, inputs)
    plan = wrapper_plan(code)
    assert plan is not None and ("alloc", "buf0", 8 * 4 * 4) in plan.events and plan.returned, code


# a Llama without dropout whose step's peak is the loss (32,000 words, 4 x 512 tokens): where inductor's fused
# cross-entropy matters
SMALL_LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 32000, "hidden_size": 256,
               "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "hidden_act": "silu", "max_position_embeddings": 1024, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
               "tie_word_embeddings": False, "attention_dropout": 0.0}


@pytest.mark.slow
@pytest.mark.skipif(cpu_compiler() is None, reason="inductor on the CPU needs a C++ compiler")
def test_inductor_is_predicted_from_its_generated_code_as_it_measures(tmp_path):
    """Each decoder layer and the loss compiled (torchtune's way): the measured peak at the CPU allocator, and the
    prediction from inductor's wrappers, equal to the byte; its partition on eager kernels is 59% above (the
    compiled cross-entropy's backward makes one logits-sized buffer, eager kernels several)."""
    config = tmp_path / "llama.json"
    config.write_text(json.dumps(SMALL_LLAMA))
    case = Case(f"hf:{config}:seq_len=512", "compile:scope=layers:loss=true", "train", 4, "cpu", data="synthetic",
                warmup=1, steps=1)
    predicted = predict_case(case, engine="fake")
    assert predicted["status"] == "ok" and "generated code" in predicted["message"], predicted["message"]
    measured = run_case(case, env={}, options=RunOptions(threads=1))
    assert measured["status"] == "ok" and measured["memory_method"] == "cpu_allocator_events", measured["message"]
    assert predicted["predicted_bytes"] == measured["peak_mem_bytes"], (predicted["predicted_bytes"], measured)
    partition = predict_case(Case(case.workload, f"{PARTITION}:scope=layers:loss=true", "train", 4, "cpu",
                                  data="synthetic"), engine="fake")
    assert partition["predicted_bytes"] > 1.2 * measured["peak_mem_bytes"]
