-- Speedup of each variant over the base on the same engine and scenario in the same run, with the range its
-- passes allow. Paired (the variant's passes alternated with the base's in one engine process: paired_base_tps):
-- the median of the pairs' ratios, and their lowest and highest, so that what the host did between two windows
-- minutes apart stays out of it. Else the ratio of the two rows' medians, speedup_low pairing the variant's
-- slowest pass with the base's fastest and speedup_high the reverse (NULL without per-pass figures, e.g. a
-- serving row). host_bound: the host paced either side's passes (stg_speed_passes), so the ratio moves with the
-- host.
CREATE OR REPLACE VIEW variant_speedup AS
WITH rows AS (
    SELECT *, coalesce(len(paired_base_tps) = len(pass_tps), false) AS paired,
           list_transform(list_zip(pass_tps, paired_base_tps), lambda p: p[1] / nullif(p[2], 0)) AS pair_ratios
    FROM stg_speed_passes
)
SELECT s.run_id, s.variant_uid, s.engine, s.scenario, s.status, s.reason,
       s.tokens_per_s, b.tokens_per_s AS base_tokens_per_s,
       CASE WHEN s.paired THEN list_median(s.pair_ratios) ELSE s.tokens_per_s / nullif(b.tokens_per_s, 0) END
           AS speedup,
       CASE WHEN s.paired THEN list_min(s.pair_ratios) ELSE list_min(s.pass_tps) / nullif(list_max(b.pass_tps), 0) END
           AS speedup_low,
       CASE WHEN s.paired THEN list_max(s.pair_ratios) ELSE list_max(s.pass_tps) / nullif(list_min(b.pass_tps), 0) END
           AS speedup_high,
       len(s.pass_tps) AS passes, CASE WHEN s.paired THEN len(s.paired_base_tps) ELSE len(b.pass_tps) END AS base_passes,
       s.ttft_ms, b.ttft_ms AS base_ttft_ms, s.tpot_ms, b.tpot_ms AS base_tpot_ms,
       s.peak_memory_bytes, b.peak_memory_bytes AS base_peak_memory_bytes,
       s.host_bound OR b.host_bound AS host_bound, greatest(s.host_busy_share, b.host_busy_share) AS host_busy_share,
       s.paired
FROM rows s
JOIN run_variants rv ON rv.run_id = s.run_id AND rv.variant_uid = s.variant_uid AND rv.role = 'variant'
LEFT JOIN run_variants rb ON rb.run_id = s.run_id AND rb.role = 'base'
LEFT JOIN stg_speed_passes b
  ON b.run_id = s.run_id AND b.variant_uid = rb.variant_uid AND b.engine = s.engine AND b.scenario = s.scenario
 AND b.status = 'ok';
