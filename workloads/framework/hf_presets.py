"""The `hf:<preset>` models: the published configuration numbers of well-known Hugging Face models, as data.

Each preset is the part of the model's published `config.json` that decides its shapes and its training step
(sizes, heads, vocabulary, positions, dropout, normalisation, rotary embedding, weight tying), copied as facts
from the file named beside it on the Hugging Face Hub (read for this table, never downloaded by membench). Fields
that only matter for inference or tokenization (generation settings, `torch_dtype`: membench trains in float32
unless a strategy says otherwise) are left out. `PUBLISHED_PARAMETERS` gives each model's parameter count as
its model card or paper states it; tests/test_workload_hf.py checks that the built model has exactly that many.

The `tiny-*` presets are not published models: they are membench's own small shapes of the same architectures,
for tests and quick runs on a CPU (like timm's `test_*` models).
"""

from __future__ import annotations

from typing import Any


# what Llama 3.1's 8B and 70B config.json files share (https://huggingface.co/meta-llama/Llama-3.1-8B and -70B)
_LLAMA_3_1 = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "num_key_value_heads": 8,
    "hidden_act": "silu", "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False, "tie_word_embeddings": False,
    "initializer_range": 0.02, "bos_token_id": 128000, "eos_token_id": 128001,
}


PRESETS: dict[str, dict[str, Any]] = {
    # https://huggingface.co/openai-community/gpt2/blob/main/config.json
    "gpt2": {
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
        "vocab_size": 50257, "n_positions": 1024, "n_ctx": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12,
        "activation_function": "gelu_new", "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1,
        "layer_norm_epsilon": 1e-05, "initializer_range": 0.02, "bos_token_id": 50256, "eos_token_id": 50256,
    },
    # https://huggingface.co/google-bert/bert-base-uncased/blob/main/config.json
    "bert-base-uncased": {
        "model_type": "bert", "architectures": ["BertForMaskedLM"],
        "vocab_size": 30522, "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
        "intermediate_size": 3072, "hidden_act": "gelu", "hidden_dropout_prob": 0.1,
        "attention_probs_dropout_prob": 0.1, "max_position_embeddings": 512, "type_vocab_size": 2,
        "initializer_range": 0.02, "layer_norm_eps": 1e-12, "pad_token_id": 0,
    },
    # https://huggingface.co/meta-llama/Llama-3.2-1B/blob/main/config.json
    "llama-3.2-1b": {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"],
        "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "hidden_act": "silu",
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False, "tie_word_embeddings": True,
        "initializer_range": 0.02, "bos_token_id": 128000, "eos_token_id": 128001,
    },
    # https://huggingface.co/meta-llama/Llama-3.1-8B/blob/main/config.json
    "llama-3.1-8b": {**_LLAMA_3_1, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                     "num_attention_heads": 32},
    # https://huggingface.co/meta-llama/Llama-3.1-70B/blob/main/config.json
    "llama-3.1-70b": {**_LLAMA_3_1, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                      "num_attention_heads": 64},
    # https://huggingface.co/meta-llama/Llama-3.1-405B/blob/main/config.json (the same shapes as torchtitan's llama3
    # 405B flavour: dim 16384, 126 layers, 128 heads, 8 kv heads, ffn 1.2 x 8/3 x 16384 rounded up to 4096s = 53248)
    "llama-3.1-405b": {**_LLAMA_3_1, "hidden_size": 16384, "intermediate_size": 53248, "num_hidden_layers": 126,
                       "num_attention_heads": 128},
    # Mistral 7B v0.1, the release the paper describes (v0.3 has a 32,768-token vocabulary and no sliding window):
    # https://huggingface.co/mistralai/Mistral-7B-v0.1/blob/main/config.json
    "mistral-7b": {
        "model_type": "mistral", "architectures": ["MistralForCausalLM"],
        "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_act": "silu",
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096,
        "tie_word_embeddings": False, "initializer_range": 0.02, "bos_token_id": 1, "eos_token_id": 2,
    },
    # https://huggingface.co/Qwen/Qwen2.5-7B/blob/main/config.json (the base model; Qwen2 has biases on q, k, v)
    "qwen2.5-7b": {
        "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"],
        "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
        "num_attention_heads": 28, "num_key_value_heads": 4, "hidden_act": "silu",
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
        "sliding_window": 131072, "use_sliding_window": False, "max_window_layers": 28, "attention_dropout": 0.0,
        "tie_word_embeddings": False, "initializer_range": 0.02, "bos_token_id": 151643, "eos_token_id": 151643,
    },
    # https://huggingface.co/Qwen/Qwen2.5-72B/blob/main/config.json (the base model)
    "qwen2.5-72b": {
        "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"],
        "vocab_size": 152064, "hidden_size": 8192, "intermediate_size": 29568, "num_hidden_layers": 80,
        "num_attention_heads": 64, "num_key_value_heads": 8, "hidden_act": "silu",
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
        "sliding_window": 131072, "use_sliding_window": False, "max_window_layers": 80, "attention_dropout": 0.0,
        "tie_word_embeddings": False, "initializer_range": 0.02, "bos_token_id": 151643, "eos_token_id": 151643,
    },
    # Mixture-of-experts decoders (workloads.framework.hf_moe: how their tokens reach the experts)
    # https://huggingface.co/mistralai/Mixtral-8x7B-v0.1/blob/main/config.json (sliding_window null: full attention)
    "mixtral-8x7b": {
        "model_type": "mixtral", "architectures": ["MixtralForCausalLM"],
        "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
        "hidden_act": "silu", "max_position_embeddings": 32768, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
        "sliding_window": None, "attention_dropout": 0.0, "output_router_logits": False,
        "router_aux_loss_coef": 0.02, "tie_word_embeddings": False, "initializer_range": 0.02, "bos_token_id": 1,
        "eos_token_id": 2,
    },
    # https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json (128 experts of 768, 8 per token, every layer)
    "qwen3-30b-a3b": {
        "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
        "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
        "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "norm_topk_prob": True, "hidden_act": "silu", "max_position_embeddings": 40960, "max_window_layers": 48,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": None, "use_sliding_window": False,
        "attention_bias": False, "attention_dropout": 0.0, "output_router_logits": False,
        "router_aux_loss_coef": 0.001, "tie_word_embeddings": False, "initializer_range": 0.02,
        "bos_token_id": 151643, "eos_token_id": 151645,
    },
    # membench's own small shapes (not published models), for tests and quick CPU runs
    "tiny-gpt2": {
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
        "vocab_size": 512, "n_positions": 128, "n_embd": 32, "n_layer": 2, "n_head": 2,
        "activation_function": "gelu_new", "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1,
        "bos_token_id": 511, "eos_token_id": 511,  # GPT2Config's default 50256 is outside this vocabulary
    },
    "tiny-llama": {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"],
        "vocab_size": 512, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_act": "silu", "max_position_embeddings": 128,
        "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "tie_word_embeddings": False,
    },
    "tiny-bert": {
        "model_type": "bert", "architectures": ["BertForMaskedLM"],
        "vocab_size": 512, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
        "intermediate_size": 64, "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1,
        "max_position_embeddings": 128, "pad_token_id": 0,
    },
    # MoE shapes: experts' widths and counts that keep every grouped product's rows a multiple of 16 bytes
    "tiny-mixtral": {
        "model_type": "mixtral", "architectures": ["MixtralForCausalLM"],
        "vocab_size": 512, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2,
        "hidden_act": "silu", "max_position_embeddings": 128, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
    },
    "tiny-qwen3-moe": {
        "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
        "vocab_size": 512, "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "num_experts": 8,
        "num_experts_per_tok": 2, "norm_topk_prob": True, "hidden_act": "silu", "max_position_embeddings": 128,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "tie_word_embeddings": False, "bos_token_id": 0,
        "eos_token_id": 1,  # Qwen3MoeConfig's defaults (151643, 151645) are outside this vocabulary
    },
    # OLMoE (allenai/OLMoE-1B-7B-0924's architecture: 64 experts, 8 per token, q and k norms) at a tiny width
    "tiny-olmoe": {
        "model_type": "olmoe", "architectures": ["OlmoeForCausalLM"],
        "vocab_size": 512, "hidden_size": 32, "intermediate_size": 16, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 4, "num_experts": 8, "num_experts_per_tok": 2,
        "norm_topk_prob": False, "hidden_act": "silu", "max_position_embeddings": 128, "rms_norm_eps": 1e-05,
        "tie_word_embeddings": False, "pad_token_id": 1, "eos_token_id": 2,  # OlmoeConfig's 50279: not in 512
    },
}

