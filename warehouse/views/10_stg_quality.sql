-- The chance level of each metric on the items an evaluation scored: what guessing scores. Multiple choice
-- (acc, acc_norm; each item logged with one log-likelihood per choice): 1 / choices, averaged over the items;
-- exact match: 0. Perplexities and bits per byte have none (NULL).
CREATE OR REPLACE VIEW stg_chance AS
SELECT variant_uid, eval_key, task, metric, filter, avg(1.0 / json_array_length(detail, '$.lls')) AS chance
FROM quality_samples
WHERE metric IN ('acc', 'acc_norm') AND json_array_length(detail, '$.lls') > 0
GROUP BY ALL;

-- Quality metrics each run used, one row per (run, variant, task, metric, filter). `protocol` is how the task
-- was asked ('5-shot, chat, multiturn'), from the evaluation's stored config; NULL for evaluations stored
-- before protocols were recorded.
CREATE OR REPLACE VIEW stg_run_quality AS
SELECT rv.run_id, rv.variant_uid, rv.role, q.eval_key, q.task, q.metric, q.filter,
       q.value, q.stderr, q.n_samples, q.task_version, q.higher_is_better, q.run_id AS measured_run_id,
       e.config -> 'protocols' ->> q.task AS protocol,
       coalesce(c.chance, CASE WHEN q.metric = 'exact_match' THEN 0.0 END) AS chance
FROM run_variants rv
JOIN quality_results q ON q.variant_uid = rv.variant_uid AND q.eval_key = rv.eval_key
LEFT JOIN quality_evals e ON e.variant_uid = q.variant_uid AND e.eval_key = q.eval_key
LEFT JOIN stg_chance c
  ON c.variant_uid = q.variant_uid AND c.eval_key = q.eval_key AND c.task = q.task AND c.metric = q.metric
 AND c.filter = q.filter;
