-- vLLM against Transformers on the same variant and scenario of a run: throughput ratio, and the
-- batch-1 decode speed with its share of the memory-bandwidth roofline.
CREATE OR REPLACE VIEW engine_comparison AS
SELECT t.run_id, t.variant_uid, v.name AS variant, v.weights, t.scenario,
       t.tokens_per_s AS transformers_tokens_per_s, l.tokens_per_s AS vllm_tokens_per_s,
       l.tokens_per_s / nullif(t.tokens_per_s, 0) AS vllm_over_transformers,
       t.decode_tokens_per_s AS transformers_decode_tokens_per_s, l.decode_tokens_per_s AS vllm_decode_tokens_per_s,
       t.roofline_fraction AS transformers_roofline_fraction, l.roofline_fraction AS vllm_roofline_fraction
FROM stg_speed_results t
JOIN stg_speed_results l
  ON l.run_id = t.run_id AND l.variant_uid = t.variant_uid AND l.scenario = t.scenario AND l.engine = 'vllm'
JOIN variants v ON v.variant_uid = t.variant_uid
WHERE t.engine = 'transformers' AND t.status = 'ok' AND l.status = 'ok';
