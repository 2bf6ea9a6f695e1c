-- Our vLLM offline figure beside `vllm bench throughput` on the same config, like for like: the median of as many
-- timed passes after as many warm-ups (the bench's timed pass repeated by its gate), output tokens/s and (prompt +
-- output) tokens/s, and each side's slowest and fastest pass. gap_pct > 0: ours is faster than vLLM's own. A bench
-- row of before its passes were repeated has one pass: its slowest and fastest are that pass. Beside them, each side's
-- median over its passes of the CPU seconds the rest of the machine used (other_cpu_s) and the hypervisor took
-- (steal_s) while the pass ran: a side that shared the CPUs more is a side a CPU-bound pass is slower on.
-- Agreement over passes: every pairing of one of our passes with one of the bench's gives a gap; their range
-- (output_gap_low_pct .. output_gap_high_pct) is within 3% of the bench, differs from it (wholly beyond 3% on one
-- side), or is too spread to resolve 3% (a point gap would claim more than the passes know).
CREATE OR REPLACE VIEW vllm_crosscheck AS
SELECT *,
       CASE WHEN output_gap_low_pct IS NULL OR output_gap_high_pct IS NULL THEN NULL
            WHEN output_gap_low_pct >= -3 AND output_gap_high_pct <= 3
                 THEN printf('within 3%% (every pairing of passes: %+.1f%% to %+.1f%%)', output_gap_low_pct, output_gap_high_pct)
            WHEN output_gap_low_pct > 3 OR output_gap_high_pct < -3
                 THEN printf('differs by %+.1f%% (every pairing of passes: %+.1f%% to %+.1f%%)', output_gap_pct,
                             output_gap_low_pct, output_gap_high_pct)
            ELSE printf('passes too spread to resolve 3%% (every pairing: %+.1f%% to %+.1f%%)', output_gap_low_pct,
                        output_gap_high_pct)
       END AS agreement
FROM (
SELECT o.run_id, o.variant_uid, o.scenario,
       o.tokens_per_s AS ours_output_tokens_per_s, b.tokens_per_s AS bench_output_tokens_per_s,
       100 * (o.tokens_per_s - b.tokens_per_s) / nullif(b.tokens_per_s, 0) AS output_gap_pct,
       100 * (list_min(o.pass_tps) / nullif(coalesce(list_max(b.pass_tps), b.tokens_per_s), 0) - 1) AS output_gap_low_pct,
       100 * (list_max(o.pass_tps) / nullif(coalesce(list_min(b.pass_tps), b.tokens_per_s), 0) - 1) AS output_gap_high_pct,
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
WHERE o.engine = 'vllm'
) c;
