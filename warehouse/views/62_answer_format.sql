-- Format apart from skill, for generated answers scored by exact match under several filters (GSM8K's
-- strict-match takes only a final `#### N` line, flexible-extract the last number): per checkpoint and filter,
-- the share of answers the filter could extract at all (lm-eval's regex filter gives '[invalid]' where its
-- pattern finds nothing) and the share it scored right. A build that loses strict-match accuracy but keeps
-- its flexible-extract accuracy lost the format, not the arithmetic.
CREATE OR REPLACE VIEW checkpoint_answer_format AS
SELECT rv.run_id, rv.variant_uid, rv.role, s.task, s.filter, count(*) AS n_items,
       avg(CASE WHEN json_extract_string(s.detail, '$.filtered') = '[invalid]' THEN 0.0 ELSE 1.0 END) AS extracted_share,
       avg(s.value) AS right_share
FROM run_variants rv
JOIN quality_samples s ON s.variant_uid = rv.variant_uid AND s.eval_key = rv.eval_key
WHERE s.metric = 'exact_match' AND json_extract_string(s.detail, '$.filtered') IS NOT NULL AND isfinite(s.value)
GROUP BY ALL;

-- Each variant beside its base, filter by filter, for tasks scored under more than one filter.
CREATE OR REPLACE VIEW variant_answer_format AS
SELECT v.run_id, v.variant_uid, v.task, v.filter, v.n_items,
       b.extracted_share AS base_extracted_share, v.extracted_share,
       b.right_share AS base_right_share, v.right_share
FROM checkpoint_answer_format v
JOIN checkpoint_answer_format b
  ON b.run_id = v.run_id AND b.role = 'base' AND b.task = v.task AND b.filter = v.filter
WHERE v.role = 'variant'
  AND (SELECT count(DISTINCT f.filter) FROM checkpoint_answer_format f
       WHERE f.run_id = v.run_id AND f.variant_uid = v.variant_uid AND f.task = v.task) > 1;
