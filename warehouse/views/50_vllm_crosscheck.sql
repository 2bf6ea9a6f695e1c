-- Our vLLM offline figure beside `vllm bench throughput` on the same config, like for like:
-- output tokens/s and (prompt + output) tokens/s. gap_pct > 0: ours is faster than vLLM's own.
CREATE OR REPLACE VIEW vllm_crosscheck AS
SELECT o.run_id, o.variant_uid, o.scenario,
       o.tokens_per_s AS ours_output_tokens_per_s, b.tokens_per_s AS bench_output_tokens_per_s,
       100 * (o.tokens_per_s - b.tokens_per_s) / nullif(b.tokens_per_s, 0) AS output_gap_pct,
       o.total_tokens_per_s AS ours_total_tokens_per_s, b.total_tokens_per_s AS bench_total_tokens_per_s,
       100 * (o.total_tokens_per_s - b.total_tokens_per_s) / nullif(b.total_tokens_per_s, 0) AS total_gap_pct,
       o.status AS ours_status, b.status AS bench_status, coalesce(o.reason, b.reason) AS reason
FROM stg_speed_results o
JOIN stg_speed_results b
  ON b.run_id = o.run_id AND b.variant_uid = o.variant_uid AND b.scenario = o.scenario AND b.engine = 'vllm-bench'
WHERE o.engine = 'vllm';
