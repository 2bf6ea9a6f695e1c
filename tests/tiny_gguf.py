"""GGUF files for tests, written with the gguf library from the shared stories260k model (llama, vocab 512):
float32 tensors (or its matrices quantized, as llama.cpp's quantized files hold them), its sentencepiece vocabulary,
and optionally an output matrix of its own."""

from __future__ import annotations

from pathlib import Path

import numpy as np

# stories260k's tensor names (one decoder layer) as llama.cpp names them.
_LAYER_TENSORS = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}


def write_stories_gguf(model_dir: Path, out: Path, *, output_matrix: np.ndarray | None = None,
                       quantized: tuple[int, int] | None = None) -> Path:
    """stories260k as a GGUF file at `out`; `output_matrix` (vocab × hidden) is stored as output.weight,
    apart from the embeddings, which leaves the model untied. `quantized` (a GGMLQuantizationType, a LlamaFileType,
    e.g. Q8_0 and MOSTLY_Q8_0) stores every matrix in that type and says the file type in the header; the norms stay
    float32, as in llama.cpp's files."""
    import gguf
    import sentencepiece
    from safetensors.numpy import load_file

    weights = load_file(model_dir / "model.safetensors")
    sp = sentencepiece.SentencePieceProcessor(model_file=str(model_dir / "tokenizer.model"))
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_context_length(512)
    writer.add_embedding_length(64)
    writer.add_block_count(5)
    writer.add_feed_forward_length(256)
    writer.add_head_count(8)
    writer.add_head_count_kv(4)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_tokenizer_model("llama")
    ids = range(sp.get_piece_size())
    writer.add_token_list([sp.id_to_piece(i).encode() for i in ids])
    writer.add_token_scores([sp.get_score(i) for i in ids])
    writer.add_token_types([_token_type(sp, i) for i in ids])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)

    def add(name: str, value: np.ndarray) -> None:
        if quantized is None or value.ndim < 2:
            writer.add_tensor(name, value)
        else:
            writer.add_tensor(name, gguf.quants.quantize(value, gguf.GGMLQuantizationType(quantized[0])),
                              raw_dtype=gguf.GGMLQuantizationType(quantized[0]))

    if quantized is not None:
        writer.add_file_type(quantized[1])
    add("token_embd.weight", weights["model.embed_tokens.weight"])
    add("output_norm.weight", weights["model.norm.weight"])
    for name, value in weights.items():
        if name.startswith("model.layers."):
            _, _, layer, rest = name.split(".", 3)
            add(f"blk.{layer}.{_LAYER_TENSORS[rest.removesuffix('.weight')]}.weight", value)
    if output_matrix is not None:
        writer.add_tensor("output.weight", output_matrix.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _token_type(sp, i: int) -> int:
    from gguf import TokenType

    if sp.is_unknown(i):
        return TokenType.UNKNOWN
    if sp.is_control(i):
        return TokenType.CONTROL
    if sp.is_byte(i):
        return TokenType.BYTE
    return TokenType.NORMAL


def stories_embeddings(model_dir: Path) -> np.ndarray:
    from safetensors.numpy import load_file

    return load_file(model_dir / "model.safetensors")["model.embed_tokens.weight"]
