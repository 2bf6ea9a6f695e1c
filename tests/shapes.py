"""Small Qwen2 shapes for dummy checkpoints in tests: overrides of tasks/adapters/dummy_weights' Qwen2.5-7B-Instruct."""

# CPU tests: tiny, quick to write and to run.
TINY_QWEN = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "max_window_layers": 2, "max_position_embeddings": 256, "vocab_size": 1000,
             "bos_token_id": 998, "eos_token_id": 999}
# Device tests: small, with shapes the W4A16 Marlin and Machete kernels take (in_features % 128, out_features % 64).
SMALL_QWEN = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_window_layers": 2, "vocab_size": 2048, "bos_token_id": 2046,
              "eos_token_id": 2047}
