"""Adapters to the libraries that do the work: engines (Transformers, vLLM), quantizers (llm-compressor,
bitsandbytes at load time), evaluators (lm-eval), the speed backends (vllm bench, vllm serve, any endpoint) and
GGUF wheels."""
