-- The sweep of vLLM serving settings per variant (a serving scenario with `sweep`): every point is a normal
-- serving run whose speed row carries config.sweep = {scenario, point, settings, min_gain_pct}. A point's
-- goodput at the SLO is its best load's goodput (good requests per second). Rows written before
-- min_gain_pct existed were judged without a margin: 0.
CREATE OR REPLACE VIEW serving_sweep AS
SELECT s.run_id, s.variant_uid, s.engine, s.scenario,
       s.config->>'$.sweep.scenario' AS sweep, s.config->>'$.sweep.point' AS point,
       s.config->'$.sweep.settings' AS settings, s.status, s.reason, s.details->>'$.kernel' AS kernel,
       g.goodput_requests_per_s, g.load AS best_load, g.output_tokens_per_s,
       coalesce(TRY_CAST(s.config->>'$.sweep.min_gain_pct' AS DOUBLE), 0) AS min_gain_pct
FROM speed_results s
LEFT JOIN serving_best_load g USING (run_id, variant_uid, engine, scenario)
WHERE s.config->>'$.sweep.scenario' IS NOT NULL;

-- The tuned config per variant and sweep: the point with the highest goodput at the SLO among vLLM's
-- defaults and the points that beat the defaults by at least min_gain_pct (the defaults win ties and
-- smaller gains: those are run-to-run noise). gain_pct > 0: the tuned config beat the defaults by that much.
-- best_other_* is the best point other than the defaults, chosen or not: by how much it won or lost.
CREATE OR REPLACE VIEW tuned_serving_config AS
WITH points AS (
    SELECT *, max(goodput_requests_per_s) FILTER (WHERE point = 'default')
                  OVER (PARTITION BY run_id, variant_uid, sweep) AS default_goodput
    FROM serving_sweep
),
ranked AS (
    SELECT *, row_number() OVER (PARTITION BY run_id, variant_uid, sweep
                                 ORDER BY coalesce(point = 'default' OR default_goodput IS NULL
                                                   OR goodput_requests_per_s >= default_goodput * (1 + min_gain_pct / 100),
                                                   false) DESC,
                                          goodput_requests_per_s DESC NULLS LAST, (point = 'default') DESC, point) AS k,
              row_number() OVER (PARTITION BY run_id, variant_uid, sweep, point = 'default'
                                 ORDER BY goodput_requests_per_s DESC NULLS LAST, point) AS k_side
    FROM points
),
summary AS (
    SELECT run_id, variant_uid, sweep, count(*) AS points, count(*) FILTER (WHERE status = 'ok') AS points_ok
    FROM serving_sweep GROUP BY run_id, variant_uid, sweep
)
SELECT b.run_id, b.variant_uid, v.name AS variant, b.sweep, b.point AS best_point, b.settings AS best_settings,
       b.kernel AS best_kernel, b.goodput_requests_per_s AS best_goodput, b.best_load,
       d.goodput_requests_per_s AS default_goodput, d.best_load AS default_best_load,
       100 * (b.goodput_requests_per_s - d.goodput_requests_per_s) / nullif(d.goodput_requests_per_s, 0) AS gain_pct,
       o.point AS best_other_point, o.goodput_requests_per_s AS best_other_goodput,
       100 * (o.goodput_requests_per_s - d.goodput_requests_per_s) / nullif(d.goodput_requests_per_s, 0)
           AS best_other_gain_pct,
       b.min_gain_pct, s.points, s.points_ok
FROM ranked b
JOIN summary s USING (run_id, variant_uid, sweep)
JOIN variants v ON v.variant_uid = b.variant_uid
LEFT JOIN ranked d ON d.run_id = b.run_id AND d.variant_uid = b.variant_uid AND d.sweep = b.sweep AND d.point = 'default'
LEFT JOIN ranked o ON o.run_id = b.run_id AND o.variant_uid = b.variant_uid AND o.sweep = b.sweep
                  AND o.point <> 'default' AND o.k_side = 1
WHERE b.k = 1;