# Parameter counts as published, of the preset's architecture (embedding and head counted once when tied):
PUBLISHED_PARAMETERS: dict[str, int] = {
    "gpt2": 124_439_808,  # GPT-2 small, "124M" (its model card); GPT2LMHeadModel, head tied to the embedding
    # BertForMaskedLM: 109,482,240 of BertModel (the card's "110M") - pooler 590,592 + the MLM head's transform
    # 590,592 + its LayerNorm 1,536 + its output bias 30,522 (the decoder's matrix is the tied word embedding)
    "bert-base-uncased": 109_514_298,
    "llama-3.2-1b": 1_235_814_400,  # the model card's "1.23B"; head tied
    "llama-3.1-8b": 8_030_261_248,  # the model card's "8B"
    "llama-3.1-70b": 70_553_706_496,  # the model card's "70B" (70.6B)
    "llama-3.1-405b": 405_853_388_800,  # the model card's "405B" (the Hub's safetensors metadata: 406B)
    "mistral-7b": 7_241_732_096,  # the paper's "7.3B" (Jiang et al. 2023)
    "qwen2.5-7b": 7_615_616_512,  # the model card: "Number of Parameters: 7.61B"
    "qwen2.5-72b": 72_706_203_648,  # the model card: "Number of Parameters: 72.7B"
    # Mixtral: "46.7B total parameters" (Mistral AI's announcement, https://mistral.ai/news/mixtral-of-experts/);
    # 45,097,156,608 of them experts' (32 layers x 8 experts x 3 x 4096 x 14336)
    "mixtral-8x7b": 46_702_792_704,
    # the model card: "Number of Parameters: 30.5B in total and 3.3B activated", "(Non-Embedding): 29.9B"
    # (29,909,792,768 here, the two untied 151,936 x 2048 matrices apart)
    "qwen3-30b-a3b": 30_532_122_624,
}

# The [MASK] token of the tokenizers of the encoder presets (their vocab.txt), used by the masked-LM task's batches
MASK_TOKEN_IDS: dict[str, int] = {"bert-base-uncased": 103}
