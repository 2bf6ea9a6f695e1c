-- Token-level KL(base || variant) on the perplexity text: the newest successful measurement per run and variant.
CREATE OR REPLACE VIEW variant_kl AS
SELECT rv.run_id, rv.variant_uid, q.eval_key AS kl_eval_key, q.value AS kl, q.stderr AS kl_stderr, q.n_samples AS kl_tokens
FROM run_variants rv
JOIN quality_results q ON q.variant_uid = rv.variant_uid AND q.task = 'kl_divergence' AND q.metric = 'mean_token_kl'
JOIN quality_evals e ON e.variant_uid = q.variant_uid AND e.eval_key = q.eval_key
WHERE rv.role = 'variant' AND e.status = 'ok'
QUALIFY row_number() OVER (PARTITION BY rv.run_id, rv.variant_uid ORDER BY e.created_at DESC) = 1;
