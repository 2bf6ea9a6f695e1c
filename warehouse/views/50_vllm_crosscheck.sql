-- Our vLLM offline figure beside `vllm bench throughput` on the same config, like for like: the median of as many
-- timed passes after as many warm-ups (the bench's timed pass repeated by its gate), output tokens/s and (prompt +
-- output) tokens/s, and each side's slowest and fastest pass. gap_pct > 0: ours is faster than vLLM's own. A bench
-- row of before its passes were repeated has one pass: its slowest and fastest are that pass. Beside them, each side's
-- median over its passes of the CPU seconds the rest of the machine used (other_cpu_s) and the hypervisor took
-- (steal_s) while the pass ran: a side that shared the CPUs more is a side a CPU-bound pass is slower on.
CREATE OR REPLACE VIEW vllm_crosscheck AS
SELECT o.run_id, o.variant_uid, o.scenario,
       o.tokens_per_s AS ours_output_tokens_per_s, b.tokens_per_s AS bench_output_tokens_per_s,
       100 * (o.tokens_per_s - b.tokens_per_s) / nullif(b.tokens_per_s, 0) AS output_gap_pct,
       o.total_tokens_per_s AS ours_total_tokens_per_s, b.total_tokens_per_s AS bench_total_tokens_per_s,
       100 * (o.total_tokens_per_s - b.total_tokens_per_s) / nullif(b.total_tokens_per_s, 0) AS total_gap_pct,
       len(o.pass_tps) AS ours_passes, list_min(o.pass_tps) AS ours_slowest_pass, list_max(o.pass_tps) AS ours_fastest_pass,
       greatest(len(b.pass_tps), 1) AS bench_passes,
       coalesce(list_min(b.pass_tps), b.tokens_per_s) AS bench_slowest_pass,
       coalesce(list_max(b.pass_tps), b.tokens_per_s) AS bench_fastest_pass,
       list_median(o.pass_other_cpu_s) AS ours_other_cpu_s, list_median(b.pass_other_cpu_s) AS bench_other_cpu_s,
       list_median(o.pass_steal_s) AS ours_steal_s, list_median(b.pass_steal_s) AS bench_steal_s,
       o.status AS ours_status, b.status AS bench_status, coalesce(o.reason, b.reason) AS reason
FROM stg_speed_passes o
JOIN stg_speed_passes b
  ON b.run_id = o.run_id AND b.variant_uid = o.variant_uid AND b.scenario = o.scenario AND b.engine = 'vllm-bench'
WHERE o.engine = 'vllm';
