-- One row per variant of the latest run of each model: what it is, how good, how fast, the verdict; random_weights
-- marks a run on the model's shape (random weights: speed, memory and time real, quality not measured);
-- base_prequantized and base_provenance say whether the base's weights passed through quantization before the run
-- (a Q4_K_M GGUF: every recovery is against a 4-bit model, not the 16-bit release; NULL: not recorded).
CREATE OR REPLACE VIEW latest_runs AS
SELECT * EXCLUDE (rn) FROM (
    SELECT r.*, row_number() OVER (PARTITION BY model_id ORDER BY started_at DESC) AS rn
    FROM runs r WHERE r.flow_name = 'evaluate-model' AND r.status IN ('completed', 'failed')
) WHERE rn = 1;

-- The measured speedup to show when the policy's gated engine was not measured (vllm first).
CREATE OR REPLACE VIEW measured_speedup AS
SELECT run_id, variant_uid,
       arg_min(speedup, (CASE engine WHEN 'vllm' THEN 0 ELSE 1 END, scenario)) AS speedup,
       arg_min(engine || '/' || scenario, (CASE engine WHEN 'vllm' THEN 0 ELSE 1 END, scenario)) AS basis
FROM variant_speedup WHERE speedup IS NOT NULL
GROUP BY run_id, variant_uid;

-- The worst flip rate over every 0/1-scored task, gated or not.
CREATE OR REPLACE VIEW variant_worst_flip AS
SELECT run_id, variant_uid, max(flip_rate) AS flip_rate FROM variant_flips GROUP BY run_id, variant_uid;

-- The cheapest measured way to serve each variant of a run: cost per million output tokens at the SLO for
-- serving scenarios, at peak throughput for the others.
CREATE OR REPLACE VIEW variant_cheapest AS
SELECT run_id, variant_uid,
       min(coalesce(usd_per_million_output_tokens_at_slo, CASE WHEN NOT serving THEN usd_per_million_output_tokens END))
           AS usd_per_million_tokens,
       arg_min(engine || '/' || scenario || coalesce('@' || slo_load, ''),
               coalesce(usd_per_million_output_tokens_at_slo, CASE WHEN NOT serving THEN usd_per_million_output_tokens END))
           AS cost_basis
FROM variant_cost
GROUP BY run_id, variant_uid;

CREATE OR REPLACE VIEW variant_scorecard AS
SELECT r.model_id, v.name AS variant, v.method, v.scheme, v.bits, v.group_size,
       v.size_bytes, d.size_ratio, d.quality_recovery, d.quality_lower_bound, coalesce(d.flip_rate, f.flip_rate) AS flip_rate,
       k.kl, k.kl_stderr, lc.long_context, lc.long_context_base, lc.long_context_recovery,
       coalesce(d.speedup, m.speedup) AS speedup,
       CASE WHEN d.speedup IS NOT NULL THEN 'gated' ELSE m.basis END AS speedup_basis,
       coalesce(d.decision, 'reject') AS decision,
       coalesce(d.reason, 'reject: not decided: ' || coalesce(v.error, 'run ' || r.status)) AS reason,
       rv.reused, CASE WHEN v.skipped THEN 'skipped' ELSE v.status END AS build_status, r.run_id, r.started_at,
       v.variant_uid, d.policy_hash, c.usd_per_million_tokens, c.cost_basis, sv.serving_goodput_ratio,
       sv.serving_config, dc.name AS deciding_check, dc.value AS deciding_value, dc.threshold AS deciding_threshold,
       dc.items_to_decide, pw.min_detectable_drop, pw.power_basis, coalesce(mo.random_weights, false) AS random_weights,
       mo.prequantized AS base_prequantized, mo.provenance AS base_provenance, dc.outcome AS deciding_outcome
FROM latest_runs r
JOIN run_variants rv ON rv.run_id = r.run_id AND rv.role = 'variant'
JOIN variants v ON v.variant_uid = rv.variant_uid
LEFT JOIN models mo ON mo.model_uid = v.model_uid
LEFT JOIN decisions d ON d.run_id = r.run_id AND d.variant_uid = rv.variant_uid
LEFT JOIN variant_worst_flip f ON f.run_id = r.run_id AND f.variant_uid = rv.variant_uid
LEFT JOIN variant_kl k ON k.run_id = r.run_id AND k.variant_uid = rv.variant_uid
LEFT JOIN variant_long_context lc ON lc.run_id = r.run_id AND lc.variant_uid = rv.variant_uid
LEFT JOIN measured_speedup m ON m.run_id = r.run_id AND m.variant_uid = rv.variant_uid
LEFT JOIN variant_cheapest c ON c.run_id = r.run_id AND c.variant_uid = rv.variant_uid
LEFT JOIN decision_serving sv ON sv.run_id = r.run_id AND sv.variant_uid = rv.variant_uid
LEFT JOIN deciding_check dc ON dc.run_id = r.run_id AND dc.variant_uid = rv.variant_uid
LEFT JOIN decision_power pw ON pw.run_id = r.run_id AND pw.variant_uid = rv.variant_uid
ORDER BY r.model_id, v.name;
