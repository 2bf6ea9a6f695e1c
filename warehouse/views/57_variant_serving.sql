-- Serving goodput at the SLO per variant and serving scenario, against the base in the same run: the
-- evidence of the policy's serving gate. A run's goodput at the SLO is its best load's good requests per
-- second. A scenario with a sweep counts its tuned serving config (as tuned_serving_config picks it: the
-- best point among the defaults and those beating them by min_gain_pct), for the variant and the base alike.

-- Staging: every serving run's speed row (a sweep point's under its scenario's name) with its best load.
CREATE OR REPLACE VIEW stg_serving_runs AS
SELECT s.run_id, s.variant_uid, s.engine,
       coalesce(s.config->>'$.sweep.scenario', s.scenario) AS scenario,
       coalesce(s.config->>'$.sweep.point', 'default') AS point,
       s.config->'$.sweep.settings' AS settings, s.status, s.reason,
       g.goodput_requests_per_s, g.load, g.output_tokens_per_s,
       coalesce(TRY_CAST(s.config->>'$.sweep.min_gain_pct' AS DOUBLE), 0) AS min_gain_pct
FROM speed_results s
LEFT JOIN serving_best_load g USING (run_id, variant_uid, engine, scenario)
WHERE s.config->>'$.kind' = 'serving';

CREATE OR REPLACE VIEW variant_serving AS
WITH runs AS (
    SELECT *, max(goodput_requests_per_s) FILTER (WHERE point = 'default')
                  OVER (PARTITION BY run_id, variant_uid, engine, scenario) AS default_goodput
    FROM stg_serving_runs
),
ranked AS (
    SELECT *,
           row_number() OVER (w ORDER BY coalesce(point = 'default' OR default_goodput IS NULL
                                                  OR goodput_requests_per_s >= default_goodput * (1 + min_gain_pct / 100),
                                                  false) DESC,
                                         goodput_requests_per_s DESC NULLS LAST, (point = 'default') DESC, point) AS k,
           count(*) OVER w AS points,
           sum(CASE WHEN status = 'ok' THEN 1 ELSE 0 END) OVER w AS points_ok
    FROM runs
    WINDOW w AS (PARTITION BY run_id, variant_uid, engine, scenario)
),
best AS (SELECT * FROM ranked WHERE k = 1)
SELECT v.run_id, v.variant_uid, v.engine, v.scenario, v.status, v.reason, v.point, v.settings, v.load,
       v.goodput_requests_per_s, v.output_tokens_per_s, v.points, v.points_ok,
       b.goodput_requests_per_s AS base_goodput_requests_per_s, b.point AS base_point, b.load AS base_load,
       v.goodput_requests_per_s / nullif(b.goodput_requests_per_s, 0) AS goodput_ratio
FROM best v
JOIN run_variants rv ON rv.run_id = v.run_id AND rv.variant_uid = v.variant_uid AND rv.role = 'variant'
LEFT JOIN run_variants rb ON rb.run_id = v.run_id AND rb.role = 'base'
LEFT JOIN best b ON b.run_id = v.run_id AND b.variant_uid = rb.variant_uid AND b.engine = v.engine
                AND b.scenario = v.scenario;
