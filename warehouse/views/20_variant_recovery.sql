-- Recovery of each metric: variant ÷ base, inverted for lower-is-better metrics (perplexity).
CREATE OR REPLACE VIEW variant_recovery AS
SELECT v.run_id, v.variant_uid, v.task, v.metric, v.filter, v.higher_is_better,
       v.value AS variant_value, b.value AS base_value, v.stderr AS variant_stderr, b.stderr AS base_stderr,
       v.n_samples,
       CASE
           WHEN v.value IS NULL OR b.value IS NULL OR isnan(v.value) OR isnan(b.value) THEN NULL
           WHEN v.higher_is_better AND b.value <> 0 THEN v.value / b.value
           WHEN NOT v.higher_is_better AND v.value <> 0 THEN b.value / v.value
       END AS recovery,
       v.protocol
FROM stg_run_quality v
JOIN stg_run_quality b
  ON b.run_id = v.run_id AND b.role = 'base' AND b.eval_key = v.eval_key
 AND b.task = v.task AND b.metric = v.metric AND b.filter = v.filter
WHERE v.role = 'variant';
