-- Speedup of each variant over the base on the same engine and scenario in the same run, with the range its
-- repetitions allow: speedup_low pairs the variant's slowest pass with the base's fastest, speedup_high the
-- variant's fastest with the base's slowest (NULL without per-pass figures, e.g. a serving row). host_bound: the host
-- paced either side's passes (stg_speed_passes), so the ratio moves with the host.
CREATE OR REPLACE VIEW variant_speedup AS
SELECT s.run_id, s.variant_uid, s.engine, s.scenario, s.status, s.reason,
       s.tokens_per_s, b.tokens_per_s AS base_tokens_per_s,
       s.tokens_per_s / nullif(b.tokens_per_s, 0) AS speedup,
       list_min(s.pass_tps) / nullif(list_max(b.pass_tps), 0) AS speedup_low,
       list_max(s.pass_tps) / nullif(list_min(b.pass_tps), 0) AS speedup_high,
       len(s.pass_tps) AS passes, len(b.pass_tps) AS base_passes,
       s.ttft_ms, b.ttft_ms AS base_ttft_ms, s.tpot_ms, b.tpot_ms AS base_tpot_ms,
       s.peak_memory_bytes, b.peak_memory_bytes AS base_peak_memory_bytes,
       s.host_bound OR b.host_bound AS host_bound, greatest(s.host_busy_share, b.host_busy_share) AS host_busy_share
FROM stg_speed_passes s
JOIN run_variants rv ON rv.run_id = s.run_id AND rv.variant_uid = s.variant_uid AND rv.role = 'variant'
LEFT JOIN run_variants rb ON rb.run_id = s.run_id AND rb.role = 'base'
LEFT JOIN stg_speed_passes b
  ON b.run_id = s.run_id AND b.variant_uid = rb.variant_uid AND b.engine = s.engine AND b.scenario = s.scenario
 AND b.status = 'ok';
