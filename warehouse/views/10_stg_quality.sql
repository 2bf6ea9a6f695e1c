-- Quality metrics each run used, one row per (run, variant, task, metric, filter). `protocol` is how the task
-- was asked ('5-shot, chat, multiturn'), from the evaluation's stored config; NULL for evaluations stored
-- before protocols were recorded.
CREATE OR REPLACE VIEW stg_run_quality AS
SELECT rv.run_id, rv.variant_uid, rv.role, q.eval_key, q.task, q.metric, q.filter,
       q.value, q.stderr, q.n_samples, q.task_version, q.higher_is_better, q.run_id AS measured_run_id,
       e.config -> 'protocols' ->> q.task AS protocol
FROM run_variants rv
JOIN quality_results q ON q.variant_uid = rv.variant_uid AND q.eval_key = rv.eval_key
LEFT JOIN quality_evals e ON e.variant_uid = q.variant_uid AND e.eval_key = q.eval_key;
