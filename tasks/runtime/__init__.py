"""Where and how work runs on this host: processes and lanes, the GPU clock, memory promises, telemetry,
reuse keys and the crash-test hook."""
