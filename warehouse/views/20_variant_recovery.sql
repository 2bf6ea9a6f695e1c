-- Recovery of each metric: variant ÷ base, inverted for lower-is-better metrics (perplexity), and above chance.
CREATE OR REPLACE VIEW variant_recovery AS
SELECT v.run_id, v.variant_uid, v.task, v.metric, v.filter, v.higher_is_better,
       v.value AS variant_value, b.value AS base_value, v.stderr AS variant_stderr, b.stderr AS base_stderr,
       v.n_samples,
       CASE
           WHEN v.value IS NULL OR b.value IS NULL OR isnan(v.value) OR isnan(b.value) THEN NULL
           WHEN v.higher_is_better AND b.value <> 0 THEN v.value / b.value
           WHEN NOT v.higher_is_better AND v.value <> 0 THEN b.value / v.value
       END AS recovery,
       v.protocol,
       -- Above chance: how much of the base's margin over guessing the variant keeps (higher-is-better metrics
       -- with a chance level only).
       b.chance,
       CASE
           WHEN v.higher_is_better AND b.chance IS NOT NULL AND v.value IS NOT NULL AND b.value IS NOT NULL
                AND NOT isnan(v.value) AND NOT isnan(b.value) AND b.value <> b.chance
           THEN (v.value - b.chance) / (b.value - b.chance)
       END AS recovery_above_chance
FROM stg_run_quality v
JOIN stg_run_quality b
  ON b.run_id = v.run_id AND b.role = 'base' AND b.eval_key = v.eval_key
 AND b.task = v.task AND b.metric = v.metric AND b.filter = v.filter
WHERE v.role = 'variant';
