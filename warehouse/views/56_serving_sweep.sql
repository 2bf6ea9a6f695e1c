-- Staging: every serving run's speed row with its best load (a run's goodput at the SLO is its best load's
-- good requests per second). A point of a sweep of vLLM settings carries config.sweep = {scenario, point,
-- settings, min_gain_pct} and counts under its sweep's scenario; a run without a sweep is its scenario's
-- 'default'. Rows written before min_gain_pct existed were judged without a margin: 0.
CREATE OR REPLACE VIEW stg_serving_runs AS
SELECT s.run_id, s.variant_uid, s.engine,
       coalesce(s.config->>'$.sweep.scenario', s.scenario) AS scenario,
       coalesce(s.config->>'$.sweep.point', 'default') AS point,
       s.config->'$.sweep.settings' AS settings, s.status, s.reason,
       g.goodput_requests_per_s, g.load, g.output_tokens_per_s,
       coalesce(TRY_CAST(s.config->>'$.sweep.min_gain_pct' AS DOUBLE), 0) AS min_gain_pct,
       s.details->>'$.kernel' AS kernel, s.scenario AS run_scenario,
       s.config->>'$.sweep.scenario' IS NOT NULL AS swept
FROM stg_speed_results s
LEFT JOIN serving_best_load g USING (run_id, variant_uid, engine, scenario)
WHERE s.config->>'$.kind' = 'serving';

-- The tuned serving config, decided here once for the report and the decision alike. Per variant and
-- serving scenario, k = 1 is the point with the highest goodput at the SLO among vLLM's defaults and the
-- points that beat the defaults by at least min_gain_pct (smaller gains are run-to-run noise; the defaults
-- win ties); k_side = 1 is the best point on its side (the defaults, or the others).
CREATE OR REPLACE VIEW stg_serving_ranked AS
WITH runs AS (
    SELECT *, max(goodput_requests_per_s) FILTER (WHERE point = 'default') OVER w AS default_goodput
    FROM stg_serving_runs
    WINDOW w AS (PARTITION BY run_id, variant_uid, engine, scenario)
)
SELECT *,
       row_number() OVER (w ORDER BY coalesce(point = 'default' OR default_goodput IS NULL
                                              OR goodput_requests_per_s >= default_goodput * (1 + min_gain_pct / 100),
                                              false) DESC,
                                     goodput_requests_per_s DESC NULLS LAST, (point = 'default') DESC, point) AS k,
       row_number() OVER (PARTITION BY run_id, variant_uid, engine, scenario, point = 'default'
                          ORDER BY goodput_requests_per_s DESC NULLS LAST, point) AS k_side,
       count(*) OVER w AS points,
       count(*) FILTER (WHERE status = 'ok') OVER w AS points_ok
FROM runs
WINDOW w AS (PARTITION BY run_id, variant_uid, engine, scenario);

-- Every point of every sweep, under its row's own name (scenario) and its sweep's (sweep).
CREATE OR REPLACE VIEW serving_sweep AS
SELECT run_id, variant_uid, engine, run_scenario AS scenario, scenario AS sweep, point, settings, status, reason,
       kernel, goodput_requests_per_s, load AS best_load, output_tokens_per_s, min_gain_pct
FROM stg_serving_runs
WHERE swept;

-- The tuned config per variant and sweep against vLLM's defaults. gain_pct > 0: the tuned config beat the
-- defaults by that much. best_other_* is the best point other than the defaults, chosen or not: by how
-- much it won or lost.
CREATE OR REPLACE VIEW tuned_serving_config AS
SELECT b.run_id, b.variant_uid, v.name AS variant, b.scenario AS sweep, b.point AS best_point,
       b.settings AS best_settings, b.kernel AS best_kernel, b.goodput_requests_per_s AS best_goodput,
       b.load AS best_load, d.goodput_requests_per_s AS default_goodput, d.load AS default_best_load,
       100 * (b.goodput_requests_per_s - d.goodput_requests_per_s) / nullif(d.goodput_requests_per_s, 0) AS gain_pct,
       o.point AS best_other_point, o.goodput_requests_per_s AS best_other_goodput,
       100 * (o.goodput_requests_per_s - d.goodput_requests_per_s) / nullif(d.goodput_requests_per_s, 0)
           AS best_other_gain_pct,
       b.min_gain_pct, b.points, b.points_ok
FROM stg_serving_ranked b
JOIN variants v ON v.variant_uid = b.variant_uid
LEFT JOIN stg_serving_ranked d ON d.run_id = b.run_id AND d.variant_uid = b.variant_uid AND d.engine = b.engine
                              AND d.scenario = b.scenario AND d.point = 'default' AND d.k_side = 1
LEFT JOIN stg_serving_ranked o ON o.run_id = b.run_id AND o.variant_uid = b.variant_uid AND o.engine = b.engine
                              AND o.scenario = b.scenario AND o.point <> 'default' AND o.k_side = 1
WHERE b.k = 1 AND b.swept;
