-- Latency distribution of each serving load, from its successful requests (milliseconds).
-- TPOT as vLLM defines it; ITL over every gap between streamed chunks of every request.
CREATE OR REPLACE VIEW latency_percentiles AS
WITH req AS (
    SELECT run_id, variant_uid, engine, scenario, load,
           count(*) AS requests,
           count(*) FILTER (WHERE success) AS completed,
           avg(ttft_ms) FILTER (WHERE success) AS ttft_mean_ms,
           quantile_cont(ttft_ms, 0.5) FILTER (WHERE success) AS ttft_p50_ms,
           quantile_cont(ttft_ms, 0.9) FILTER (WHERE success) AS ttft_p90_ms,
           quantile_cont(ttft_ms, 0.99) FILTER (WHERE success) AS ttft_p99_ms,
           avg(tpot_ms) FILTER (WHERE success) AS tpot_mean_ms,
           quantile_cont(tpot_ms, 0.5) FILTER (WHERE success) AS tpot_p50_ms,
           quantile_cont(tpot_ms, 0.9) FILTER (WHERE success) AS tpot_p90_ms,
           quantile_cont(tpot_ms, 0.99) FILTER (WHERE success) AS tpot_p99_ms,
           avg(e2el_ms) FILTER (WHERE success) AS e2el_mean_ms,
           quantile_cont(e2el_ms, 0.5) FILTER (WHERE success) AS e2el_p50_ms,
           quantile_cont(e2el_ms, 0.9) FILTER (WHERE success) AS e2el_p90_ms,
           quantile_cont(e2el_ms, 0.99) FILTER (WHERE success) AS e2el_p99_ms
    FROM stg_serving_requests
    GROUP BY run_id, variant_uid, engine, scenario, load
),
itl AS (
    SELECT run_id, variant_uid, engine, scenario, load,
           avg(gap) AS itl_mean_ms,
           quantile_cont(gap, 0.5) AS itl_p50_ms,
           quantile_cont(gap, 0.9) AS itl_p90_ms,
           quantile_cont(gap, 0.99) AS itl_p99_ms
    FROM (SELECT run_id, variant_uid, engine, scenario, load, unnest(itl_ms) AS gap
          FROM stg_serving_requests WHERE success)
    GROUP BY run_id, variant_uid, engine, scenario, load
)
SELECT req.run_id, req.variant_uid, req.engine, req.scenario, req.load,
       l.max_concurrency, l.request_rate, l.duration_s,
       req.* EXCLUDE (run_id, variant_uid, engine, scenario, load),
       itl.* EXCLUDE (run_id, variant_uid, engine, scenario, load)
FROM req
LEFT JOIN itl USING (run_id, variant_uid, engine, scenario, load)
LEFT JOIN stg_serving_loads l USING (run_id, variant_uid, engine, scenario, load);
