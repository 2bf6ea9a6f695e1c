"""Published model shapes: the config.json (and generation_config.json) of released models, as their authors
published them, for runs on a model's shape with random weights (a `kind: shape` source, the GPU suite)."""

from __future__ import annotations

# Qwen/Qwen2.5-7B-Instruct config.json and generation_config.json, as published.
QWEN25_7B_INSTRUCT: dict = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "hidden_act": "silu",
    "hidden_size": 3584,
    "initializer_range": 0.02,
    "intermediate_size": 18944,
    "max_position_embeddings": 32768,
    "max_window_layers": 28,
    "model_type": "qwen2",
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 131072,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.43.1",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 152064,
}

QWEN25_7B_INSTRUCT_GENERATION: dict = {
    "bos_token_id": 151643,
    "pad_token_id": 151643,
    "do_sample": True,
    "eos_token_id": [151645, 151643],
    "repetition_penalty": 1.05,
    "temperature": 0.7,
    "top_p": 0.8,
    "top_k": 20,
    "transformers_version": "4.37.0",
}

# Qwen/Qwen2.5-14B-Instruct config.json, as published (its generation_config.json is the 7B's).
QWEN25_14B_INSTRUCT: dict = {
    **QWEN25_7B_INSTRUCT,
    "hidden_size": 5120,
    "intermediate_size": 13824,
    "max_window_layers": 70,
    "num_attention_heads": 40,
    "num_hidden_layers": 48,
    "num_key_value_heads": 8,
}

# Qwen/Qwen2.5-32B-Instruct and meta-llama/Llama-3.1-70B-Instruct config.json, as published: sized, not run
# (benchmarks/size_curve.py predicts what a verdict on them costs). Not SHAPES: no run has taken them yet, and the
# 70B needs its own family's tokenizer (a vocabulary of 128,256).
QWEN25_32B_INSTRUCT: dict = {
    **QWEN25_7B_INSTRUCT,
    "hidden_size": 5120,
    "intermediate_size": 27648,
    "max_window_layers": 70,
    "num_attention_heads": 40,
    "num_hidden_layers": 64,
    "num_key_value_heads": 8,
}

LLAMA31_70B_INSTRUCT: dict = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "hidden_act": "silu",
    "hidden_size": 8192,
    "initializer_range": 0.02,
    "intermediate_size": 28672,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 64,
    "num_hidden_layers": 80,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.42.3",
    "use_cache": True,
    "vocab_size": 128256,
}

# Qwen/Qwen3-30B-A3B config.json and generation_config.json, as published: a mixture of experts, every layer sparse
# (128 experts of 768, 8 routed per token; 30.5B parameters, 3.3B active).
QWEN3_30B_A3B: dict = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

QWEN3_30B_A3B_GENERATION: dict = {
    "bos_token_id": 151643,
    "do_sample": True,
    "eos_token_id": [151645, 151643],
    "pad_token_id": 151643,
    "temperature": 0.6,
    "top_k": 20,
    "top_p": 0.95,
}

# Not a released model, and named so: Qwen3-30B-A3B with 4 of its 48 layers (3.1B parameters). An MoE whose every
# layer is the real one, so that its builds (routers kept in 16 bits, 128 experts calibrated) and vLLM's fused-MoE
# kernels at the real expert shapes run in minutes on one GPU (issue 43's MoE on the GPU), where the whole model's
# builds would take the GPU for an hour.
QWEN3_30B_A3B_4_LAYERS: dict = {**QWEN3_30B_A3B, "num_hidden_layers": 4, "max_window_layers": 4}

SHAPES: dict[str, dict] = {"qwen2.5-7b-instruct": QWEN25_7B_INSTRUCT, "qwen2.5-14b-instruct": QWEN25_14B_INSTRUCT,
                           "qwen3-30b-a3b": QWEN3_30B_A3B, "qwen3-30b-a3b-4-layers": QWEN3_30B_A3B_4_LAYERS}
# Each shape's generation_config.json, where its authors published one.
GENERATION: dict[str, dict] = {"qwen2.5-7b-instruct": QWEN25_7B_INSTRUCT_GENERATION,
                               "qwen2.5-14b-instruct": QWEN25_7B_INSTRUCT_GENERATION,
                               "qwen3-30b-a3b": QWEN3_30B_A3B_GENERATION,
                               "qwen3-30b-a3b-4-layers": QWEN3_30B_A3B_GENERATION}
