"""The pipeline's steps: download, calibration, quantize, evaluate, KL divergence, benchmark and decide, each a plain
function and its Prefect task; the statistics and rooflines they judge with."""
