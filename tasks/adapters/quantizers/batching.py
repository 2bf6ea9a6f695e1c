"""How a calibrated build batches its calibration samples: what llm-compressor is handed (llmcompressor.py) and what
a build's GPU memory is sized by (tasks/adapters/model_memory.py), without importing llm-compressor."""

from __future__ import annotations

# Calibration tokens per batch: AWQ reruns each layer per batch per grid point, so fewer batches, less overhead.
CALIBRATION_TOKENS_PER_BATCH = 16_384


def calibration_batch_size(num_samples: int, seq_len: int) -> int:
    """Samples per calibration batch: as many as fit CALIBRATION_TOKENS_PER_BATCH, 1 to `num_samples`."""
    return max(1, min(num_samples, CALIBRATION_TOKENS_PER_BATCH // max(seq_len, 1)))
