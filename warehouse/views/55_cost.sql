-- Cost per million output tokens: price per device-hour × devices ÷ (output tokens/s × 3600) × 1e6.
-- Prices come from the run's own price table (run_prices), so a later price change leaves old rows alone.
-- Devices: vLLM's tensor_parallel_size, an endpoint's num_devices, else 1.

-- Staging: each successful speed row with the price of its device kind and how many devices it used.
CREATE OR REPLACE VIEW stg_speed_price AS
SELECT s.run_id, s.variant_uid, s.engine, s.scenario, s.device, s.tokens_per_s,
       coalesce(TRY_CAST(s.config->>'$.engine_options.tensor_parallel_size' AS INTEGER),
                TRY_CAST(s.config->>'$.endpoint.num_devices' AS INTEGER), 1) AS num_devices,
       p.device AS price_key, p.usd_per_hour
FROM stg_speed_results s
LEFT JOIN LATERAL (
    SELECT arg_max(rp.device, length(rp.device)) AS device, arg_max(rp.usd_per_hour, length(rp.device)) AS usd_per_hour
    FROM run_prices rp
    WHERE rp.run_id = s.run_id AND s.device IS NOT NULL AND starts_with(s.device, rp.device)
) p ON true
WHERE s.status = 'ok';

-- At each scenario's best throughput (offline, latency, and a serving scenario's fastest load).
CREATE OR REPLACE VIEW speed_cost AS
SELECT run_id, variant_uid, engine, scenario, device, price_key, usd_per_hour, num_devices, tokens_per_s,
       usd_per_hour * num_devices / nullif(tokens_per_s * 3600, 0) * 1e6 AS usd_per_million_output_tokens
FROM stg_speed_price;

-- Serving at the SLO: the load with the highest output tokens/s among those that meet the SLO, where a load
-- meets it when at least the SLO's attainment share of its requests are good (succeeded within every limit;
-- default 0.9: the p90 within the SLO), read from the speed row's scenario config.
-- Without an SLO every successful request is good, so this is the fastest load with few enough failures.
CREATE OR REPLACE VIEW serving_cost_at_slo AS
WITH meeting AS (
    SELECT g.run_id, g.variant_uid, g.engine, g.scenario,
           arg_max(g.load, g.output_tokens_per_s) AS slo_load,
           max(g.output_tokens_per_s) AS slo_output_tokens_per_s,
           arg_max(g.goodput_requests_per_s, g.output_tokens_per_s) AS slo_goodput_requests_per_s
    FROM serving_goodput g
    JOIN stg_speed_results s USING (run_id, variant_uid, engine, scenario)
    WHERE g.good_fraction >= coalesce(TRY_CAST(s.config->>'$.slo.attainment' AS DOUBLE), 0.9)
    GROUP BY g.run_id, g.variant_uid, g.engine, g.scenario
)
SELECT m.*, p.device, p.price_key, p.usd_per_hour, p.num_devices,
       p.usd_per_hour * p.num_devices / nullif(m.slo_output_tokens_per_s * 3600, 0) * 1e6
           AS usd_per_million_output_tokens_at_slo
FROM meeting m
JOIN stg_speed_price p USING (run_id, variant_uid, engine, scenario);

-- One row per variant × engine × scenario of a run: cost at peak throughput and, for serving, at the SLO.
CREATE OR REPLACE VIEW variant_cost AS
SELECT c.run_id, c.variant_uid, c.engine, c.scenario, c.device, c.price_key, c.usd_per_hour, c.num_devices,
       c.tokens_per_s, c.usd_per_million_output_tokens,
       s.slo_load, s.slo_output_tokens_per_s, s.usd_per_million_output_tokens_at_slo,
       EXISTS (SELECT 1 FROM stg_serving_loads l WHERE l.run_id = c.run_id AND l.variant_uid = c.variant_uid
               AND l.engine = c.engine AND l.scenario = c.scenario) AS serving
FROM speed_cost c
LEFT JOIN serving_cost_at_slo s USING (run_id, variant_uid, engine, scenario);
