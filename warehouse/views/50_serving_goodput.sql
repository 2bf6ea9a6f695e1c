-- Throughput and goodput of each serving load. A request is good when it succeeded and meets every
-- SLO limit set for the scenario; as in vLLM, a request with one output token counts TPOT as 0.
CREATE OR REPLACE VIEW serving_goodput AS
SELECT l.run_id, l.variant_uid, l.engine, l.scenario, l.load, l.max_concurrency, l.request_rate,
       l.num_prompts, l.completed, l.failed, l.duration_s,
       l.slo_ttft_ms, l.slo_tpot_ms, l.slo_e2el_ms,
       coalesce(g.good, 0) AS good_requests,
       l.completed / l.duration_s AS requests_per_s,
       l.output_tokens / l.duration_s AS output_tokens_per_s,
       coalesce(g.good, 0) / l.duration_s AS goodput_requests_per_s,
       coalesce(g.good, 0) / nullif(l.num_prompts, 0) AS good_fraction,
       l.energy_j / nullif(l.output_tokens, 0) AS energy_j_per_token
FROM stg_serving_loads l
LEFT JOIN (
    SELECT r.run_id, r.variant_uid, r.engine, r.scenario, r.load, count(*) AS good
    FROM stg_serving_requests r
    JOIN stg_serving_loads s USING (run_id, variant_uid, engine, scenario, load)
    WHERE r.success
      AND (s.slo_ttft_ms IS NULL OR r.ttft_ms <= s.slo_ttft_ms)
      AND (s.slo_tpot_ms IS NULL OR coalesce(r.tpot_ms, 0) <= s.slo_tpot_ms)
      AND (s.slo_e2el_ms IS NULL OR r.e2el_ms <= s.slo_e2el_ms)
    GROUP BY r.run_id, r.variant_uid, r.engine, r.scenario, r.load
) g USING (run_id, variant_uid, engine, scenario, load);

-- Each serving run's goodput at the SLO: its best load's good requests per second, that load, and its output
-- tokens per second.
CREATE OR REPLACE VIEW serving_best_load AS
SELECT run_id, variant_uid, engine, scenario,
       max(goodput_requests_per_s) AS goodput_requests_per_s,
       arg_max(load, goodput_requests_per_s) AS load,
       arg_max(output_tokens_per_s, goodput_requests_per_s) AS output_tokens_per_s
FROM serving_goodput GROUP BY run_id, variant_uid, engine, scenario;
