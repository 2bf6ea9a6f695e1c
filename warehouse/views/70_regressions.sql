-- Did anything get worse since last time? Four comparisons, each latest against the one before:
--   quality  each metric of a variant (same variant_uid: same model sha and recipe), latest evaluation the
--            variant was part of against the previous one. Evaluations are cached per (variant, eval_key),
--            so a difference means a new eval_key (lm-eval version, task config, limit) or a re-measurement.
--   speed    tokens_per_s of a variant on the same engine and scenario, latest successful run against the previous.
--   recipe   a model's latest run has a variant of the same name as its previous run but another build
--            (changed recipe or library versions): recovery of each metric against the previous build's.
--   decision a model's latest run against its previous one, per variant name: the verdict, ranked
--            accept (2) > inconclusive (1) > reject (0) in value / previous_value, the two verdicts in basis
--            ('accept → inconclusive'); any step down is worse (no noise band: a verdict already accounts for it).
--            not_comparable has no rank (change 'unknown'): it says the base could not be trusted, not the variant.
--   engine drift  the base's probe in a model's latest run against its previous run's (table engine_drift, written
--            by the run's probe stage: tasks/steps/drift.py), each metric the two probes share; `noise` is the
--            paired interval's half-width in score units, and a move is worse/better only where the run found drift
--            (interval excluding 1, material, library versions changed: basis names them); flagged either way, as
--            the engine moved, not a variant. Every other row of a run whose base drifted says so in its basis:
--            a variant's regression there may be the engine's.
-- Noise bands: quality and recovery move beyond noise when |Δ| > 2 × the combined stderr, sqrt(se₁² + se₂²)
-- (recovery stderr by the delta method, base and variant taken as independent: conservative); speed when
-- |Δ| > 10% of the previous tokens_per_s, a fixed constant (medians of a few repetitions on a shared
-- machine routinely move a few percent). change: worse / better beyond noise, within noise, unchanged
-- (Δ = 0, e.g. the same cached evaluation), changed (beyond noise, direction unknown) or unknown
-- (no stderr); flagged = worse.
CREATE OR REPLACE VIEW regressions AS
WITH done AS (
    SELECT run_id, model_id, started_at FROM runs WHERE status IN ('completed', 'failed')
),
qr AS (
    SELECT q.*, d.model_id,
           dense_rank() OVER (PARTITION BY q.variant_uid ORDER BY d.started_at DESC, q.run_id) AS k
    FROM stg_run_quality_se q JOIN done d USING (run_id)
),
quality AS (
    SELECT 'quality' AS kind, l.model_id, l.variant_uid, p.variant_uid AS previous_variant_uid,
           l.run_id, p.run_id AS previous_run_id,
           l.task || '/' || l.metric || CASE WHEN l.filter <> 'none' THEN ',' || l.filter ELSE '' END AS measure,
           p.value AS previous_value, l.value, 2 * sqrt(l.se ^ 2 + p.se ^ 2) AS noise, l.higher_is_better,
           CASE WHEN l.eval_key = p.eval_key AND l.measured_run_id = p.measured_run_id THEN 'same evaluation'
                WHEN l.eval_key = p.eval_key THEN 're-measured'
                ELSE 'eval_key ' || left(p.eval_key, 12) || ' → ' || left(l.eval_key, 12) END AS basis,
           NULL::BOOLEAN AS drifted
    FROM qr l
    JOIN qr p ON p.variant_uid = l.variant_uid AND p.k = 2
            AND p.task = l.task AND p.metric = l.metric AND p.filter = l.filter
    WHERE l.k = 1
),
sr AS (
    SELECT s.*, d.model_id,
           dense_rank() OVER (PARTITION BY s.variant_uid, s.engine, s.scenario ORDER BY d.started_at DESC, s.run_id) AS k
    FROM stg_speed_results s JOIN done d USING (run_id)
    WHERE s.status = 'ok' AND s.tokens_per_s IS NOT NULL
),
speed AS (
    SELECT 'speed' AS kind, l.model_id, l.variant_uid, p.variant_uid AS previous_variant_uid,
           l.run_id, p.run_id AS previous_run_id,
           l.engine || '/' || l.scenario || ' tokens_per_s' AS measure,
           p.tokens_per_s AS previous_value, l.tokens_per_s AS value, 0.10 * p.tokens_per_s AS noise,
           true AS higher_is_better,
           CASE WHEN l.config::VARCHAR IS DISTINCT FROM p.config::VARCHAR THEN 'scenario config changed'
                WHEN l.device IS DISTINCT FROM p.device THEN 'device ' || coalesce(p.device, '?') || ' → ' || coalesce(l.device, '?')
                WHEN l.versions::VARCHAR IS DISTINCT FROM p.versions::VARCHAR THEN 'library versions changed'
                ELSE 'same config' END AS basis, NULL::BOOLEAN AS drifted
    FROM sr l
    JOIN sr p ON p.variant_uid = l.variant_uid AND p.engine = l.engine AND p.scenario = l.scenario AND p.k = 2
    WHERE l.k = 1
),
model_runs AS (
    SELECT run_id, model_id, row_number() OVER (PARTITION BY model_id ORDER BY started_at DESC, run_id) AS k
    FROM runs WHERE flow_name = 'evaluate-model' AND status IN ('completed', 'failed')
),
named AS (
    SELECT m.model_id, m.k, rv.run_id, rv.variant_uid, v.name
    FROM model_runs m
    JOIN run_variants rv ON rv.run_id = m.run_id AND rv.role = 'variant'
    JOIN variants v ON v.variant_uid = rv.variant_uid
    WHERE m.k <= 2
),
rec AS (
    SELECT r.run_id, r.variant_uid, r.task, r.metric, r.filter, r.recovery,
           abs(r.recovery) * sqrt((qv.se / r.variant_value) ^ 2 + (qb.se / r.base_value) ^ 2) AS se
    FROM variant_recovery r
    JOIN stg_run_quality_se qv
      ON qv.run_id = r.run_id AND qv.variant_uid = r.variant_uid
     AND qv.task = r.task AND qv.metric = r.metric AND qv.filter = r.filter
    JOIN stg_run_quality_se qb
      ON qb.run_id = r.run_id AND qb.role = 'base'
     AND qb.task = r.task AND qb.metric = r.metric AND qb.filter = r.filter
),
recipe AS (
    SELECT 'recipe' AS kind, l.model_id, l.variant_uid, p.variant_uid AS previous_variant_uid,
           l.run_id, p.run_id AS previous_run_id,
           rl.task || '/' || rl.metric || CASE WHEN rl.filter <> 'none' THEN ',' || rl.filter ELSE '' END
               || ' recovery' AS measure,
           rp.recovery AS previous_value, rl.recovery AS value, 2 * sqrt(rl.se ^ 2 + rp.se ^ 2) AS noise,
           true AS higher_is_better, 'build ' || left(p.variant_uid, 12) || ' → ' || left(l.variant_uid, 12) AS basis,
           NULL::BOOLEAN AS drifted
    FROM named l
    JOIN named p ON p.model_id = l.model_id AND p.name = l.name AND p.k = 2 AND p.variant_uid <> l.variant_uid
    JOIN rec rl ON rl.run_id = l.run_id AND rl.variant_uid = l.variant_uid
    JOIN rec rp ON rp.run_id = p.run_id AND rp.variant_uid = p.variant_uid
               AND rp.task = rl.task AND rp.metric = rl.metric AND rp.filter = rl.filter
    WHERE l.k = 1
),
verdict AS (
    SELECT 'decision' AS kind, l.model_id, l.variant_uid, p.variant_uid AS previous_variant_uid,
           l.run_id, p.run_id AS previous_run_id, 'decision' AS measure,
           CASE dp.decision WHEN 'accept' THEN 2 WHEN 'inconclusive' THEN 1 WHEN 'reject' THEN 0 END::DOUBLE
               AS previous_value,
           CASE dl.decision WHEN 'accept' THEN 2 WHEN 'inconclusive' THEN 1 WHEN 'reject' THEN 0 END::DOUBLE AS value,
           0.0 AS noise, true AS higher_is_better, dp.decision || ' → ' || dl.decision AS basis,
           NULL::BOOLEAN AS drifted
    FROM named l
    JOIN named p ON p.model_id = l.model_id AND p.name = l.name AND p.k = 2
    JOIN decisions dl ON dl.run_id = l.run_id AND dl.variant_uid = l.variant_uid
    JOIN decisions dp ON dp.run_id = p.run_id AND dp.variant_uid = p.variant_uid
    WHERE l.k = 1
),
drift AS (
    SELECT 'engine drift' AS kind, r.model_id, d.variant_uid, d.variant_uid AS previous_variant_uid,
           d.run_id, d.previous_run_id,
           d.task || '/' || d.metric || CASE WHEN d.filter <> 'none' THEN ',' || d.filter ELSE '' END
               || ' (base probe)' AS measure,
           d.previous_value, d.value, abs(d.previous_value) * (d.upper - d.lower) / 2 AS noise, d.higher_is_better,
           CASE WHEN d.changed = '' THEN 'no library version changed' ELSE d.changed END AS basis, d.drifted
    FROM engine_drift d
    JOIN (SELECT run_id, model_id FROM model_runs WHERE k = 1) r USING (run_id)
),
compared AS (
    SELECT * FROM quality UNION ALL SELECT * FROM speed UNION ALL SELECT * FROM recipe UNION ALL SELECT * FROM verdict
    UNION ALL SELECT * FROM drift
),
drifted_runs AS (
    SELECT DISTINCT run_id FROM engine_drift WHERE drifted
)
SELECT c.kind, c.model_id, v.name AS variant, c.measure, c.previous_value, c.value,
       c.value - c.previous_value AS delta, c.noise,
       CASE
           WHEN c.value IS NULL OR c.previous_value IS NULL THEN 'unknown'
           WHEN c.value = c.previous_value THEN 'unchanged'
           -- The base's probe: worse or better only where the run found drift, by the paired interval.
           WHEN c.kind = 'engine drift' AND NOT c.drifted THEN 'within noise'
           WHEN c.kind = 'engine drift' THEN CASE WHEN (c.value > c.previous_value) = c.higher_is_better
                                                  THEN 'better' ELSE 'worse' END
           WHEN c.noise IS NULL OR isnan(c.noise) THEN 'unknown'
           WHEN abs(c.value - c.previous_value) <= c.noise THEN 'within noise'
           WHEN c.higher_is_better IS NULL THEN 'changed'
           WHEN (c.value > c.previous_value) = c.higher_is_better THEN 'better'
           ELSE 'worse'
       END AS change,
       change = 'worse' OR (c.kind = 'engine drift' AND change = 'better') AS flagged,
       c.basis || CASE WHEN c.kind <> 'engine drift' AND c.run_id IN (SELECT run_id FROM drifted_runs)
                       THEN '; engine drift in this run: its base moved' ELSE '' END AS basis,
       c.higher_is_better, c.run_id, c.previous_run_id, c.variant_uid, c.previous_variant_uid
FROM compared c
JOIN variants v ON v.variant_uid = c.variant_uid
ORDER BY flagged DESC, c.model_id, v.name, c.kind, c.measure;
