-- Per-item evidence behind a recovery figure: the same documents scored by a variant and by its base.

-- One row per document scored by both a variant and the base of the same run under the same evaluation.
-- Perplexity tasks: value is the document's loglikelihood and weight its word or byte count (per metric).
CREATE OR REPLACE VIEW variant_paired_samples AS
SELECT v.run_id, v.variant_uid, b.variant_uid AS base_uid, v.eval_key, s.task, s.metric, s.filter, s.doc_id,
       bs.value AS base_value, s.value AS variant_value,
       (bs.detail->>'$.weight')::DOUBLE AS base_weight, (s.detail->>'$.weight')::DOUBLE AS variant_weight
FROM run_variants v
JOIN run_variants b ON b.run_id = v.run_id AND b.role = 'base' AND b.eval_key = v.eval_key
JOIN quality_samples s ON s.variant_uid = v.variant_uid AND s.eval_key = v.eval_key
JOIN quality_samples bs
  ON bs.variant_uid = b.variant_uid AND bs.eval_key = b.eval_key
 AND bs.task = s.task AND bs.metric = s.metric AND bs.filter = s.filter AND bs.doc_id = s.doc_id
WHERE v.role = 'variant' AND isfinite(s.value) AND isfinite(bs.value);

-- Items whose correctness changed from base to variant, for metrics scored 0/1 per item (acc, exact_match):
-- two variants with equal accuracy can each get a tenth of the items wrong that the base got right.
CREATE OR REPLACE VIEW variant_flips AS
SELECT run_id, variant_uid, task, metric, filter,
       count(*) AS n_items,
       count(*) FILTER (WHERE base_value = 1 AND variant_value = 0) AS flips_to_wrong,
       count(*) FILTER (WHERE base_value = 0 AND variant_value = 1) AS flips_to_right,
       count(*) FILTER (WHERE base_value = 1 AND variant_value = 0) / count(*) AS to_wrong_rate,
       count(*) FILTER (WHERE base_value = 0 AND variant_value = 1) / count(*) AS to_right_rate,
       count(*) FILTER (WHERE base_value <> variant_value) / count(*) AS flip_rate,
       avg(base_value) AS base_value, avg(variant_value) AS variant_value
FROM variant_paired_samples
GROUP BY run_id, variant_uid, task, metric, filter
HAVING bool_and(base_value IN (0, 1) AND variant_value IN (0, 1));

-- Standard error of each stored metric from its per-item values, for metrics lm-eval reports none for
-- (bits_per_byte, perplexities). Every aggregate is f(R), R = Σvalue / Σweight (weight 1 for means):
-- se(R) by linearisation, sqrt(Σ(value - R·weight)² / (n(n-1))) / mean(weight), then through f.
CREATE OR REPLACE VIEW sample_stderr AS
WITH sums AS (
    SELECT variant_uid, eval_key, task, metric, filter, count(*) AS n,
           sum(value) AS sv, sum(w) AS sw, sum(value * value) AS svv, sum(value * w) AS svw, sum(w * w) AS sww
    FROM (SELECT *, coalesce((detail->>'$.weight')::DOUBLE, 1) AS w FROM quality_samples WHERE isfinite(value))
    GROUP BY variant_uid, eval_key, task, metric, filter
    HAVING count(*) > 1
),
ratio AS (
    SELECT *, sv / sw AS r,
           sqrt(greatest(svv - 2 * (sv / sw) * svw + (sv / sw) ^ 2 * sww, 0) / (n * (n - 1))) / (sw / n) AS se_r
    FROM sums
)
SELECT variant_uid, eval_key, task, metric, filter, n,
       CASE
           WHEN metric = 'bits_per_byte' THEN se_r / ln(2)
           WHEN metric IN ('word_perplexity', 'byte_perplexity', 'perplexity') THEN exp(-r) * se_r
           ELSE se_r
       END AS stderr
FROM ratio;

-- stg_run_quality with a stderr everywhere one can be had: lm-eval's, else the per-item one.
CREATE OR REPLACE VIEW stg_run_quality_se AS
SELECT q.*, coalesce(CASE WHEN isfinite(q.stderr) THEN q.stderr END, s.stderr) AS se
FROM stg_run_quality q
LEFT JOIN sample_stderr s USING (variant_uid, eval_key, task, metric, filter);
